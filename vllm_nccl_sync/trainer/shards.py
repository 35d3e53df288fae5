"""Shard to shard: the buckets of a state dict when every worker published its read set.

Each worker tells, in its `Hello`, which blocks of every checkpoint tensor its own loaders read
(`wire.reads`). For each tensor the receivers are grouped by what they read of it:

* a tensor every receiver reads whole goes in buckets for every receiver (one broadcast, as
  without read sets);
* otherwise each set of receivers that read the same blocks of it (the workers of replicas at
  one TP rank, engines alike) gets those blocks, cut out of the tensor (`packing.Region`), in
  buckets that name them (`BucketHeader.to`) and go to them alone, point to point; a receiver
  that reads the whole tensor among others that do not gets it whole that way; a receiver that
  reads nothing of it gets nothing.

The buckets of each set of receivers are cut as `plan_buckets` cuts a stream (a region larger
than a bucket in chunks of whole elements), one set after the other: the buckets for every
receiver first, then each worker's. Every header states its exact `length`, and each worker
checks its blocks against its own read set before any byte moves (`engine.update`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import msgspec
import torch

from vllm_nccl_sync.outcomes import PushError, clip
from vllm_nccl_sync.wire.packing import Bucket, Region, plan_buckets
from vllm_nccl_sync.wire.protocol import Block, Hello, ReadSet
from vllm_nccl_sync.wire.reads import problems, whole

Group = tuple[int, ...] | None
"""The receiver ranks a bucket goes to; None: every receiver."""


def _blocks(reads: ReadSet, name: str, t: torch.Tensor) -> list[Block] | None:
    """The blocks of `t` this worker reads (None: the whole tensor, or a read that does not
    fit it: the worker then checks the tensor against its model as without read sets)."""
    r = reads.tensors.get(name)
    if r is None or r.shape != list(t.shape):
        return None
    return None if r.blocks == whole(r.dtype, r.shape).blocks else r.blocks


def _split(name: str, t: torch.Tensor,
           reads: Mapping[int, ReadSet]) -> list[tuple[Group, torch.Tensor | Region]]:
    """What of `t` goes to which receivers: `(receivers, the tensor or a region of it)`."""
    by_blocks: dict[str, tuple[list[Block] | None, list[int]]] = {}
    for rank in sorted(reads):
        blocks = _blocks(reads[rank], name, t)
        key = repr(blocks)
        by_blocks.setdefault(key, (blocks, []))[1].append(rank)
    if list(by_blocks) == ["None"]:
        return [(None, t)]
    return [(tuple(ranks), t if blocks is None else Region(t, blocks))
            for blocks, ranks in by_blocks.values() if blocks is None or blocks]


def _as_slots(bucket: Bucket, group: Group) -> Bucket:
    """`bucket` of one group: each region's slots as blocks of their tensor, and its `to`."""
    slots = [s if not isinstance(src, Region) else
             msgspec.structs.replace(s, shape=list(src.tensor.shape), blocks=src.blocks)
             for s, src in zip(bucket.slots, bucket.sources, strict=True)]
    return Bucket(slots, bucket.sources, None if group is None else list(group))


def shard_buckets(items: list[tuple[str, torch.Tensor]], reads: Mapping[int, ReadSet],
                  capacity: int, alone: int) -> Iterator[Bucket]:
    """The buckets of state dict `items` for receivers whose read sets are `reads` (by rank);
    regions are cut out of their tensors only when their bucket is packed."""
    groups: dict[Group, list[tuple[str, torch.Tensor | Region]]] = {None: []}
    for name, t in items:
        for group, part in _split(name, t, reads):
            groups.setdefault(group, []).append((name, part))
    for group, named in groups.items():
        for bucket in plan_buckets(named, capacity, alone):  # type: ignore[arg-type]
            yield _as_slots(bucket, group)


def read_sets(hellos: Mapping[int, Hello]) -> dict[int, ReadSet]:
    """Every receiver's read set, by rank, checked per engine replica (`wire.reads.problems`:
    inside its tensors, disjoint, every element read by some worker); `PushError` naming the
    rank that published none, or each problem with its worker and tensor."""
    missing = sorted(r for r, h in hellos.items() if h.reads is None)
    if missing:
        raise PushError(f"shard to shard (SyncConfig.shard): ranks {missing} published no read "
                        "set (an older receiver, or a worker that cannot compute one)")
    out = {r: h.reads for r, h in hellos.items() if h.reads is not None}
    replicas: dict[int, list[int]] = {}
    for r, h in sorted(hellos.items()):
        replicas.setdefault(h.replica, []).append(r)
    for replica, ranks in replicas.items():
        found = problems([out[r] for r in ranks])
        if found:
            shown = "; ".join(p.text for p in found[:5])
            more = f" (+{len(found) - 5} more)" if len(found) > 5 else ""
            raise PushError(clip(f"refused the read sets of replica {replica} (ranks {ranks}): "
                                 f"{shown}{more}"))
    return out
