"""Several senders: who sends which tensor, and the plan's buckets (pure functions).

Each sender offers tensors: the ones it owns (`owned`, e.g. its pipeline stage or a per-rank
`WeightSource`), or candidates it can produce (replicated or FSDP ranks), which are balanced by
bytes over the senders that offered them. Each owner's tensors are cut into buckets of its own,
in its offer's order, and the owners' buckets are interleaved by bytes so that every sender's
group is busy until the end.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TypeVar

import torch

from vllm_nccl_sync.outcomes import SyncError
from vllm_nccl_sync.wire.packing import DTYPES, Bucket, plan_buckets, tensor_nbytes
from vllm_nccl_sync.wire.protocol import BucketHeader, TensorSpec

K = TypeVar("K", int, str)


class OwnershipError(SyncError, ValueError):
    """The senders' offers cannot make one plan; the text names the tensor and ranks."""


def plan_owners(offers: Mapping[int, tuple[list[TensorSpec], bool]]) -> dict[str, int]:
    """Owner rank of every offered tensor, from `{rank: (specs, owned)}`.

    Owned tensors keep their rank (two owners of one name: refused). Candidate tensors go,
    largest first, to the least-loaded sender that offered them (ties: lowest rank); an owned
    tensor counts towards its rank's load. The result is deterministic. Raises `OwnershipError`.
    """
    owner: dict[str, int] = {}
    spec: dict[str, TensorSpec] = {}
    load = dict.fromkeys(offers, 0)
    for rank in sorted(offers):
        specs, owned = offers[rank]
        for t in specs:
            if t.name in spec and spec[t.name] != t:
                raise OwnershipError(f"tensor {t.name!r} offered as {t.dtype} {t.shape} by one "
                                     f"sender and {spec[t.name].dtype} {spec[t.name].shape} "
                                     f"by another (rank {rank})")
            spec[t.name] = t
            if not owned:
                continue
            if t.name in owner and owner[t.name] != rank:
                raise OwnershipError(f"tensor {t.name!r} is owned by sender ranks "
                                     f"{owner[t.name]} and {rank}")
            owner[t.name] = rank
            load[rank] += tensor_nbytes(t.dtype, t.shape)
    candidates: dict[str, list[int]] = {}
    for rank in sorted(offers):
        specs, owned = offers[rank]
        if not owned:
            for t in specs:
                if t.name not in owner:
                    candidates.setdefault(t.name, []).append(rank)
    by_size = sorted(candidates, key=lambda n: (-tensor_nbytes(spec[n].dtype, spec[n].shape), n))
    for name in by_size:
        rank = min(candidates[name], key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += tensor_nbytes(spec[name].dtype, spec[name].shape)
    return owner


def meta(t: TensorSpec) -> torch.Tensor:
    """A tensor of `t`'s dtype and shape that holds no data (to plan buckets by size)."""
    return torch.empty(t.shape, dtype=DTYPES[t.dtype], device="meta")


def plan_headers(order: Mapping[int, list[TensorSpec]], capacity: int, version: int,
                 protocol: int, force: bool = False, staged: bool = False,
                 alone: int | None = None) -> list[BucketHeader]:
    """Every bucket header of an update whose tensors are `order[rank]` (each owner's, in its
    order): buckets cut per owner, then interleaved by bytes (the owner with the fewest bytes
    placed so far goes next; ties: lowest rank); `seq` counts over all of them, `src` names the
    owner, and only the very last is `is_last`. An empty update is one empty bucket of rank 0.
    `alone`: as in `packing.cut`."""
    cut = {r: list(plan_buckets(((t.name, meta(t)) for t in specs), capacity, alone))
           for r, specs in sorted(order.items())}
    return interleaved(cut, version, protocol, force, staged)


def by_bytes(queues: Mapping[K, list[Bucket]]) -> Iterator[tuple[K, Bucket]]:
    """Every bucket of `queues`, each queue's in order, interleaved by bytes: the queue with the
    fewest bytes placed so far goes next (ties: the lowest key), so that every lane or link
    stays busy until the end."""
    left = {k: list(b) for k, b in queues.items()}
    placed = dict.fromkeys(left, 0)
    while any(left.values()):
        key = min((k for k in left if left[k]), key=lambda k: (placed[k], k))
        bucket = left[key].pop(0)
        placed[key] += bucket.length
        yield key, bucket


def interleaved(cut: Mapping[int, list[Bucket]], version: int, protocol: int,
                force: bool = False, staged: bool = False) -> list[BucketHeader]:
    """The headers of every sender's buckets (`cut[rank]`, in order), interleaved by bytes: the
    sender with the fewest bytes placed so far goes next (ties: lowest rank); `seq` counts over
    all of them, `src` names the sender, and only the very last is `is_last`. None: one empty
    bucket of rank 0."""
    headers: list[BucketHeader] = []
    total = sum(len(b) for b in cut.values())
    for rank, bucket in by_bytes(cut):
        seq = len(headers)
        headers.append(BucketHeader(protocol, version, seq, bucket.length, seq == total - 1,
                                    bucket.slots, force, staged, rank, to=bucket.to))
    if not headers:
        headers.append(BucketHeader(protocol, version, 0, 0, True, [], force, staged, 0))
    return headers
