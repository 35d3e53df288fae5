"""Same-host data planes: the sender's two bucket buffers are memory every receiver maps.

A broadcast moves no bytes. The sender packs bucket k straight into buffer k % 2, which every
receiver of the group mapped once, when it joined (`shm`: a POSIX shared-memory segment; `ipc`:
CUDA memory exported over CUDA IPC); the receiver's loaders read the bucket from there. So each
byte is copied twice, once by the sender's pack and once by the engine's load, against four
copies and a socket on gloo. A state dict's tensors in memory the plane can export are not packed
at all (`export`/`mapped`: the plane's `_share`/`_map`, the registry in `segments`): each
receiver maps their storages once and reads them where they lie, one copy per byte.

Synchronisation is a control block in host shared memory (one 64-bit word each, written by one
side only): per buffer the sender publishes which collective it holds and its exact length; per
receiver and buffer, the receiver publishes the last collective it is done with. A receiver's
`wait` returns once its collective is published and checks the published length against the
header's (a sender writing another size is refused, nothing of it is loaded); the sender's
`wait` for a buffer returns once every live receiver released it, so it never overwrites bytes a
receiver still reads. Each side publishes only after its own work on the buffer has executed
(on CUDA: observed complete in its own process), not when it was merely queued.

Every wait polls with a deadline (`timeout_s`) and checks that the peer's process is alive: a
receiver that dies is `lost` at once, a sender that dies fails the receiver's wait at once.
Handles travel as msgspec messages through the group's rendezvous store, no pickle; a receiver
checks them (the segment's name and size, the device's UUID) before mapping anything.
"""

from __future__ import annotations

import abc
import mmap
import os
import secrets
import time
from typing import Any, ClassVar

import msgspec
import torch
import torch.distributed as dist

from vllm_nccl_sync.outcomes import PeerFailed
from vllm_nccl_sync.planes.base import Handle, Transport
from vllm_nccl_sync.planes.segments import Exports, Mappings
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.protocol import Source

MAGIC = 0x766E735F73686D31  # "vns_shm1"
PREFIX = "vllm_nccl_sync-"
"""Every segment name starts with this; a receiver refuses any other name."""
_CTRL = 4096
"""Bytes of the control block at the start of a segment."""
_READY, _LENGTH = 2, 4  # words: ready[2] (collective number + 1), length[2]
_RELEASED = 8  # words: released[rank][2] from here, ranks 1..world-1
_LIVENESS_S = 0.05


class Segment(msgspec.Struct, frozen=True):
    """A shared-memory segment as a receiver opens it: its name and size in bytes."""

    name: str
    nbytes: int


def create_segment(nbytes: int) -> tuple[Segment, mmap.mmap]:
    """A new segment of `nbytes` readable and writable by this user only, mapped."""
    name = PREFIX + secrets.token_hex(12)
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return Segment(name, nbytes), mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def open_segment(seg: Segment, need: int) -> mmap.mmap:
    """Map segment `seg` after checking its name and that it holds `need` bytes; `ValueError`
    naming what is wrong."""
    if not seg.name.startswith(PREFIX) or "/" in seg.name or len(seg.name) > 64:
        raise ValueError(f"refusing shared-memory segment {seg.name!r}: not one of this package's")
    fd = os.open(f"/dev/shm/{seg.name}", os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size != seg.nbytes or size < need:
            raise ValueError(f"shared-memory segment {seg.name} holds {size} bytes, announced "
                             f"{seg.nbytes}, needed {need}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def unlink_segment(seg: Segment) -> None:
    """Remove the segment's name (mappings stay valid until their processes unmap)."""
    try:
        os.unlink(f"/dev/shm/{seg.name}")
    except FileNotFoundError:
        pass


class Join(msgspec.Struct, frozen=True):
    """What rank 0 publishes for the group: the control segment, the buffers' handle (plane
    specific, msgpack bytes) and its pid."""

    magic: int
    control: Segment
    buffers: bytes
    pid: int
    bucket_bytes: int


class Attach(msgspec.Struct, frozen=True):
    """What a receiver publishes once it mapped the memory: its pid."""

    pid: int


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs: a process that exited but was not reaped yet (a
    zombie) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True  # not ours to read: leave it to the timeout
    return state not in (b"Z", b"X")


class _Group:
    """The mapped control block and buffers of one rank."""

    def __init__(self, ctrl: torch.Tensor, buffers: list[torch.Tensor], pids: dict[int, int],
                 keep: list[Any], store: dist.Store) -> None:
        self.store = store  # the group's rendezvous, where later handles go (`ipc` segments)
        self.ctrl = ctrl
        self.buffers = buffers
        self.pids = pids
        self.keep = keep  # mappings and handles that must outlive the views
        self.aborted = ""


class _Posted:
    """One broadcast on a shared plane: `wait` polls the control block (see the module)."""

    def __init__(self, plane: SharedTransport, i: int, n: int, length: int) -> None:
        self.plane, self.i, self.n, self.length = plane, i, n, length
        self.done = False

    def wait(self) -> bool:
        if not self.done:
            self.plane._wait(self)
            self.done = True
        return True


class SharedTransport(Transport):
    """A same-host plane: shared bucket buffers and a control block (see the module)."""

    shares_buffers: ClassVar[bool] = True
    canary_bytes = 0

    def _group(self, store: dist.Store, cfg: SyncConfig) -> Any:
        self._exports = Exports()  # the sender's memory read in place (`export`)
        self._mappings = Mappings(self._segment)  # what a receiver mapped of it (`mapped`)
        self._timeout_s = cfg.timeout_s
        self._bucket_bytes = cfg.bucket_bytes
        self._n = 0  # collectives posted so far (both sides count alike)
        self._last = [-1, -1]  # the collective each buffer last held
        need = _CTRL
        if _RELEASED + 2 * cfg.world_size > need // 8:
            raise ValueError(f"a shared plane serves at most {need // 16 - 4} receivers")
        keep: list[Any] = []
        if self.rank == 0:
            seg, ctrl_map = create_segment(need)
            keep.append(ctrl_map)
            torch.frombuffer(ctrl_map, dtype=torch.int64, count=1)[0] = MAGIC  # the rest is 0
            self._segments = [seg]
            handle, buffers = self._export(cfg.bucket_bytes, keep)
            join = Join(MAGIC, seg, handle, os.getpid(), cfg.bucket_bytes)
            store.set("join", msgspec.msgpack.encode(join))
            try:
                pids = self._attached(store, cfg.world_size)
            finally:  # mapped by every rank now (or the join failed)
                for made in self._segments:
                    unlink_segment(made)
        else:
            join = msgspec.msgpack.decode(store.get("join"), type=Join)
            if join.magic != MAGIC or join.bucket_bytes != cfg.bucket_bytes:
                raise ValueError(f"shared plane: the sender's join record (magic {join.magic:#x}, "
                                 f"bucket_bytes {join.bucket_bytes}) does not match this "
                                 f"receiver's ({MAGIC:#x}, {cfg.bucket_bytes})")
            ctrl_map = open_segment(join.control, need)
            keep.append(ctrl_map)
            buffers = self._open(join.buffers, cfg.bucket_bytes, keep)
            store.set(f"attached/{self.rank}",
                      msgspec.msgpack.encode(Attach(os.getpid())))
            pids = {0: join.pid}
        ctrl = torch.frombuffer(ctrl_map, dtype=torch.int64, count=need // 8)
        if int(ctrl[0]) != MAGIC:
            raise ValueError("shared plane: the control block does not carry this package's mark")
        return _Group(ctrl, buffers, pids, keep, store)

    def _attached(self, store: dist.Store, world_size: int) -> dict[int, int]:
        """Rank 0: wait (bounded by the store's timeout) until every receiver mapped the
        memory; their pids."""
        pids = {}
        for r in range(1, world_size):
            att = msgspec.msgpack.decode(store.get(f"attached/{r}"), type=Attach)
            pids[r] = att.pid
        return pids

    # ------------------------------------------------------------------ plane specifics

    @abc.abstractmethod
    def _export(self, nbytes: int, keep: list[Any]) -> tuple[bytes, list[torch.Tensor]]:
        """Rank 0: two buffers of `nbytes` others can map, and their handle (msgpack bytes);
        segments it creates go into `self._segments` (unlinked once every receiver joined)."""

    @abc.abstractmethod
    def _open(self, handle: bytes, nbytes: int, keep: list[Any]) -> list[torch.Tensor]:
        """A receiver: the sender's two buffers from `handle`, checked before mapping."""

    @abc.abstractmethod
    def _share(self, storage: torch.UntypedStorage) -> bytes:
        """Sender: a handle (msgpack bytes) to `storage` for receivers to map and read in place;
        `RuntimeError` where it cannot be exported."""

    @abc.abstractmethod
    def _map(self, handle: bytes, what: str) -> torch.Tensor:
        """A receiver: the storage `handle` names, checked and mapped, as flat uint8 (`what`
        names it in a `ValueError`)."""

    def _written(self, i: int) -> None:
        """Return once the sender's writes into buffer `i` queued so far have executed."""

    def _read(self, i: int) -> None:
        """Return once a receiver's reads of buffer `i` queued so far have executed."""

    # ------------------------------------------------------------------ memory read in place

    def export(self, t: torch.Tensor) -> Source | None:
        """Where tensor `t`'s bytes lie in memory exported to the receivers (its storage is
        exported on first use, once, its handle published in the group's store); None if it
        cannot be (another device, not contiguous, or memory the plane cannot export)."""
        if t.device != self.device or not t.is_contiguous():
            return None
        storage = t.untyped_storage()
        segment = self._exports.get(storage)
        if segment is None:  # a new storage (or a new one at a dead one's address)
            try:
                handle = self._share(storage)
            except RuntimeError:
                segment = -1
            else:
                segment = self._exports.number()
                self.pg.store.set(f"segment/{segment}", handle)
            for dead in self._exports.add(storage, segment):  # no plan can name these again
                self.pg.store.delete_key(f"segment/{dead}")
        if segment < 0:
            return None
        return Source(segment, t.storage_offset() * t.element_size())

    def mapped(self, at: Source, length: int) -> torch.Tensor:
        """The `length` bytes at `at`, mapped (each segment once); `ValueError` naming what is
        wrong: a segment the sender never exported, a handle the plane refuses, or a range past
        the segment's end."""
        return self._mappings.view(at, length)

    def _segment(self, segment: int) -> torch.Tensor:
        key = f"segment/{segment}"
        if not self.pg.store.check([key]):
            raise ValueError(f"memory segment {segment} was never exported by the sender")
        return self._map(self.pg.store.get(key), f"the sender's memory segment {segment}")

    def keep_mapped(self, segments: set[int]) -> None:
        """Unmap every segment but `segments` (the sender may free the memory of the others)."""
        self._mappings.keep(segments)

    # ------------------------------------------------------------------ the broadcast

    def shared_buffers(self) -> list[torch.Tensor]:
        """The group's two bucket buffers (the sender's memory, mapped on receivers)."""
        return self.pg.buffers

    def _index(self, tensor: torch.Tensor) -> int:
        for i, buf in enumerate(self.pg.buffers):
            base = buf.data_ptr()
            if base <= tensor.data_ptr() and tensor.data_ptr() + tensor.numel() <= base + buf.numel():
                if tensor.data_ptr() != base:
                    break
                return i
        raise ValueError(f"a {self.backend} plane broadcasts only from the start of its shared "
                         "buffers (shared_buffers())")

    def _post(self, tensor: torch.Tensor, src: int) -> Handle:
        i, n = self._index(tensor), self._n
        self._n += 1
        self._last[i] = n
        ctrl = self.pg.ctrl
        if self.rank == src:
            self._written(i)
            ctrl[_LENGTH + i] = tensor.numel()
            ctrl[_READY + i] = n + 1  # last: the length is in place before a receiver sees it
        return _Posted(self, i, n, tensor.numel())

    def _wait(self, p: _Posted) -> None:
        """Host side of a broadcast: the sender waits until every live receiver released buffer
        `p.i`; a receiver until the sender published collective `p.n` (its length checked)."""
        ctrl, deadline = self.pg.ctrl, time.monotonic() + self._timeout_s
        delay, checked = 1e-6, time.monotonic()
        if self.rank == 0:
            waiting = [r for r in range(1, self.world_size) if r not in self.lost]
        while True:
            if self.pg.aborted:
                raise RuntimeError(f"{self.backend} plane aborted: {self.pg.aborted}")
            if self.rank == 0:
                waiting = [r for r in waiting if int(ctrl[_RELEASED + 2 * r + p.i]) <= p.n]
                if not waiting:
                    return
            elif (got := int(ctrl[_READY + p.i])) > p.n:
                if got != p.n + 1:
                    raise RuntimeError(f"{self.backend} plane: buffer {p.i} holds collective "
                                       f"{got - 1}, this receiver expected {p.n}")
                length = int(ctrl[_LENGTH + p.i])
                if length != p.length:
                    raise RuntimeError(f"{self.backend} plane: the sender published {length} "
                                       f"bytes for collective {p.n}, the header said {p.length}")
                return
            now = time.monotonic()
            if now - checked > _LIVENESS_S:
                checked = now
                peers = waiting if self.rank == 0 else [0]
                dead = [r for r in peers if not _alive(self.pg.pids[r])]
                if dead or now > deadline:
                    self._give_up(p, dead)
            time.sleep(delay)
            delay = min(delay * 2, 2e-4)

    def _give_up(self, p: _Posted, dead: list[int]) -> None:
        how = "exited" if dead else f"did not answer within {self._timeout_s:.1f} s"
        if self.rank != 0:
            raise RuntimeError(f"{self.backend} plane: the sender {how} (collective {p.n})")
        ctrl = self.pg.ctrl
        late = dead or [r for r in range(1, self.world_size) if r not in self.lost
                        and int(ctrl[_RELEASED + 2 * r + p.i]) <= p.n]
        self.lost.update(late)
        raise PeerFailed(f"{self.backend} plane: rank {late[0]} {how} (collective {p.n})", late[0])

    def release(self, i: int) -> None:
        """A receiver is done with buffer `i` (its reads so far, on CUDA: once they executed)."""
        if self.rank == 0 or self._last[i] < 0:
            return
        self._read(i)
        self.pg.ctrl[_RELEASED + 2 * self.rank + i] = self._last[i] + 1

    def release_all(self) -> None:
        """A receiver gives back every buffer (an update ended early)."""
        for i in range(2):
            self.release(i)

    def _abort_group(self, pg: Any) -> None:
        """End this rank's waits now (the other side sees it through its own deadline)."""
        pg.aborted = self.broken or "aborted"

    def _release(self) -> None:
        if self.rank != 0:
            self.release_all()
