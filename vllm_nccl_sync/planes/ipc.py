"""The CUDA IPC data plane: a trainer and an engine sharing one GPU (see `shared`).

NCCL refuses two ranks on one GPU, so a colocated trainer (verl's hybrid engine, TRL's colocate
mode) reaches the engine through CUDA IPC. The sender's two bucket buffers are one CUDA
allocation exported once per session (made with the caching allocator's expandable segments off,
which CUDA IPC cannot export); each receiver maps it once, after checking that it is on the same
GPU (by UUID, not index: the processes may see different device orders) and that the mapping
really spans what the handle claims (the driver's address range).

Buffer reuse: each side publishes a buffer only once its own GPU work on it has executed (the
sender's pack into it, a receiver's loads and checksum out of it), observed in its own process
(an event polled with the deadline). Interprocess CUDA events cannot carry this: a wait on one
in the other process sees only records that already executed, so a pack still queued would not
be waited for (tried: the receiver checksummed a buffer before the sender's pack into it ran).
Checksums: as on NCCL, on the device beside the copies, compared once at the `Seal`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from typing import Any

import msgspec
import torch

from vllm_nccl_sync.planes.base import register
from vllm_nccl_sync.planes.shared import SharedTransport


class IpcBuffers(msgspec.Struct, frozen=True):
    """The sender's exported allocation (PyTorch's CUDA IPC fields) and its events."""

    uuid: str
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_handle: bytes
    ref_offset: int
    event_handle: bytes
    event_sync: bool


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID: the same physical GPU has the same one in every process."""
    return str(torch.cuda.get_device_properties(device).uuid)


@contextlib.contextmanager
def exportable() -> Iterator[None]:
    """Allocations in the block can be exported over CUDA IPC: with
    `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (common in training) they could not, so
    the setting is off inside the block and restored after."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "")
    expandable = "expandable_segments:True" in conf
    if expandable:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        if expandable:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def mapped_bytes(ptr: int) -> tuple[int, int]:
    """The driver's allocation containing device address `ptr`: (base, size)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc:
        raise ValueError(f"address {ptr:#x} is not mapped device memory (CUDA error {rc})")
    return base.value, size.value


@register("ipc")
class IpcTransport(SharedTransport):
    """CUDA buckets in one exported allocation that a receiver on the same GPU maps once."""

    digest_per_bucket = False
    peer_harm = (
        "a peer cannot crash this process through the plane: a handle to another GPU, or one "
        "claiming more memory than its allocation holds, is refused before it is mapped; a "
        "sender publishing another length than the header's fails the receiver's wait (nothing "
        "loaded, group broken); bytes garbled in the buffer fail the checksum at the Seal; a "
        "receiver that never releases a buffer is lost at the timeout (at once if it exited)")

    def _device(self, device: torch.device | None) -> torch.device:
        dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        if dev.type != "cuda":
            raise ValueError(f"the ipc plane moves CUDA memory, not {dev}")
        return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())

    def _export(self, nbytes: int, keep: list[Any]) -> tuple[bytes, list[torch.Tensor]]:
        with torch.cuda.device(self.device), exportable():
            flat = torch.empty(2 * nbytes, dtype=torch.uint8, device=self.device)
        _, handle, size, offset, ref_handle, ref_offset, ev, sync = (
            flat.untyped_storage()._share_cuda_())
        keep.append(flat)
        info = IpcBuffers(gpu_uuid(self.device), handle, size, offset, ref_handle, ref_offset,
                          ev, bool(sync))
        return msgspec.msgpack.encode(info), [flat[:nbytes], flat[nbytes:]]

    def _open(self, handle: bytes, nbytes: int, keep: list[Any]) -> list[torch.Tensor]:
        info = msgspec.msgpack.decode(handle, type=IpcBuffers)
        mine = gpu_uuid(self.device)
        if info.uuid != mine:
            raise ValueError(f"the trainer's buffers are on GPU {info.uuid}, this worker is on "
                             f"{mine}: the ipc plane needs both on one GPU (use nccl)")
        if info.storage_bytes < 2 * nbytes or info.storage_offset < 0:
            raise ValueError(f"the trainer's exported buffers hold {info.storage_bytes} bytes, "
                             f"two buckets need {2 * nbytes}")
        with torch.cuda.device(self.device):
            storage = torch.UntypedStorage._new_shared_cuda(
                self.device.index, info.handle, info.storage_bytes, info.storage_offset,
                info.ref_handle, info.ref_offset, info.event_handle, info.event_sync)
            base, size = mapped_bytes(storage.data_ptr())
            if storage.data_ptr() + info.storage_bytes > base + size:
                raise ValueError(f"the trainer's handle claims {info.storage_bytes} bytes, its "
                                 f"allocation maps {size - (storage.data_ptr() - base)} from "
                                 "there: refused")
            flat = torch.empty(0, dtype=torch.uint8, device=self.device)
            flat.set_(storage, 0, (2 * nbytes,), (1,))
        keep.append(flat)
        return [flat[:nbytes], flat[nbytes:]]

    def _written(self, i: int) -> None:
        self.wait_stream(torch.cuda.current_stream(self.device), self._timeout_s)

    def _read(self, i: int) -> None:
        self.wait_stream(torch.cuda.current_stream(self.device), self._timeout_s)
