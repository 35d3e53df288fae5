"""Engine side, data plane: load received HF-named tensors into a running vLLM model.

Loading goes through vLLM's own `model.load_weights`, so TP sharding and qkv/gate_up stacking are
vLLM's. Three ways, chosen per model (`mode="auto"`):

* plain (GPU, unquantized): an in-place `copy_` into the existing parameters; CUDA graphs stay valid
  and nothing extra is allocated. What `load_weights` copied where is recorded on the first update
  and replayed as plain copies after (`copyplan`; off, with the reason, for a loader that
  computes).
* layerwise (quantized linears, e.g. `quantization="fp8"` online): the parameters hold kernel-format
  tensors (FP8, transposed, with scales), so checkpoint-format tensors go through vLLM's layerwise
  reload, which re-quantizes each layer once it is whole and copies the result into the original
  storage (`patches.layerwise`; received tensors an incomplete layer still holds are cloned,
  since the receive buffer is reused).
* CPU backend, where vLLM packs linear weights after loading: `begin()`/`finish()` unpack and
  re-pack them through `patches.cpu_repack`. The weights unpacked for each update are made as
  the last update's were, so `load_weights`' copies into them are replayed too.

Whatever the mode, the per-layer rule of `patches.postload` applies on top: layers in kernel
format that the mode does not cover (e.g. experts pre-packed by the CPU MoE backend) go through the
layerwise reload on their own, and layers holding tensors derived from other layers (MLA's
`W_UK_T`/`W_UV`) are re-processed in place after the update.

vLLM is imported lazily.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_nccl_sync.integrations.vllm.copyplan import CopyPlan, without_hooks
from vllm_nccl_sync.integrations.vllm.model_slots import ModelSlots, tied_aliases
from vllm_nccl_sync.outcomes import Kind, Problem
from vllm_nccl_sync.wire.taps import copy_tapped

log = logging.getLogger(__name__)


def _outside(names: set[str], modules: list[str]) -> set[str]:
    """`names` without the parameters of `modules`."""
    return {n for n in names if not any(n.startswith(m + ".") for m in modules)}


def _fp8_blocks(vllm_config: Any) -> dict[str, tuple[int, int]]:
    """`{HF weight name: block}` of the weights the engine's checkpoint stores block-FP8."""
    block = getattr(vllm_config.quant_config, "weight_block_size", None)
    if not block:
        return {}
    from vllm_nccl_sync.engine.handshake import local_model_dir, read_safetensors_index
    from vllm_nccl_sync.integrations.vllm.block_fp8 import blocks_of

    mc = vllm_config.model_config
    path = local_model_dir(mc.model, getattr(mc, "revision", None))
    return blocks_of(read_safetensors_index(path), block) if path else {}


def _tied(vllm_config: Any) -> bool:
    mc = vllm_config.model_config
    return bool(getattr(mc.hf_text_config, "tie_word_embeddings", False))


_WEIGHTLESS_SPECULATION = ("ngram", "ngram_gpu", "suffix", "extract_hidden_states")
"""Speculative methods (vLLM `SpeculativeConfig.method`) that keep no weights of their own."""


def drafter_problem(vllm_config: Any) -> Problem | None:
    """Why an engine's speculative decoding stops in-place updates (None if it does not).

    A drafter with weights (an MTP head, EAGLE, a draft checkpoint) is a second model in the
    worker that `model.load_weights` never reaches: it would go on proposing from the old weights.
    Greedy output stays right (vLLM verifies every proposal against the target), but acceptance
    silently decays, so such engines are refused rather than half updated."""
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None) if spec is not None else None
    if method is None or method in _WEIGHTLESS_SPECULATION:
        return None
    return Problem(Kind.DRAFTER,
                   f"speculative decoding with method {method!r} keeps a draft model whose "
                   "weights an update would not reach (it would keep proposing from the old "
                   "ones); serve without speculative_config, or with a weight-free method "
                   "(ngram, suffix), to hot-swap weights")


class VllmWeightLoader:
    """Loads full HF-named tensors into a vLLM worker's model: `begin()`, `load()`*, `finish()`.

    `load` never keeps references to the tensors it is given, so the caller may refill its receive
    buffer as soon as it returns (on CUDA the copies are queued on the current stream, ahead of
    any refill).
    """

    MODES = ("auto", "plain", "layerwise")

    def __init__(self, worker: Any, mode: str = "auto") -> None:
        if mode not in self.MODES:
            raise ValueError(f"mode {mode!r} must be one of {self.MODES}")
        self.model: torch.nn.Module = worker.model_runner.model
        self.device: torch.device = torch.device(worker.device)
        self.vllm_config = worker.vllm_config
        self.mode = mode
        """auto: layerwise if a linear layer is quantized, else plain. The CPU backend re-packs
        whatever the mode."""
        self._lw: Any = None  # patches.layerwise when used, False when not (resolved lazily)
        self._lw_layers: list[torch.nn.Module] | None = None  # None: every layer goes layerwise
        self._post: Any = None  # integrations.vllm.patches.postload (resolved lazily)
        self._lw_active = False  # a layerwise update is in progress
        self._retained_peak = 0
        # vLLM rejects a tied alias sent without its canonical name: see load()
        self.aliases = tied_aliases(self.model)
        if "lm_head.weight" not in self.aliases and _tied(self.vllm_config):
            # models without an lm_head module (e.g. Gemma): it is the embedding
            params = dict(self.model.named_parameters())
            embed = [n for n in params if n.endswith("embed_tokens.weight")]
            if "lm_head.weight" not in params and len(embed) == 1:
                self.aliases["lm_head.weight"] = embed[0]
        self._cpu: Any = None  # integrations.vllm.patches.cpu_repack, on the CPU backend only
        # layers unpacked by begin() and not yet re-packed (None: no update in progress)
        self._unpacked: list[Any] | None = None
        self.loaded: set[str] = set()
        self.stats: dict[str, int] = {}
        self._rows: dict[str, tuple[str, torch.Tensor, int, int] | None] = {}  # see _row_target
        self._plan = CopyPlan()  # load_weights' copies, replayed (integrations.vllm.copyplan)
        self._replay = False  # this update may replay them (plain loading: no layerwise)
        self._by_rows = 0  # tensors of this update loaded row by row
        self._layers: tuple[dict, dict] | None = None  # see _refreshed
        self._slots: ModelSlots | None = None  # see _params
        if why := drafter_problem(self.vllm_config):
            raise why.at("this engine cannot be updated in place").error()
        self._postload()  # refuses a model that cannot be updated in place, saying why
        self._fp8_blocks = _fp8_blocks(self.vllm_config)
        if getattr(self.vllm_config, "lora_config", None) is not None:
            from vllm_nccl_sync.integrations.vllm.patches.lora import base_loads_through_wrappers

            base_loads_through_wrappers()  # base weights of a LoRA engine (vLLM 0.26)

    def _repacker(self) -> Any:
        if self._cpu is None:
            from vllm_nccl_sync.integrations.vllm.patches import cpu_repack as cpu_repack_patch

            self._cpu = cpu_repack_patch if cpu_repack_patch.applies() else False
            if self._cpu:
                cpu_repack_patch.check_version()
        return self._cpu

    def _postload(self) -> Any:
        """patches.postload; ValueError if the model cannot be updated in place."""
        if self._post is None:
            from vllm_nccl_sync.integrations.vllm.patches import postload as postload_patch

            postload_patch.check_version()
            if why := postload_patch.unsupported(self.model):
                raise ValueError(f"this model cannot be updated in place: {why}")
            self._post = postload_patch
        return self._post

    def _layerwise(self) -> Any:
        """patches.layerwise if any layer is loaded layerwise, else False (`_lw_layers`:
        which layers, None for all)."""
        if self._lw is None:
            from vllm_nccl_sync.integrations.vllm.patches import layerwise as layerwise_patch

            whole = self.mode != "plain" and not self._repacker() and (
                self.mode == "layerwise" or layerwise_patch.applies(self.model))
            if not whole:  # the CPU backend always re-packs its linears; the rest by the rule
                kernel = set(self._postload().transformed(self.model))
                self._lw_layers = [m for n, m in self.model.named_modules() if n in kernel]
            use = whole or bool(self._lw_layers)
            if use:
                layerwise_patch.check_version()
            self._lw = layerwise_patch if use else False
        return self._lw

    def begin(self) -> None:
        """Prepare for a full or partial load (CPU: give packed linears a full weight again;
        quantized: put the layers back in checkpoint format for a layerwise reload)."""
        if self._unpacked is not None:
            self.abort()  # an earlier update never finished
        self.loaded = set()
        self.stats = {}
        self._by_rows = 0
        cpu = self._repacker()
        self._unpacked = cpu.unpack_linears(self.model) if cpu else []
        lw = self._layerwise()
        if lw:
            lw.begin(self.model, self._lw_layers)
            self._lw_active = True
            self._retained_peak = 0
        self._replay = not lw and not self._fp8_blocks
        if self._replay:
            self._plan.replayed = self._plan.loaded = self._plan.graphs.launched = 0
            params = self._params()
            made = {id(e.layer.weight) for e in self._unpacked}  # as each update makes them
            self._plan.refresh(params, frozenset(n for n, p in params.items() if id(p) in made))

    def _refreshed(self) -> tuple[dict, dict]:
        """The layers `finish` refreshes (`patches.postload.expert_layers`, `derived_layers`):
        found once, a model's modules do not change after start-up."""
        if self._layers is None:
            post = self._postload()
            self._layers = (post.expert_layers(self.model), post.derived_layers(self.model))
        return self._layers

    def _params(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer under every name, as it is now (what replayed copies may
        write); their places are found once (`integrations.vllm.model_slots`)."""
        if self._slots is None:
            self._slots = ModelSlots(self.model)
        return self._slots.now()

    def _batch(self, named_tensors: list[tuple[str, torch.Tensor]]
               ) -> list[tuple[str, torch.Tensor]]:
        """The tensors under vLLM's names; a tied alias dropped when its canonical name is in
        the same batch, else loaded under the canonical name."""
        names = {n for n, _ in named_tensors}
        return [(self.aliases.get(n, n), t) for n, t in named_tensors
                if n not in self.aliases or self.aliases[n] not in names]

    @torch.no_grad()
    def prepare(self, named_tensors: list[tuple[str, torch.Tensor]],
                plan: CopyPlan | None = None) -> CopyPlan | None:
        """Before a staged update is loaded, while the engine still serves: record what
        `load_weights` would copy for these tensors without writing the model
        (`CopyPlan.rehearse`), so the swap replays plain copies from the first update on.
        `plan`: record into it instead (`reads`). The plan, None where loads are not replayed."""
        if self._unpacked is not None or self._fp8_blocks or self._layerwise():
            return None  # mid-update, or a load that is never replayed
        plan = plan if plan is not None else self._plan
        plan.refresh(self._params())
        plan.rehearse(self._batch(named_tensors), self.model.load_weights)
        return plan

    def rehearse_reads(self, named_tensors: list[tuple[str, torch.Tensor]],
                       plan: CopyPlan) -> str:
        """Record into `plan` what `load_weights` would copy of these tensors, whatever loads
        layerwise (a worker's read set: `reads`); "" or why nothing can be recorded."""
        if self._unpacked is not None:
            return "an update is being loaded"
        if self._fp8_blocks:
            return "block-FP8 weights are quantized from whole tensors"
        if self._layerwise() and self._lw_layers is None:
            return "every layer loads layerwise"
        plan.refresh(self._params())
        plan.rehearse(self._batch(named_tensors), self.model.load_weights)
        return ""

    def layerwise_layers(self) -> list[str]:
        """The names of the layers loaded layerwise (re-laid out after each load)."""
        if not self._layerwise() or self._lw_layers is None:
            return []
        mine = {id(m) for m in self._lw_layers}
        return [n for n, m in self.model.named_modules() if id(m) in mine]

    @torch.no_grad()
    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> set[str]:
        """Load one batch through `model.load_weights` (a tied alias such as `lm_head.weight`
        under its canonical name, see `_batch`, so the shared tensor and LM head get it);
        returns the vLLM parameter names it filled."""
        if self._unpacked is None:
            raise RuntimeError("VllmWeightLoader.load() called before begin()")
        batch = self._batch(named_tensors)
        if self._fp8_blocks:  # bf16 for a block-FP8 weight: quantized as the checkpoint is
            from vllm_nccl_sync.integrations.vllm.block_fp8 import expand

            batch = expand(batch, self._fp8_blocks)
        if self._replay:
            done = self._plan.load(batch, self.model.load_weights)
        else:
            done = set(self.model.load_weights(iter(batch)) or ())
        self.loaded |= done
        if self._lw_active:  # incomplete layers must not keep views of the caller's buffer
            held = self._lw.retain_pending(self.model)
            self._retained_peak = max(self._retained_peak, held)
        return done

    def _row_target(self, name: str, shape: list[int]) -> tuple[str, torch.Tensor, int, int] | None:
        """`(parameter name, parameter, first, end)` if HF tensor `name` of `shape` is loaded by
        copying its rows `[first, end)` unchanged into the parameter's leading rows: what vLLM's
        `VocabParallelEmbedding.weight_loader` does for an unquantized embedding or LM head
        (whole, or this worker's vocabulary rows under TP). None for anything else."""
        if name in self._rows:
            return self._rows[name]
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )

        found = None
        pname = self.aliases.get(name, name)
        module_name, _, leaf = pname.rpartition(".")
        try:
            module = self.model.get_submodule(module_name)
        except AttributeError:
            module = None
        lw = self._layerwise()
        if (isinstance(module, VocabParallelEmbedding) and leaf == "weight"
                and isinstance(module.quant_method, UnquantizedEmbeddingMethod)
                and not (lw and (self._lw_layers is None or module in self._lw_layers))
                and len(shape) == 2 and shape[0] == module.org_vocab_size):
            param = module.weight
            si = module.shard_indices
            first, end = si.org_vocab_start_index, si.org_vocab_end_index
            if (si.num_added_elements == 0 and list(param.shape[1:]) == shape[1:]
                    and end - first <= param.shape[0]):
                found = (pname, param, first, end)
        self._rows[name] = found
        return found

    @torch.no_grad()
    def load_rows(self, name: str, rows: torch.Tensor, first_row: int, shape: list[int]) -> bool:
        """Copy whole rows of dim 0 of HF tensor `name` straight into its parameter, so a tensor
        larger than a bucket (an embedding, an LM head) needs no staging copy on the engine.
        False, before touching anything, where the parameter does not hold the checkpoint's rows
        as they are (the receiver then reassembles the tensor and loads it through `load`)."""
        if self._unpacked is None:
            raise RuntimeError("VllmWeightLoader.load_rows() called before begin()")
        target = self._row_target(name, shape)
        if target is None:
            return False
        pname, param, first, end = target
        lo, hi = max(first_row, first), min(first_row + rows.shape[0], end)
        if lo < hi:  # this worker's rows in this chunk (summed on the way if a tap wants them)
            with without_hooks():
                dst, src = param[lo - first : hi - first], rows[lo - first_row : hi - first_row]
                copy_tapped(dst, src)
        if first_row + rows.shape[0] == shape[0]:
            self.loaded.add(pname)
            self._by_rows += 1
        return True

    def unwritten(self) -> list[str] | None:
        """The model's parameters this update's loads filled nothing into, as `load_weights`
        reported them (vLLM's own loader checks the same after loading a checkpoint). None where
        it cannot tell: layers loaded layerwise end with kernel-format parameters of other names."""
        if self._layerwise():
            return None
        return sorted({n for n, _ in self.model.named_parameters()} - self.loaded)

    def finish(self) -> None:
        """Make the loaded weights take effect (CPU: re-pack; kernel-format layers: process;
        derived tensors: refresh) and release temporary full weights.

        Raises ValueError, after keeping their old values, if layers loaded layerwise on their own
        got only part of their elements (e.g. some experts of an MoE layer)."""
        if self._unpacked is None:
            return
        mc = self.vllm_config.model_config
        if self._lw_active and self._lw_layers is None:
            self._lw_active = False
            self._unpacked = None
            self._lw.finish(self.model, mc)
            self.stats = {"layerwise": 1, "retained_peak_bytes": self._retained_peak}
            return
        cpu = self._repacker()
        counts: dict[str, int] = {}
        while self._unpacked:  # on an error the rest stays listed for abort()
            status = cpu.repack(self._unpacked[0])
            self._unpacked.pop(0)
            counts[status] = counts.get(status, 0) + 1
        self._unpacked = None
        if cpu:
            counts["kept_repacked"] = cpu.repack_kept(self.model)
        partial: list[str] = []
        if self._lw_active:
            self._lw_active = False
            partial = self._lw.partial(self.model)
            (self._lw.abort if partial else self._lw.finish)(self.model, mc)
            counts["layerwise_layers"] = len(self._lw_layers or ())
            counts["retained_peak_bytes"] = self._retained_peak
        post, (experts, derived) = self._postload(), self._refreshed()
        counts["experts_relaid"] = post.refresh_experts(self.model, _outside(self.loaded, partial),
                                                        experts)
        counts["derived_refreshed"] = post.refresh_derived(self.model, mc, self.loaded, derived)
        counts["loaded_by_rows"] = self._by_rows
        if self._replay:
            counts.update(replayed=self._plan.replayed, through_loader=self._plan.loaded,
                          graph_launches=self._plan.graphs.launched)
        self.stats = counts
        if partial:
            raise ValueError(f"{len(partial)} layer(s) got only part of their weights and keep "
                             f"their old values: {', '.join(partial[:4])}; send every tensor of "
                             "such a layer (e.g. all experts of an MoE layer) in one update")

    def abort(self) -> None:
        """Best effort after a failed update: re-pack what was loaded, restore what was not.

        Every layer ends up usable (old, new or a mix of weights), so the engine keeps serving."""
        if self._unpacked is None:
            return
        mc = self.vllm_config.model_config
        if self._lw_active:  # layers loaded in full keep the new weights, the rest the old ones
            self._lw_active = False
            try:
                partial = self._lw.partial(self.model)
                self.loaded = _outside(self.loaded, partial)  # they keep their old tensors
                self._lw.abort(self.model, mc)
            except Exception:
                log.exception("finalizing the layerwise reload after a failed update failed")
            if self._lw_layers is None:
                self._unpacked = None
                return
        cpu = self._repacker()
        entries, self._unpacked = self._unpacked, None
        if not cpu:
            self._refresh_after_abort(mc)
            return
        for e in entries:
            try:
                cpu.repack(e)
            except Exception:
                log.exception(
                    "re-packing %s failed; restoring its old weight", type(e.layer).__name__
                )
                try:
                    cpu.restore(e)
                except Exception:
                    log.exception("restoring failed")
        try:
            cpu.repack_kept(self.model)
        except Exception:
            log.exception("re-packing the LM head/embeddings failed")
        self._refresh_after_abort(mc)

    def _refresh_after_abort(self, model_config: Any) -> None:
        try:
            experts, derived = self._refreshed()
            self._postload().refresh_experts(self.model, self.loaded, experts)
            self._postload().refresh_derived(self.model, model_config, self.loaded, derived)
        except Exception:
            log.exception("refreshing derived tensors after a failed update failed")
