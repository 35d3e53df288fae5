"""Read sets: which part of every checkpoint tensor one engine worker's loaders read. Pure.

A worker loads full checkpoint tensors, but its loaders copy only part of most of them into its
parameters: under tensor parallelism a column-parallel linear or a vocab-parallel embedding reads
a range of rows, a row-parallel linear a range of columns, norms and other replicated tensors the
whole. A `ReadSet` states it per tensor, as a list of `Block`s (`[start, stop)` per dimension):
exact for each of these shards (a row range is `start=[a, 0], stop=[b, n]`, a column block
`start=[0, a], stop=[m, b]`), two integers per dimension however many rows a column block spans
(as byte ranges, a column block of an `m`-row weight is `m` ranges), and bounded. A tensor the
worker's reads could not be derived for is read whole, and `Read.why` says why.

`problems` checks the read sets of the workers of one engine replica together: each block
inside its tensor, the blocks of one worker disjoint, and every element of every tensor read by
some worker. The structs themselves are the wire's (`protocol`): a worker's `Hello` carries its
read set, and a trainer that holds every worker's plans shard to shard (`trainer.shards`).
"""

from __future__ import annotations

import itertools
import math

from vllm_nccl_sync.outcomes import Kind, Problem, clip
from vllm_nccl_sync.wire.packing import DTYPES, overlaps, tensor_nbytes
from vllm_nccl_sync.wire.protocol import MAX_BLOCKS, MAX_WHY_CHARS, Block, Read, ReadSet

__all__ = ["MAX_BLOCKS", "Block", "Read", "ReadSet", "nbytes", "overlaps", "problems", "whole"]

MAX_CELLS = 1 << 20
"""Cells of the grid the coverage check walks for one tensor (blocks' bounds per dimension)."""


def nbytes(x: Read | ReadSet) -> int:
    """Bytes one worker reads: of one tensor (a `Read`) or of all of them (a `ReadSet`)."""
    if isinstance(x, ReadSet):
        return sum(nbytes(r) for r in x.tensors.values())
    return x.numel() * DTYPES[x.dtype].itemsize if x.dtype in DTYPES else 0


def whole(dtype: str, shape: list[int], why: str = "") -> Read:
    """The whole tensor (`why`: the reason it is whole, when its reads are not known)."""
    return Read(dtype, list(shape), [Block([0] * len(shape), list(shape))],
                clip(why, MAX_WHY_CHARS))


def _read_problem(r: Read) -> str:
    """What is wrong with `r` on its own ("" if nothing)."""
    if r.dtype not in DTYPES:
        return f"unknown dtype {r.dtype!r}"
    for b in r.blocks:
        if not len(b.start) == len(b.stop) == len(r.shape):
            return f"block {b.start}..{b.stop} has not the {len(r.shape)} dims of {r.shape}"
        if not all(0 <= a <= z <= n for a, z, n in zip(b.start, b.stop, r.shape, strict=True)):
            return f"block {b.start}..{b.stop} is outside the tensor's shape {r.shape}"
    if r.why and r.blocks != whole(r.dtype, r.shape).blocks:
        return f"read whole ({r.why}) but its blocks are not the whole tensor"
    return ""


def _unread(shape: list[int], blocks: list[Block]) -> list[int] | None:
    """The first element of `shape` no block covers (None: all covered), on the grid the blocks'
    bounds make; raises ValueError past `MAX_CELLS` cells."""
    cuts = [sorted({0, n, *(b.start[d] for b in blocks), *(b.stop[d] for b in blocks)})
            for d, n in enumerate(shape)]
    if math.prod(len(c) - 1 for c in cuts) > MAX_CELLS:
        raise ValueError(f"its blocks cut it into more than {MAX_CELLS} cells")
    for cell in itertools.product(*(c[:-1] for c in cuts)):
        if not any(all(a <= x < z for x, a, z in zip(cell, b.start, b.stop, strict=True))
                   for b in blocks):
            return list(cell)
    return None


def _worker_problems(rs: ReadSet, seen: dict[str, Read]) -> list[str]:
    """`rs`'s problems on its own and against the tensors other workers named (`seen`)."""
    out = []
    for name, r in rs.tensors.items():
        where = f"worker {rs.worker}, tensor {name!r}"
        if text := _read_problem(r):
            out.append(f"{where}: {text}")
            continue
        first = seen.setdefault(name, r)
        if (first.dtype, first.shape) != (r.dtype, r.shape):
            out.append(f"{where}: {r.dtype}{r.shape} but another worker reads it as "
                       f"{first.dtype}{first.shape}")
        for a, b in itertools.combinations(r.blocks, 2):
            if overlaps(a, b):
                out.append(f"{where}: blocks {a.start}..{a.stop} and {b.start}..{b.stop} overlap")
                break
    return out


def problems(sets: list[ReadSet]) -> list[Problem]:
    """Every way the read sets of one engine replica's workers fail to tile their checkpoint,
    each a `Kind.READS` problem naming the worker and the tensor (empty: they do)."""
    out: list[str] = []
    seen: dict[str, Read] = {}
    for rs in sets:
        out += _worker_problems(rs, seen)
    for name, ref in seen.items():
        blocks = [b for rs in sets if (r := rs.tensors.get(name)) is not None
                  and not _read_problem(r) for b in r.blocks]
        try:
            gap = _unread(ref.shape, blocks) if tensor_nbytes(ref.dtype, ref.shape) else None
        except ValueError as e:
            out.append(f"tensor {name!r}: cannot check its coverage: {e}")
            continue
        if gap is not None:
            out.append(f"tensor {name!r}: element {gap} of {ref.shape} is read by no worker")
    return [Problem(Kind.READS, text) for text in out]
