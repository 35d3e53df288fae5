"""Copies that checksum what they move, for a receiver that reads the sender's memory where it lies.

A receiver asks for that through a `Tap` set in `tapping` while its loads run; whoever copies a
tensor the tap wants whole may sum it on the way (`copy_tapped`, `copies_tapped`) and hand the
terms over, so that the sender's bytes are read once for both the load and the checksum, and the
checksum is of exactly the bytes written. On CUDA the copies are `cuda_sums`' kernel (one launch
for many); on the host `integrity.copies_summed_host` (one native call for many).
"""

from __future__ import annotations

import contextvars
from collections import Counter
from collections.abc import Sequence

import torch

from vllm_nccl_sync.wire.cuda_sums import Terms, accumulators, copy_summed_cuda, usable
from vllm_nccl_sync.wire.integrity import copies_summed_host


def copy_summed(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[Terms] | None:
    """`dst.copy_(src)` for each pair of tensors of one size on one device (see `fusable`;
    CUDA: flat uint8), returning each source's `integrity` terms: its bytes are read once (CUDA:
    in one launch; the host: `copies_summed_host`, in one call). None if the kernel failed
    before any copy (then the caller copies)."""
    if not pairs[0][1].is_cuda:
        return copies_summed_host(pairs)
    return copy_summed_cuda(pairs)


def copy_tapped(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`: through `copy_summed` where the receiver's tap (`tapping`) wants `src`
    whole (handing it `src`'s terms), a plain copy (`non_blocking`) elsewhere."""
    if copies_tapped([(dst, src)]):
        dst.copy_(src, non_blocking=True)


def clone_tapped(src: torch.Tensor) -> torch.Tensor:
    """`src.clone()`, summed on the way where the receiver's tap wants `src` (`copy_tapped`)."""
    out = torch.empty_like(src)
    copy_tapped(out, src)
    return out


def copies_tapped(pairs: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`dst.copy_(src)` for the pairs whose `src` the receiver's tap wants whole, in one
    `copy_summed` that hands it their terms; the pairs left to copy (all of them without a tap
    or with one that wants none). A destination written twice is left to the caller's order."""
    tap = tapping.get()
    if tap is None or not tap.wanted:  # no tap, or it wants nothing (no bucket read in place)
        return pairs
    keys = [_key(s) for _, s in pairs]
    dsts = Counter(d.data_ptr() for d, _ in pairs)
    whole = [i for i, (d, s) in enumerate(pairs)
             if keys[i] in tap.wanted and dsts[d.data_ptr()] == 1 and fusable(d, s)]
    chosen = [pairs[i] for i in whole]
    if chosen and chosen[0][1].is_cuda:  # the kernel takes flat bytes
        chosen = [(d.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8))
                  for d, s in chosen]
    got = copy_summed(chosen) if chosen else None
    if got is None:
        return pairs
    for i, terms in zip(whole, got, strict=True):
        tap.got[keys[i]] = terms
    done = set(whole)
    return [p for i, p in enumerate(pairs) if i not in done]


def fusable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether `dst.copy_(src)` may go through `copy_summed`: both contiguous, of one dtype and
    size, on one device; on CUDA 16-byte aligned with Triton installed, on the host 8-byte
    aligned."""
    if not (src.dtype == dst.dtype and src.shape == dst.shape
            and src.is_contiguous() and dst.is_contiguous()):
        return False
    if src.is_cpu:  # checked before `device`, which makes an object per call
        return dst.is_cpu and src.data_ptr() % 8 == 0 and dst.data_ptr() % 8 == 0
    return src.device == dst.device and usable(src) and dst.data_ptr() % 16 == 0


def _key(t: torch.Tensor) -> tuple[int, int]:
    """Where `t`'s bytes lie, as a `Tap` knows its sources: (address, bytes)."""
    return t.data_ptr(), t.nbytes


class Tap:
    """The sources a receiver checksums, by (address, bytes); a copy that reads one whole
    may hand its terms over (`put`) so that the receiver need not read it again (`take`)."""

    def __init__(self) -> None:
        self.wanted: set[tuple[int, int]] = set()
        self.got: dict[tuple[int, int], Terms] = {}

    def want(self, part: torch.Tensor) -> None:
        self.wanted.add(_key(part))

    def wants(self, t: torch.Tensor) -> bool:
        return _key(t) in self.wanted

    def put(self, t: torch.Tensor, terms: Terms) -> None:
        self.got[_key(t)] = terms

    def take(self, part: torch.Tensor) -> Terms | None:
        return self.got.get(_key(part))

    def sum_missing(self, parts: Sequence[torch.Tensor]) -> None:
        """Sum the flat uint8 CUDA `parts` not summed yet, all in one launch (where the kernel
        can: the others are left to `integrity`'s torch path)."""
        todo = list({(p.data_ptr(), p.numel()): p for p in parts if self.take(p) is None}.values())
        for p, terms in zip(todo, accumulators(todo) if todo else [], strict=True):
            if terms is not None:
                self.put(p, terms)


tapping: contextvars.ContextVar[Tap | None] = contextvars.ContextVar("tapping", default=None)
"""The receiver's `Tap` while its loads run (None elsewhere)."""
