"""The shared-memory data plane: a trainer and CPU engines on one host (see `shared`).

The sender's two bucket buffers are one piece of shared memory with no name anywhere
(`memfd_create`), handed to each receiver as a descriptor (`handoff`), so nothing else can open
it and nothing is left behind if a process dies. A receiver copies each bucket once out of it
into its own buffer, summing the bytes as it copies them, gives the sender's buffer back at once,
compares that sum with the sender's `Digest` and loads from its copy: what it loads is exactly
what it checked, whatever anyone writes into the shared memory meanwhile.

Read in place (`export`/`mapped`, as on `ipc`): a tensor of a state dict whose storage is
already in shared memory (`tensor.share_memory_()`, `model.share_memory()`: PyTorch keeps it as
a file descriptor) is not packed: the sender hands that descriptor to each receiver over the
handoff socket, its header names where its bytes lie, and each receiver maps the storage once.
A receiver refuses a descriptor that is not shared memory, belongs to another user than the
sender's (as the kernel names it), or holds another size than announced; it maps the storage
copy-on-write, so nothing it does can write the sender's memory. A bucket read in place is
loaded straight out of the sender's memory, by copies that sum the bytes they write (`taps`),
and its checksum compared with the sender's `Digest` right after its loads: one copy per byte; a
mismatch fails the update (the engine, loaded in place, is reported inconsistent).
Storages not in shared memory are packed as before; none is ever moved into shared memory by
this plane.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import msgspec
import torch
import torch.multiprocessing as torch_mp

from vllm_nccl_sync.planes.handoff import Creds, checked_fd, new_memory
from vllm_nccl_sync.planes.shared import SharedTransport


class ShmMemory(msgspec.Struct, frozen=True):
    """Shared memory handed over as one descriptor: its size in bytes."""

    nbytes: int


class ShmTransport(SharedTransport):
    """CPU buckets in shared memory the receivers map once (see the module)."""

    backend = "shm"
    digest_per_bucket = True
    peer_harm = (
        "a peer cannot crash this process: a sender publishing another length than the header's "
        "fails the receiver's wait (nothing loaded, group broken); bytes garbled in the shared "
        "memory fail the bucket's checksum, taken of the receiver's own copy, which is what it "
        "loads; a receiver that never releases a buffer is lost at the timeout (at once if its "
        "process exited); memory comes only as descriptors from the sender the kernel names, "
        "and is mapped only if it is shared memory of the sender's user of the size announced "
        "(copy-on-write, read only into the receiver's own copy)")

    def _device(self, device: torch.device | None) -> torch.device:
        return torch.device("cpu")

    def _export(self, nbytes: int,
                keep: list[Any]) -> tuple[bytes, list[int], list[torch.Tensor]]:
        fd = new_memory(2 * nbytes)
        try:
            mem = mmap.mmap(fd, 2 * nbytes)
        except OSError:
            os.close(fd)
            raise
        keep.append(mem)
        return msgspec.msgpack.encode(ShmMemory(2 * nbytes)), [fd], self._views(mem, nbytes)

    def _open(self, handle: bytes, fds: list[int], nbytes: int, keep: list[Any],
              sender: Creds) -> list[torch.Tensor]:
        info = msgspec.msgpack.decode(handle, type=ShmMemory)
        if len(fds) != 1 or info.nbytes != 2 * nbytes:
            raise ValueError(f"shared plane: the sender's buffers ({info.nbytes} bytes, "
                             f"{len(fds)} descriptors) are not this config's (2 x {nbytes})")
        checked_fd(fds[0], info.nbytes, sender.uid, "the sender's bucket buffers")
        mem = mmap.mmap(fds[0], info.nbytes)
        keep.append(mem)
        return self._views(mem, nbytes)

    @staticmethod
    def _views(mem: Any, nbytes: int) -> list[torch.Tensor]:
        flat = torch.frombuffer(mem, dtype=torch.uint8, count=2 * nbytes)
        return [flat[:nbytes], flat[nbytes:]]

    # ------------------------------------------------------------------ memory read in place

    def _share(self, storage: torch.UntypedStorage) -> tuple[bytes, list[int]]:
        """A storage already in shared memory, by its descriptor (`RuntimeError` otherwise:
        asking PyTorch for the descriptor of any other storage would move it)."""
        if not storage.is_shared() or torch_mp.get_sharing_strategy() != "file_descriptor":
            raise RuntimeError("not in shared memory held as a file descriptor")
        fd, nbytes = storage._share_fd_cpu_()  # PyTorch's own: it stays open here
        return msgspec.msgpack.encode(ShmMemory(nbytes)), [fd]

    def _map(self, handle: bytes, fds: list[int], what: str) -> torch.Tensor:
        try:
            info = msgspec.msgpack.decode(handle, type=ShmMemory)
        except msgspec.DecodeError:
            raise ValueError(f"{what}: its handle does not decode: refused") from None
        if len(fds) != 1:
            raise ValueError(f"{what} came with {len(fds)} descriptors, not one: refused")
        try:
            checked_fd(fds[0], info.nbytes, self.pg.peer.sender.uid, what)
            mem = mmap.mmap(fds[0], info.nbytes, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise ValueError(f"{what} cannot be mapped: {e.strerror or e}") from None
        return torch.frombuffer(mem, dtype=torch.uint8)  # holds the mapping
