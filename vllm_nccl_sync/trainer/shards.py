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
than a bucket in chunks of whole elements), and the sets' buckets interleaved by bytes, so that
point-to-point streams to different workers overlap rather than queue. Every header states its exact `length`, and each worker
checks its blocks against its own read set before any byte moves (`engine.update`).

Several senders (an FSDP trainer's ranks) each offer the block of every tensor they hold
(`Offer.parts`, from a DTensor's local shard: `held`); the coordinator plans, for each worker
and each sender, the intersection of what the worker reads and what the sender holds
(`shard_plan`), so no rank ever gathers a full tensor. A tensor some sender holds whole goes
from one of them, balanced by bytes (`owners.plan_owners`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

import msgspec
import torch

from vllm_nccl_sync.outcomes import PushError, clip
from vllm_nccl_sync.trainer.owners import (
    OwnershipError,
    by_bytes,
    interleaved,
    meta,
    plan_owners,
)
from vllm_nccl_sync.trainer.tensors import without_aliases
from vllm_nccl_sync.wire.packing import Bucket, Region, dtype_name, plan_buckets
from vllm_nccl_sync.wire.protocol import Block, BucketHeader, Hello, ReadSet, TensorSpec
from vllm_nccl_sync.wire.reads import problems, whole

log = logging.getLogger(__name__)

Offered = Mapping[int, tuple[list[TensorSpec], Mapping[str, Block]]]
"""Per sender rank: the tensors it offered (full dtype and shape) and the blocks it holds of
those it holds only a block of (`Offer.parts`)."""

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
    yield from _cut(groups, capacity, alone)


def _cut(groups: Mapping[Group, list[tuple[str, torch.Tensor | Region]]], capacity: int,
         alone: int) -> list[Bucket]:
    """The buckets of each set of receivers' tensors, interleaved by bytes (`by_bytes`): on a
    plane that sends point to point, the workers' streams then overlap instead of queueing."""
    queues = {i: [_as_slots(b, group)
                  for b in plan_buckets(named, capacity, alone)]  # type: ignore[arg-type]
              for i, (group, named) in enumerate(groups.items())}
    return [b for _, b in by_bytes(queues)]


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


def held(named: Mapping[str, torch.Tensor]) -> tuple[list[tuple[str, torch.Tensor]],
                                                     dict[str, list[int]], dict[str, Block]]:
    """This rank's tensors as it sends them: `(name, local tensor)` (a DTensor's local shard),
    each tensor's full shape, and the block of the full tensor each DTensor's shard is."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    items, shapes, parts = [], {}, {}
    for name, t in named.items():
        shapes[name] = list(t.shape)
        if isinstance(t, DTensor):
            size, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                                 t.placements)
            parts[name] = Block(list(offset), [o + n for o, n in zip(offset, size, strict=True)])
            t = t.to_local()
        items.append((name, t))
    return list(without_aliases(dict(items))), shapes, parts


def _intersection(a: Block, b: Block) -> Block | None:
    start = [max(x, y) for x, y in zip(a.start, b.start, strict=True)]
    stop = [min(x, y) for x, y in zip(a.stop, b.stop, strict=True)]
    return Block(start, stop) if all(x < z for x, z in zip(start, stop, strict=True)) else None


def _sources(offers: Offered, owner: Mapping[str, int], name: str) -> list[tuple[int, Block]]:
    """Who sends tensor `name` from which block they hold: its owner among the senders that
    hold it whole (`owner`), else every sender holding a block of it."""
    spec = next(t for specs, _ in offers.values() for t in specs if t.name == name)
    if name in owner:
        return [(owner[name], whole(spec.dtype, spec.shape).blocks[0])]
    return [(r, parts[name]) for r, (_, parts) in sorted(offers.items()) if name in parts]


def _pieces(spec: TensorSpec, sources: list[tuple[int, Block]],
            reads: Mapping[int, ReadSet]) -> Iterator[tuple[int, Group, torch.Tensor | Region]]:
    """`(sender, receivers, what it sends them)` for tensor `spec`; OwnershipError where the
    senders hold less than some receivers read."""
    t = meta(spec)
    for group, part in _split(spec.name, t, reads):
        wanted = part.blocks if isinstance(part, Region) else whole(spec.dtype, spec.shape).blocks
        got = 0
        for src, have in sources:
            cut = [x for b in wanted if (x := _intersection(b, have)) is not None]
            got += sum(b.numel() for b in cut)
            if cut == wanted and not isinstance(part, Region):
                yield src, group, t
            elif cut:
                yield src, group, Region(t, cut)
        if got != sum(b.numel() for b in wanted):
            raise OwnershipError(f"tensor {spec.name!r}: the senders hold {got} of the "
                                 f"{sum(b.numel() for b in wanted)} elements receivers "
                                 f"{list(group or reads)} read (blocks overlap or are missing)")


def shard_plan(offers: Offered, reads: Mapping[int, ReadSet], capacity: int, alone: int,
               version: int, protocol: int, force: bool, staged: bool) -> list[BucketHeader]:
    """Every header of an update from several senders, shard to shard (see the module text);
    raises `OwnershipError` where the senders' tensors or blocks do not make one plan."""
    whole_offers = {r: ([t for t in specs if t.name not in parts], False)
                    for r, (specs, parts) in offers.items()}
    owner = plan_owners(whole_offers)
    specs = {t.name: t for specs, _ in offers.values() for t in specs}
    groups: dict[int, dict[Group, list[tuple[str, torch.Tensor | Region]]]] = {}
    for name, spec in specs.items():
        for src, group, part in _pieces(spec, _sources(offers, owner, name), reads):
            groups.setdefault(src, {None: []}).setdefault(group, []).append((name, part))
    cut = {src: _cut(by_group, capacity, alone) for src, by_group in sorted(groups.items())}
    return interleaved(cut, version, protocol, force, staged)


def local_buckets(headers: list[BucketHeader], items: Mapping[str, torch.Tensor],
                  parts: Mapping[str, Block]) -> Iterator[tuple[BucketHeader, list]]:
    """Each header of `headers` with its slots' sources from this sender's tensors: a slot of
    blocks cut out of the block this sender holds (`parts`; else the whole tensor)."""
    for h in headers:
        sources: list = []
        for s in h.slots:
            t = items[s.name]
            if s.blocks is None:
                sources.append(t)
                continue
            origin = parts[s.name].start if s.name in parts else [0] * len(s.shape)
            sources.append(Region(t, [Block([a - o for a, o in zip(b.start, origin, strict=True)],
                                            [z - o for z, o in zip(b.stop, origin, strict=True)])
                                      for b in s.blocks]))
        yield h, sources


def specs_of(items: list[tuple[str, torch.Tensor]],
             shapes: Mapping[str, list[int]]) -> list[TensorSpec]:
    """The offer of `items`: each tensor's wire dtype and full shape."""
    return [TensorSpec(n, dtype_name(t.dtype), shapes[n]) for n, t in items]


def fallbacks(reads: Mapping[int, ReadSet]) -> dict[str, str]:
    """The tensors some worker reads whole because its reads could not be followed, each with
    the first reason given (`Read.why`), logged once."""
    out: dict[str, str] = {}
    for rank in sorted(reads):
        for name, r in reads[rank].tensors.items():
            if r.why:
                out.setdefault(name, f"rank {rank}: {r.why}")
    if out:
        log.warning("shard to shard: %d tensor(s) go whole to some worker: %s", len(out),
                    "; ".join(f"{n} ({w})" for n, w in list(out.items())[:5]))
    return out
