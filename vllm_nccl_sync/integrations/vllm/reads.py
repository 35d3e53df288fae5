"""A vLLM worker's read set (`wire.reads`): which block of every checkpoint tensor it reads.

The worker's own `load_weights` is rehearsed on each tensor of the engine's checkpoint
(`engine.handshake.Reference`), one at a time, through `VllmWeightLoader.prepare` into a plan of
its own: `CopyPlan.rehearse` records every copy into a parameter as a view of the tensor loaded
and writes nothing. Each recorded view becomes a `Block` of the tensor, exactly: the view and the
block are compared as the same offsets, sizes and strides once size-1 dimensions are dropped and
contiguous ones merged. On the CPU backend the packed (weight-less) linears get full-size weights
for the rehearsal and their packed ones back after it (`patches.cpu_repack`), so their loaders
shard as they do in an update. A tensor whose reads cannot be followed (a loader that computes,
a refused replay, a view that is no block) is read whole, with the reason, and so is a tensor
copied into a layer that loads layerwise (re-laid out after loading: the CPU backend's MoE
experts), whose loads are not replayed.

Computed once per model object (`read_set_of`); vLLM is imported lazily.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from vllm_nccl_sync.engine.handshake import Reference
from vllm_nccl_sync.integrations.vllm.copyplan import CopyPlan
from vllm_nccl_sync.wire.packing import DTYPES, inside
from vllm_nccl_sync.wire.reads import MAX_BLOCKS, Block, Read, ReadSet, overlaps, whole

View = tuple[int, tuple[int, ...], tuple[int, ...]]
"""Element offset, sizes, strides of a view of a contiguous tensor (`copyplan._Op.src`)."""

_held: weakref.WeakKeyDictionary[torch.nn.Module, ReadSet] = weakref.WeakKeyDictionary()


def _canonical(view: View) -> View:
    """`view` with size-1 dimensions dropped and contiguous neighbours merged (same elements)."""
    offset, sizes, strides = view
    dims = sorted(((n, s) for n, s in zip(sizes, strides, strict=True) if n != 1),
                  key=lambda d: -d[1])
    merged: list[tuple[int, int]] = []
    for n, s in dims:
        if merged and merged[-1][1] == n * s:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    return offset, tuple(n for n, _ in merged), tuple(s for _, s in merged)


def _unravel(i: int, shape: list[int]) -> list[int]:
    out = []
    for n in reversed(shape):
        i, r = divmod(i, n)
        out.append(r)
    return out[::-1]


def block_of(view: View, shape: list[int]) -> Block | None:
    """The block of a contiguous tensor of `shape` whose elements `view` reads exactly once
    each (None: it reads no block; an empty view reads the empty block at its offset)."""
    offset, sizes, strides = view
    if 0 in sizes:
        start = _unravel(offset, shape) if offset < math.prod(shape) else [0] * len(shape)
        return Block(start, start)
    last = offset + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
    start, stop = _unravel(offset, shape), [x + 1 for x in _unravel(last, shape)]
    if any(z <= a for a, z in zip(start, stop, strict=True)):
        return None
    contiguous = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    box = (offset, tuple(z - a for a, z in zip(start, stop, strict=True)), tuple(contiguous))
    return Block(start, stop) if _canonical(view) == _canonical(box) else None


def _joined(a: Block, b: Block) -> Block | None:
    """`a` and `b` as one block, if they differ in one dimension only, where they touch or
    overlap."""
    differ = [d for d in range(len(a.start)) if (a.start[d], a.stop[d]) != (b.start[d], b.stop[d])]
    if len(differ) != 1:
        return a if not differ else None
    d = differ[0]
    if a.start[d] <= b.stop[d] and b.start[d] <= a.stop[d]:
        lo, hi = min(a.start[d], b.start[d]), max(a.stop[d], b.stop[d])
        return Block(a.start[:d] + [lo] + a.start[d + 1:], a.stop[:d] + [hi] + a.stop[d + 1:])
    return None


def merged(blocks: list[Block]) -> list[Block]:
    """`blocks` as fewer that read the same: empty ones and ones inside another dropped,
    neighbours that touch or overlap joined."""
    out: list[Block] = []
    for b in blocks:
        if b.numel() == 0 or any(inside(b, o) for o in out):
            continue
        out = [o for o in out if not inside(o, b)]
        joined = True
        while joined:
            joined = False
            for i, o in enumerate(out):
                if (j := _joined(o, b)) is not None:
                    out.pop(i)
                    b, joined = j, True
                    out = [o for o in out if not inside(o, b)]
                    break
        out.append(b)
    return out


def _read(dtype: str, shape: list[int], views: list[View] | None, why: str) -> Read:
    """The read of a tensor whose loader copied `views` of it (None: unknown, `why`)."""
    if views is None:
        return whole(dtype, shape, why)
    blocks = [block_of(v, shape) for v in views]
    if None in blocks:
        return whole(dtype, shape, "its loader copies a view of it that is no block")
    out = merged([b for b in blocks if b is not None])
    if len(out) > MAX_BLOCKS:
        return whole(dtype, shape, f"its loader reads more than {MAX_BLOCKS} blocks of it")
    if any(overlaps(a, b) for i, a in enumerate(out) for b in out[i + 1:]):
        return whole(dtype, shape, "its loader reads overlapping blocks of it")
    return Read(dtype, list(shape), out)


@contextlib.contextmanager
def _full_linears(model: torch.nn.Module) -> Iterator[None]:
    """On the CPU backend: packed linears with full-size weights meanwhile (`cpu_repack`)."""
    from vllm_nccl_sync.integrations.vllm.patches import cpu_repack

    unpacked = cpu_repack.unpack_linears(model) if cpu_repack.applies() else []
    try:
        yield
    finally:
        for entry in unpacked:
            cpu_repack.restore(entry)


@torch.no_grad()
def _rehearsed(loader: Any, tensors: dict[str, tuple[str, list[int]]]) -> dict[str, Read]:
    """Each tensor's read by `loader` (a `VllmWeightLoader`), rehearsed one at a time."""
    out: dict[str, Read] = {}
    layerwise = tuple(f"{n}." for n in loader.layerwise_layers())
    with _full_linears(loader.model):
        for name, (dtype, shape) in tensors.items():
            t = torch.empty(shape, dtype=DTYPES[dtype], device=loader.device)
            plan = CopyPlan()  # one per tensor: a loader that computes taints only its tensor
            why = loader.rehearse_reads([(name, t)], plan) or plan.off
            why = f"its loads are not followed: {why}" if why else ""
            ops = [op for e in plan.entries.values() for op in e.ops]
            if not why and (lw := [op.param for op in ops if op.param.startswith(layerwise)]):
                why = f"its layer loads layerwise ({lw[0]} is re-laid out after loading)"
            if why:
                out[name] = _read(dtype, shape, None, why)
                continue
            views = [op.src for op in ops if op.src is not None] if plan.entries else None
            out[name] = _read(dtype, shape, views, "its loader failed when rehearsed")
    return out


def read_set_of(worker: Any, ref: Reference | None) -> ReadSet:
    """`worker`'s read set of checkpoint `ref` (its `worker.reference`), computed once per
    model object; ValueError without a local checkpoint (`ref` None) to name the tensors, or
    for a model that cannot be updated in place."""
    from vllm_nccl_sync.integrations.vllm.loader import VllmWeightLoader

    model = worker.model_runner.model
    if model not in _held:
        if ref is None:
            raise ValueError("no local safetensors checkpoint: its tensors are unknown here")
        rank = int(worker.vllm_config.parallel_config.rank)
        _held[model] = ReadSet(rank, _rehearsed(VllmWeightLoader(worker), ref.tensors))
    return _held[model]
