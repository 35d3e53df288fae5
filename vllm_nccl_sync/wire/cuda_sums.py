"""The integrity sums of many flat CUDA tensors in one kernel launch (Triton), and copies that
compute them on the way.

A bucket read where its slots lie has one part per tensor: 171 for a 7B model's state dict.
Summed with torch, each part costs a few kernel launches and about 50 us of host time; here one
launch sums every part's 4 KiB rows (weighted by their odd position) and its tail of words, per
block of rows, and one `index_add_` adds the blocks up per part. The values are `integrity`'s
terms exactly (wrap-around int64); parts not aligned to 16 bytes, and the bytes past a part's
last whole word, are left to torch. Without Triton, or once its kernel failed to build or launch
(logged once, with the reason), every part goes to torch.

`copy_summed_cuda` is the same kernel writing each word it reads to a destination as well: a
receiver whose loads are plain copies of whole tensors (a replayed `load_weights`) reads the
sender's memory once for both the copy and the checksum (through its tap: `taps`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

log = logging.getLogger(__name__)


class Row(NamedTuple):
    """Element `index` of the 1-D int64 device tensor `sums`: one of the sums one launch
    computed, named without a tensor of its own (making 171 such views cost about 0.14 ms of
    host time on an H100's host, and stacking them to read them back another 0.11 ms;
    `integrity.read_back` reads `sums` once)."""

    sums: torch.Tensor
    index: int


Terms = list[tuple[torch.Tensor | Row | int, int]]
_COLS = 512  # 64-bit words per row, as `integrity`
_ROW_BYTES = 8 * _COLS
_ROWS = 64  # rows of one block (one program)
_TILE = 4  # rows read per step
_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_failed: list[str] = []  # why the kernel is not used (it failed once)

if triton is not None:

    @triton.jit
    def _blocks(table, out, COPY: tl.constexpr, TILE: tl.constexpr, STEPS: tl.constexpr,
                COLS: tl.constexpr):
        """Program p: `table[p] = (source, destination, first row, count, kind)`, source and
        destination in 64-bit words from the table's own address (16-byte aligned: the loads
        and stores go 16 bytes at a time); kind 0 sums `count` rows weighted by 2 * row + 1,
        kind 1 a tail of `count` words weighted by 31 * (2 * j + 1); with COPY every word read
        is written to the destination too."""
        pid = tl.program_id(0)
        src = table + tl.multiple_of(tl.load(table + pid * 5), 2)
        dst = table + tl.multiple_of(tl.load(table + pid * 5 + 1), 2)
        first = tl.load(table + pid * 5 + 2)
        count = tl.load(table + pid * 5 + 3)
        kind = tl.load(table + pid * 5 + 4)
        cols = tl.arange(0, COLS)
        if kind == 0:  # summed per thread as it goes, across threads once at the end
            acc = tl.zeros([TILE, COLS], dtype=tl.int64)
            for step in range(STEPS):
                r = step * TILE + tl.arange(0, TILE)
                m = r < count
                at = r[:, None] * COLS + cols[None, :]
                x = tl.load(src + at, mask=m[:, None], other=0)
                if COPY:
                    tl.store(dst + at, x, mask=m[:, None])
                acc += x * (2 * (first + r) + 1)[:, None]
            total = tl.sum(tl.sum(acc, axis=1), axis=0)
        else:
            m = cols < count
            x = tl.load(src + cols, mask=m, other=0)
            if COPY:
                tl.store(dst + cols, x, mask=m)
            total = 31 * tl.sum(x * (2 * cols.to(tl.int64) + 1))
        tl.store(out + pid, total)


def _table(pairs: list[tuple[int, int, int]], key: tuple, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The programs' table for `(source address, destination address, bytes)` per part, and
    the part each program adds to (cached per `key`: the addresses, never the values)."""
    got = _tables.get(key)
    if got is not None:
        return got
    rows_of, owners = [], []
    for i, (src, dst, nbytes) in enumerate(pairs):
        rows, tail = divmod(nbytes // 8, _COLS)
        blocks = torch.arange(0, rows, _ROWS, dtype=torch.int64)
        if blocks.numel():
            rows_of.append(torch.stack([src + blocks * _ROW_BYTES, dst + blocks * _ROW_BYTES,
                                        blocks, (rows - blocks).clamp(max=_ROWS),
                                        torch.zeros_like(blocks)], dim=1))
        if tail:
            rows_of.append(torch.tensor([[src + rows * _ROW_BYTES, dst + rows * _ROW_BYTES,
                                          0, tail, 1]]))
        owners.append(torch.full((blocks.numel() + bool(tail),), i, dtype=torch.int64))
    if len(_tables) > 256:
        _tables.clear()
    table = torch.cat(rows_of).to(device).contiguous()
    table[:, :2] -= table.data_ptr()  # addresses as offsets from the table's (16-aligned)
    table[:, :2] //= 8
    got = _tables[key] = (table, torch.cat(owners).to(device))
    return got


def tables() -> list[torch.Tensor]:
    """Every programs' table now cached (a captured launch reads its table by address: whoever
    keeps such a launch keeps these)."""
    return [t for pair in _tables.values() for t in pair]


def usable(t: torch.Tensor) -> bool:
    return (triton is not None and not _failed and t.is_cuda and t.data_ptr() % 16 == 0
            and t.numel() >= 8)


def _guarded(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor] | None
             ) -> list[Terms] | None:
    """`_run`, or None (and torch from then on) if the kernel cannot be built or launched."""
    try:
        return _run(srcs, dsts)
    except Exception as e:  # noqa: BLE001 - a Triton or driver problem: torch does it instead
        _failed.append(repr(e))
        log.warning("integrity sums fall back to torch: the Triton kernel failed: %r", e)
        return None


def _run(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor] | None) -> list[Terms]:
    """Per flat uint8 source (all usable), its terms; with `dsts`, its whole words copied."""
    device = srcs[0].device
    pairs = [(s.data_ptr(), s.data_ptr() if dsts is None else dsts[i].data_ptr(), s.numel())
             for i, s in enumerate(srcs)]
    table, owners = _table(pairs, (device.index, dsts is not None, *pairs), device)
    partial = torch.empty(table.shape[0], dtype=torch.int64, device=device)
    with torch.cuda.device(device):
        _blocks[(table.shape[0],)](table, partial, COPY=dsts is not None, TILE=_TILE,
                                   STEPS=_ROWS // _TILE, COLS=_COLS)
    sums = torch.zeros(len(srcs), dtype=torch.int64, device=device).index_add_(0, owners, partial)
    out: list[Terms] = [[(Row(sums, j), 1)] for j in range(len(srcs))]
    for j, (_, _, nbytes) in enumerate(pairs):
        if nbytes % 8:  # the bytes past the last whole word
            whole = nbytes // 8 * 8
            rest = srcs[j][whole:]
            if dsts is not None:
                dsts[j][whole:].copy_(rest)
            odd = torch.arange(1, 2 * rest.numel(), 2, dtype=torch.int64, device=device)
            out[j].append(((rest.to(torch.int64) * odd).sum(), 1_000_003))
    return out


def accumulators(parts: Sequence[torch.Tensor]) -> list[Terms | None]:
    """Per flat uint8 CUDA tensor, its `integrity` terms, the whole words of all of them summed
    in one launch (queued on the current stream); None where torch must do it (no Triton, or
    not aligned to 16 bytes)."""
    fast = [i for i, p in enumerate(parts) if usable(p)]
    out: list[Terms | None] = [None] * len(parts)
    got = _guarded([parts[i] for i in fast], None) if fast else None
    for i, terms in zip(fast, got or [], strict=bool(got)):
        out[i] = terms
    return out


def copy_summed_cuda(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[Terms] | None:
    """`dst.copy_(src)` for each pair of flat uint8 CUDA tensors of one size (see
    `taps.fusable`), in one launch that also returns each source's `integrity` terms: its bytes
    are read once. None if the kernel failed before any copy (then the caller copies)."""
    return _guarded([s for _, s in pairs], [d for d, _ in pairs])


def warm(device: torch.device) -> None:
    """Build both kernels (summing, and copying while summing) on `device` now: a receiver or
    sender calls it when it joins, so that no update waits for Triton's compiler."""
    if triton is None or _failed:
        return
    with torch.cuda.device(device):
        src = torch.zeros(2 * _ROW_BYTES, dtype=torch.uint8, device=device)
        accumulators([src])
        copy_summed_cuda([(torch.empty_like(src), src)])
        torch.cuda.synchronize(device)
