"""The shared-memory data plane: a trainer and CPU engines on one host (see `shared`).

The sender's two bucket buffers are one POSIX shared-memory segment (mode 0600, a random name
that is unlinked once every receiver mapped it, so nothing else can open it and nothing is left
in /dev/shm if a process dies); receivers load straight from it. Checksums: as on gloo, each
bucket's on the host, checked against the sender's `Digest` before anything of it is loaded.

Read in place (`export`/`mapped`, as on `ipc`): a tensor of a state dict whose storage is
already in shared memory (`tensor.share_memory_()`, `model.share_memory()`: PyTorch keeps it as
a file descriptor) is not packed: its header names where its bytes lie, and each receiver maps
that storage once, through `/proc/<sender pid>/fd/<fd>`, which the kernel opens only for the
sender's own user. A receiver refuses a handle naming another process than the sender it joined,
a descriptor that is not shared memory, or a size other than the storage's; it maps the storage
copy-on-write, so nothing it does can write the sender's memory. Each bucket read in place is
still checksummed on the host and checked against the sender's `Digest` before it is loaded:
one copy per byte (the engine's load) instead of two. Storages not in shared memory are packed
as before; none is ever moved into shared memory by this plane.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import msgspec
import torch
import torch.multiprocessing as torch_mp

from vllm_nccl_sync.planes.base import register
from vllm_nccl_sync.planes.shared import Segment, SharedTransport, create_segment, open_segment


class ShmStorage(msgspec.Struct, frozen=True):
    """A storage in shared memory the sender exported: its process, descriptor and bytes."""

    pid: int
    fd: int
    nbytes: int


@register("shm")
class ShmTransport(SharedTransport):
    """CPU buckets in a shared-memory segment the receivers map once (see the module)."""

    digest_per_bucket = True
    peer_harm = (
        "a peer cannot crash this process: a sender publishing another length than the header's "
        "fails the receiver's wait (nothing loaded, group broken); bytes garbled in the segment "
        "fail the bucket's checksum; a receiver that never releases a buffer is lost at the "
        "timeout (at once if its process exited); a segment of another name or size is refused; "
        "memory to read in place is mapped copy-on-write, only from the sender's own process, "
        "only shared memory, only of the size it claims")

    def _device(self, device: torch.device | None) -> torch.device:
        return torch.device("cpu")

    def _export(self, nbytes: int, keep: list[Any]) -> tuple[bytes, list[torch.Tensor]]:
        seg, mem = create_segment(2 * nbytes)
        keep.append(mem)
        self._segments.append(seg)
        return msgspec.msgpack.encode(seg), self._views(mem, nbytes)

    def _open(self, handle: bytes, nbytes: int, keep: list[Any]) -> list[torch.Tensor]:
        seg = msgspec.msgpack.decode(handle, type=Segment)
        mem = open_segment(seg, 2 * nbytes)
        keep.append(mem)
        return self._views(mem, nbytes)

    @staticmethod
    def _views(mem: Any, nbytes: int) -> list[torch.Tensor]:
        flat = torch.frombuffer(mem, dtype=torch.uint8, count=2 * nbytes)
        return [flat[:nbytes], flat[nbytes:]]

    # ------------------------------------------------------------------ memory read in place

    def _share(self, storage: torch.UntypedStorage) -> bytes:
        """A storage already in shared memory, by its descriptor (`RuntimeError` otherwise:
        asking PyTorch for the descriptor of any other storage would move it)."""
        if not storage.is_shared() or torch_mp.get_sharing_strategy() != "file_descriptor":
            raise RuntimeError("not in shared memory held as a file descriptor")
        fd, nbytes = storage._share_fd_cpu_()
        return msgspec.msgpack.encode(ShmStorage(os.getpid(), fd, nbytes))

    def _map(self, handle: bytes, what: str) -> torch.Tensor:
        info = msgspec.msgpack.decode(handle, type=ShmStorage)
        sender = self.pg.pids[0]
        if info.pid != sender:
            raise ValueError(f"{what} names process {info.pid}, not the sender ({sender}): refused")
        path = f"/proc/{info.pid}/fd/{info.fd}"
        try:
            target = os.readlink(path)
            if not target.startswith("/dev/shm/"):
                raise ValueError(f"{what} is not shared memory ({target[:80]!r}): refused")
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                if size != info.nbytes or size == 0:
                    raise ValueError(f"{what} holds {size} bytes, announced {info.nbytes}: "
                                     "refused")
                mem = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError as e:
            raise ValueError(f"{what} cannot be mapped: {e.strerror or e}") from None
        return torch.frombuffer(mem, dtype=torch.uint8)  # holds the mapping
