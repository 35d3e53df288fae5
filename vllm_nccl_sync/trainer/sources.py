"""Tensor sources for a push from a sharded trainer: full tensors, one at a time.

An FSDP2 trainer (`torch.distributed.fsdp.fully_shard`) holds every parameter as a `DTensor`
shard. `full_tensors(model)` all-gathers them one parameter at a time (`DTensor.full_tensor()`)
and yields `(name, full tensor)` on the pushing rank only, so what it keeps alive is bounded by
the tensor it just yielded; plug it straight into `PushClient.push`:

    gen = full_tensors(model, dtype=torch.bfloat16)      # on EVERY rank of the trainer's group
    if rank == 0:
        client.push(gen, version=step)                   # streams it bucket by bucket
    else:
        for _ in gen:                                    # yields nothing: only takes part in
            pass                                         # each all-gather, in the same order

Every rank must run the generator to the end, in the same order: each `full_tensor()` is a
collective of the parameter's mesh. Names are the model's `state_dict()` names (Hugging Face
names for a transformers model; wrapper segments from `torch.compile` and activation
checkpointing are dropped); a tied parameter (`lm_head.weight` = `model.embed_tokens.weight`) is
gathered and sent once, under its first name, which the receivers understand. `dtype` casts
floating-point tensors *before* the gather (the local shard), so an fp32 master copy is gathered
and sent as bf16 at half the bytes; leave `PushClient.push(dtype=...)` unset then.

The same stream as a vLLM `WeightSource`, for trainer backends written against vLLM's API:
`FSDPWeightSource` (`vllm_nccl_sync.weight_transfer`).

Why not `model.state_dict()`: under FSDP2 its values are sharded `DTensor`s, and gathering them
all at once (`full_tensor()` on each, then a mapping) holds the whole unsharded model. Streaming
gives up the plan handshake that a mapping gets before any byte moves; each bucket's header is
still checked by every receiver before its collective, and a mismatch is an error on every side.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["full_tensors", "named_sources", "source_name", "wire_dtype"]

_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.")
"""Module-name segments added by wrappers (torch.compile, activation checkpointing), not by the
model: dropped so names match the checkpoint the engine loaded."""


def source_name(name: str) -> str:
    """`name` with the wrappers' segments removed (`model._orig_mod.x` -> `model.x`)."""
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


def named_sources(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's state-dict entries (sharded `DTensor`s under FSDP2, nothing gathered),
    without later names of a tensor already listed (tied weights).

    The same list, in the same order, on every rank of an FSDP group: ties are recognised by
    object identity (a tied `nn.Parameter` is one object under several names, sharded or not),
    never by addresses that differ between ranks (an empty shard has none).
    """
    seen: set[int] = set()
    out: list[tuple[str, torch.Tensor]] = []
    # keep_vars: the parameters themselves; FSDP2's pre-save hook first puts them back in their
    # sharded form (after a forward the root's parameters may be unsharded).
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out.append((source_name(name), t))
    return out


def wire_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """What `t` travels as: `dtype` for a floating tensor when one is given, else its own."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _materialize(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The full tensor of `t`: an all-gather for a `DTensor` (a collective of its mesh), the
    tensor itself otherwise (no copy unless cast)."""
    with torch.no_grad():  # scoped to the gather: a generator must not leak grad mode
        if wire_dtype(t, dtype) != t.dtype:
            t = t.to(dtype)  # a DTensor casts its local shard: the gather moves the cast bytes
        full_tensor = getattr(t, "full_tensor", None)
        return full_tensor() if callable(full_tensor) else t.detach()


def _rank(group: dist.ProcessGroup | None) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def full_tensors(
    module: torch.nn.Module,
    *,
    dtype: torch.dtype | None = None,
    push_rank: int | None = 0,
    rank: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, full tensor)` for every state-dict entry of `module`, gathering one
    parameter at a time; run it to the end on every rank of the trainer's group, in lockstep.

    Only the rank `push_rank` (default 0) of `group` (default: the default process group)
    yields; the others gather and drop each tensor, and yield nothing. `push_rank=None`: every
    rank yields. `rank`: this process's rank in the trainer's group, when it is not
    `dist.get_rank(group)`. `dtype`: cast floating-point tensors to it before gathering.

    Memory: the generator holds one full tensor at a time (the one it yielded, dropped before
    the next gather); whatever the consumer still references stays alive, of course.
    """
    me = _rank(group) if rank is None else rank
    keep = push_rank is None or me == push_rank
    for name, t in named_sources(module):
        full = _materialize(t, dtype)
        if keep:
            yield name, full
        # Dropped before the next gather: two full tensors never coexist because of us.
        del full, t

