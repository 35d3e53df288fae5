"""Reading in place on the same-host planes: the storages a sender exported (`Exports`) and the
segments a receiver mapped of them (`Mappings`). How a storage is exported and mapped is the
plane's own (`ipc`: CUDA IPC; `shm`: shared memory through the sender's file descriptor); which
segment a header names, and which range of it, is checked here."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from vllm_nccl_sync.wire.protocol import Source


class Exports:
    """The storages a sender exported for reading in place: per storage address, its segment
    (-1: not exportable) while the storage lives. A new storage at a dead one's address is a
    new segment. Entries of dead storages are swept as the registry grows, and their segments
    handed back to be forgotten, so a trainer that pushes fresh tensors every step (FSDP's
    gathered full tensors) keeps neither entries nor published handles of old ones."""

    def __init__(self) -> None:
        self._by_address: dict[int, tuple[int, StorageWeakRef]] = {}
        self._sweep_at = 64
        self._made = 0

    def __len__(self) -> int:
        return len(self._by_address)

    def get(self, storage: torch.UntypedStorage) -> int | None:
        """The segment `storage` was exported as, or None if it was not (or that one died)."""
        seen = self._by_address.get(storage.data_ptr())
        return None if seen is None or seen[1].expired() else seen[0]

    def number(self) -> int:
        """A new segment's number (never one given before)."""
        self._made += 1
        return self._made - 1

    def add(self, storage: torch.UntypedStorage, segment: int) -> list[int]:
        """Remember `storage` as `segment`; the segments of storages that died (to forget)."""
        key = storage.data_ptr()
        old = self._by_address.get(key)
        dead = [old[0]] if old is not None and old[1].expired() else []
        self._by_address[key] = (segment, StorageWeakRef(storage))
        if len(self._by_address) >= self._sweep_at:
            gone = [k for k, (_, ref) in self._by_address.items() if ref.expired()]
            dead += [self._by_address.pop(k)[0] for k in gone]
            self._sweep_at = 2 * max(len(self._by_address), 32)
        return [d for d in dead if d >= 0]


class Mappings:
    """A receiver's mapped segments of the sender's memory (each mapped once, by `open`) and the
    ranges handed out of them (the same view each update)."""

    def __init__(self, open_segment: Callable[[int], torch.Tensor]) -> None:
        self._open = open_segment
        self._mapped: dict[int, torch.Tensor] = {}
        self._views: dict[tuple[int, int, int], torch.Tensor] = {}

    def view(self, at: Source, length: int) -> torch.Tensor:
        """The `length` bytes at `at`; `ValueError` for a range past its segment's end (or what
        `open` raises)."""
        view = self._views.get((at.segment, at.offset, length))
        if view is not None:
            return view
        seg = self._mapped.get(at.segment)
        if seg is None:
            seg = self._mapped[at.segment] = self._open(at.segment)
        if at.offset + length > seg.numel():
            raise ValueError(f"bytes [{at.offset}, {at.offset + length}) of the sender's memory "
                             f"segment {at.segment} lie past its {seg.numel()} bytes")
        view = self._views[(at.segment, at.offset, length)] = seg[at.offset : at.offset + length]
        return view

    def keep(self, segments: set[int]) -> None:
        """Unmap every segment but `segments` (the sender may free the memory of the others)."""
        for k in [k for k in self._mapped if k not in segments]:
            del self._mapped[k]
        self._views = {k: v for k, v in self._views.items() if k[0] in self._mapped}
