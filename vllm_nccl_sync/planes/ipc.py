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

Handles come only over the handoff socket (`handoff`), from the process the kernel names as the
sender. Mapping one through PyTorch opens its reference counter (a /dev/shm file, by name) and
decrements a word in it when the mapping goes: a receiver accepts only a counter PyTorch made in
the sender's own process, at an offset inside the file (`ref_counter_problem`). What the driver
itself checks of a handle is the driver's: legacy CUDA IPC handles carry no credential, so a
handle of another process's memory that the sender learned could be opened (see docs/security.md).

Read in place (`export`/`mapped`): a tensor of a state dict that lies contiguous in exportable
memory on the plane's GPU is not packed at all. Its storage is exported once (while it lives:
a new storage, even at the same address, is a new segment), the segment's handle goes to each
receiver over the handoff socket, and its header names where its bytes lie (`BucketHeader.at`). Each receiver
maps a segment once, checks the range before the plan is accepted, and its loader copies
straight out of the trainer's memory: one copy per byte, and no handoff per bucket. The sender
waits for its own GPU work before the `Go` (its tensors are final when a receiver reads them)
and may write them again only after every receiver's `Ack`, which each sends once its copies
out of them have executed. Segments a plan no longer names are unmapped when the next plan
comes, so the trainer's allocator can reuse that memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from typing import Any

import msgspec
import torch

from vllm_nccl_sync.outcomes import Kind, Problem
from vllm_nccl_sync.planes.handoff import Creds
from vllm_nccl_sync.planes.shared import SharedTransport


class IpcMemory(msgspec.Struct, frozen=True):
    """A storage the sender exported (PyTorch's CUDA IPC fields) and the GPU it lies on."""

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


def share(storage: torch.UntypedStorage, device: torch.device) -> IpcMemory:
    """Export `storage` over CUDA IPC (`RuntimeError` where it cannot be: expandable segments)."""
    _, handle, size, offset, ref_handle, ref_offset, ev, sync = storage._share_cuda_()
    return IpcMemory(gpu_uuid(device), handle, size, offset, ref_handle, ref_offset, ev, bool(sync))


_REF_COUNTERS = 10000
"""Counters in one of PyTorch's CUDA IPC reference-counter files (`CUDA_IPC_REF_COUNTER_FILE_SIZE`)."""


def ref_counter_problem(info: IpcMemory, sender_pid: int, what: str) -> Problem | None:
    """Why `info`'s reference counter is refused (None if it is not). Mapping a CUDA IPC handle
    through PyTorch opens that counter by name and decrements the word at its offset when the
    mapping goes: so it must be one PyTorch made in the sender's own process (the kernel's
    pid), at an offset inside the file, and never a name that reaches out of /dev/shm."""
    name = info.ref_handle
    stem = f"/torch_{sender_pid}_".encode()
    tail = name[len(stem):].split(b"_")
    if (not name.startswith(stem) or len(tail) != 2
            or not all(p.isdigit() and len(p) <= 20 for p in tail)):
        return Problem(Kind.HANDLE, f"{what}: its reference counter is not one the sender's "
                       "process made: refused")
    if not 0 <= info.ref_offset < _REF_COUNTERS:
        return Problem(Kind.HANDLE, f"{what}: its reference counter's offset lies outside the "
                       "counter file: refused")
    return None


def open_shared(info: IpcMemory, device: torch.device, need: int, what: str,
                sender_pid: int) -> torch.Tensor:
    """The bytes of an exported storage, mapped, as flat uint8 on `device`: after checking that
    it lies on this GPU, that its reference counter is the sender's (`ref_counter_problem`),
    that it holds `need` bytes and that the driver maps all it claims; `ValueError` naming
    `what` and the problem otherwise (a forged reference counter: `ProtocolError`)."""
    problem = ref_counter_problem(info, sender_pid, what)
    if problem:
        raise problem.error()
    mine = gpu_uuid(device)
    if info.uuid != mine:
        raise ValueError(f"{what} is on GPU {info.uuid}, this worker is on {mine}: the ipc plane "
                         "needs both on one GPU (use nccl)")
    if info.storage_bytes < need or info.storage_offset < 0:
        raise ValueError(f"{what} holds {info.storage_bytes} bytes, {need} needed")
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index, info.handle, info.storage_bytes, info.storage_offset,
            info.ref_handle, info.ref_offset, info.event_handle, info.event_sync)
        base, size = mapped_bytes(storage.data_ptr())
        if storage.data_ptr() + info.storage_bytes > base + size:
            raise ValueError(f"{what}: its handle claims {info.storage_bytes} bytes, its "
                             f"allocation maps {size - (storage.data_ptr() - base)} from there: "
                             "refused")
        flat = torch.empty(0, dtype=torch.uint8, device=device)
        flat.set_(storage, 0, (info.storage_bytes,), (1,))
    return flat


class IpcTransport(SharedTransport):
    """CUDA buckets in one exported allocation that a receiver on the same GPU maps once."""

    backend = "ipc"
    digest_per_bucket = False
    peer_harm = (
        "a peer cannot crash this process through the plane: handles come only from the sender "
        "the kernel names on the handoff socket; a handle to another GPU, one claiming more "
        "memory than its allocation holds, or one whose reference counter was not made in the "
        "sender's process is refused before it is mapped; a "
        "sender publishing another length than the header's fails the receiver's wait (nothing "
        "loaded, group broken); bytes garbled in the buffer fail the checksum at the Seal; a "
        "receiver that never releases a buffer is lost at the timeout (at once if it exited)")

    def _device(self, device: torch.device | None) -> torch.device:
        dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        if dev.type != "cuda":
            raise ValueError(f"the ipc plane moves CUDA memory, not {dev}")
        return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())

    def _export(self, nbytes: int,
                keep: list[Any]) -> tuple[bytes, list[int], list[torch.Tensor]]:
        with torch.cuda.device(self.device), exportable():
            flat = torch.empty(2 * nbytes, dtype=torch.uint8, device=self.device)
        keep.append(flat)
        info = share(flat.untyped_storage(), self.device)
        return msgspec.msgpack.encode(info), [], [flat[:nbytes], flat[nbytes:]]

    def _open(self, handle: bytes, fds: list[int], nbytes: int, keep: list[Any],
              sender: Creds) -> list[torch.Tensor]:
        flat = self._opened(handle, fds, 2 * nbytes, "the trainer's buffers",
                            sender.pid)[: 2 * nbytes]
        keep.append(flat)
        return [flat[:nbytes], flat[nbytes:]]

    def _opened(self, handle: bytes, fds: list[int], need: int, what: str,
                sender_pid: int) -> torch.Tensor:
        """`open_shared` of a handle that came with no descriptors."""
        if fds:
            raise ValueError(f"{what}: a CUDA IPC handle comes with no descriptors: refused")
        try:
            info = msgspec.msgpack.decode(handle, type=IpcMemory)
        except msgspec.DecodeError:
            raise ValueError(f"{what}: its handle does not decode: refused") from None
        return open_shared(info, self.device, need, what, sender_pid)

    # ------------------------------------------------------------------ memory read in place

    def _share(self, storage: torch.UntypedStorage) -> tuple[bytes, list[int]]:
        """Export over CUDA IPC (`RuntimeError` where it cannot be: expandable segments)."""
        return msgspec.msgpack.encode(share(storage, self.device)), []

    def _map(self, handle: bytes, fds: list[int], what: str) -> torch.Tensor:
        return self._opened(handle, fds, 0, what, self.pg.pids[0])

    def _written(self, i: int) -> None:
        self.wait_stream(torch.cuda.current_stream(self.device), self._timeout_s)

    def _read(self, i: int) -> None:
        self.wait_stream(torch.cuda.current_stream(self.device), self._timeout_s)
