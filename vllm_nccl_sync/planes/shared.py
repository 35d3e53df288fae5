"""Same-host data planes: the sender's two bucket buffers are memory every receiver maps.

A broadcast moves no bytes. The sender packs bucket k straight into buffer k % 2, which every
receiver of the group mapped once, when it joined (`shm`: a POSIX shared-memory segment; `ipc`:
CUDA memory exported over CUDA IPC); the receiver's loaders read the bucket from there. So each
byte is copied twice, once by the sender's pack and once by the engine's load, against four
copies and a socket on gloo. A state dict's tensors in memory the plane can export are not packed
at all (`export`/`mapped`: the plane's `_share`/`_map`, the registry in `segments`): each
receiver maps their storages once and reads them where they lie, one copy per byte.

Synchronisation is a control block in host shared memory (one 64-bit word each, written by one
side only). Collectives are counted per receiver (a bucket for some receivers only, shard to
shard, counts for them alone: `reaches_some`): per buffer the sender publishes its exact length
and, per receiver the bucket is for, which of that receiver's collectives it holds; per receiver
and buffer, the receiver publishes the last of its collectives it is done with. A receiver's
`wait` returns once its collective is published and checks the published length against the
header's (a sender writing another size is refused, nothing of it is loaded); the sender's
`wait` for a buffer returns once every live receiver of the bucket released it, so it never
overwrites bytes a receiver still reads (the lane waits for each bucket before refilling its
buffer). Each side publishes only after its own work on the buffer has executed (on CUDA:
observed complete in its own process), not when it was merely queued.

Every wait polls with a deadline (`timeout_s`) and checks that the peer's process is alive: a
receiver that dies is `lost` at once, a sender that dies fails the receiver's wait at once.
The memory itself is handed over on a Unix socket (`handoff`): each side knows the other's pid
and user from the kernel, memory travels as descriptors (never opened by a name a peer gave),
and a receiver checks each (shared memory of the sender's user, of the size announced; on
`ipc` the device's UUID and the driver's range) before mapping anything.
"""

from __future__ import annotations

import abc
import logging
import mmap
import os
import time
from collections.abc import Callable, Collection
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from vllm_nccl_sync.outcomes import PeerFailed
from vllm_nccl_sync.planes.base import Handle, Transport
from vllm_nccl_sync.planes.handoff import (
    Creds,
    Hub,
    Join,
    Link,
    checked_fd,
    new_memory,
    open_join,
    seal_join,
)
from vllm_nccl_sync.planes.segments import Exports, Mappings
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.protocol import Source

log = logging.getLogger(__name__)

MAGIC = 0x766E735F73686D32  # "vns_shm2"
_CTRL = 4096
"""Bytes of the control block: its own shared memory, handed over with the buffers."""
_LENGTH = 4  # words: length[2]
_RANKS = 8  # words from here, per receiver rank r (1..world-1): released[2], ready[2]
_LIVENESS_S = 0.05


def _released(r: int, i: int) -> int:
    """The word where receiver `r` publishes the last of its collectives in buffer `i` it is
    done with (+ 1)."""
    return _RANKS + 4 * r + i


def _ready(r: int, i: int) -> int:
    """The word where the sender publishes which of receiver `r`'s collectives buffer `i` holds
    (+ 1)."""
    return _RANKS + 4 * r + 2 + i


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
                 keep: list[Any], peer: Hub | Link) -> None:
        self.peer = peer  # the handoff socket(s), where later segments go
        self.ctrl = ctrl
        self.buffers = buffers
        self.pids = pids
        self.keep = keep  # mappings and handles that must outlive the views
        self.aborted = ""


class _Posted:
    """One broadcast on a shared plane: `wait` polls the control block (see the module).
    `n`: per receiver it is for, the number of that receiver's collective."""

    def __init__(self, plane: SharedTransport, i: int, n: dict[int, int], length: int) -> None:
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
    reaches_some = True
    canary_bytes = 0

    def _group(self, store: dist.Store, cfg: SyncConfig) -> Any:
        self._exports = Exports()  # the sender's memory read in place (`export`)
        self._unsent: list[tuple[int, bytes, list[int], torch.UntypedStorage]] = []
        """Exported, to hand over: segment, handle, descriptors, and the storage (held until
        then, so its descriptors stay its own)."""
        self._forgot: list[int] = []  # segments of storages that died, to tell
        self._mappings = Mappings(self._segment)  # what a receiver mapped of it (`mapped`)
        self._timeout_s = cfg.timeout_s
        self._bucket_bytes = cfg.bucket_bytes
        self._n = [0] * cfg.world_size  # per receiver, its collectives so far (both sides)
        self._last = [-1, -1]  # a receiver's: its collective each buffer last held
        if _ready(cfg.world_size - 1, 1) >= _CTRL // 8:
            raise ValueError(f"a shared plane serves at most {(_CTRL // 8 - _RANKS) // 4 - 1} "
                             "receivers")
        keep: list[Any] = []
        if self.rank == 0:
            peer: Hub | Link = Hub(cfg.secret_bytes, cfg.timeout_s)
            try:
                ctrl_map, buffers, pids = self._hand_over(peer, store, cfg, keep)
            except BaseException:
                peer.close()
                raise
        else:
            join = open_join(store.get("join"), cfg.secret_bytes)
            if join.magic != MAGIC or join.bucket_bytes != cfg.bucket_bytes:
                raise ValueError(f"shared plane: the sender's join record (magic {join.magic:#x}, "
                                 f"bucket_bytes {join.bucket_bytes}) does not match this "
                                 f"receiver's ({MAGIC:#x}, {cfg.bucket_bytes})")
            peer = Link(join, self.rank, cfg.secret_bytes, cfg.timeout_s)
            try:
                ctrl_map, buffers = self._take_over(peer, cfg.bucket_bytes, keep)
            except BaseException:
                peer.close()
                raise
            pids = {0: peer.sender.pid}
        keep.append(ctrl_map)
        ctrl = torch.frombuffer(ctrl_map, dtype=torch.int64, count=_CTRL // 8)
        if int(ctrl[0]) != MAGIC:
            raise ValueError("shared plane: the control block does not carry this package's mark")
        return _Group(ctrl, buffers, pids, keep, peer)

    def _hand_over(self, hub: Hub, store: dist.Store, cfg: SyncConfig,
                   keep: list[Any]) -> tuple[mmap.mmap, list[torch.Tensor], dict[int, int]]:
        """Rank 0: make the control block and buffers, hand them to every receiver that joins
        (bounded); the control block, the buffers and the receivers' pids (the kernel's word)."""
        ctrl_fd = new_memory(_CTRL)
        fds: list[int] = []
        try:
            ctrl_map = mmap.mmap(ctrl_fd, _CTRL)
            torch.frombuffer(ctrl_map, dtype=torch.int64, count=1)[0] = MAGIC  # the rest is 0
            handle, fds, buffers = self._export(cfg.bucket_bytes, keep)
            store.set("join", seal_join(Join(MAGIC, hub.name, cfg.bucket_bytes), cfg.secret_bytes))
            hub.accept(range(1, cfg.world_size))
            hub.hand_over([(-1, handle, [ctrl_fd, *fds])])
            hub.attached()
        finally:  # the mappings keep the memory; receivers hold their own descriptors
            for fd in (ctrl_fd, *fds):
                os.close(fd)
        if hub.gone:
            raise ValueError(f"shared plane: {hub.gone}")
        return ctrl_map, buffers, {r: link.peer.pid for r, link in hub.links.items()}

    def _take_over(self, link: Link, nbytes: int,
                   keep: list[Any]) -> tuple[mmap.mmap, list[torch.Tensor]]:
        """A receiver: the group's memory the sender handed over, checked, then mapped."""
        handle, fds = link.group_memory()
        try:
            if not fds:
                raise ValueError("shared plane: the sender handed over no control block")
            checked_fd(fds[0], _CTRL, link.sender.uid, "the sender's control block")
            ctrl_map = mmap.mmap(fds[0], _CTRL)
            buffers = self._open(handle, fds[1:], nbytes, keep, link.sender)
        finally:
            for fd in fds:
                os.close(fd)
        link.attached(self.rank)
        return ctrl_map, buffers

    # ------------------------------------------------------------------ plane specifics

    @abc.abstractmethod
    def _export(self, nbytes: int,
                keep: list[Any]) -> tuple[bytes, list[int], list[torch.Tensor]]:
        """Rank 0: two buffers of `nbytes` others can map, their handle (msgpack bytes) and the
        descriptors that go with it (closed by the caller once handed over)."""

    @abc.abstractmethod
    def _open(self, handle: bytes, fds: list[int], nbytes: int, keep: list[Any],
              sender: Creds) -> list[torch.Tensor]:
        """A receiver: the sender's two buffers from `handle` and `fds` (`sender`: who the
        kernel says handed them over), checked before mapping; the caller closes `fds`."""

    @abc.abstractmethod
    def _share(self, storage: torch.UntypedStorage) -> tuple[bytes, list[int]]:
        """Sender: a handle (msgpack bytes) to `storage` and the descriptors that go with it,
        for receivers to map and read in place; `RuntimeError` where it cannot be exported."""

    @abc.abstractmethod
    def _map(self, handle: bytes, fds: list[int], what: str) -> torch.Tensor:
        """A receiver: the storage `handle` and `fds` name, checked and mapped, as flat uint8
        (`what` names it in a `ValueError`); the descriptors stay open (the handoff owns them)."""

    def _written(self, i: int) -> None:
        """Return once the sender's writes into buffer `i` queued so far have executed."""

    def _read(self, i: int) -> None:
        """Return once a receiver's reads of buffer `i` queued so far have executed."""

    # ------------------------------------------------------------------ memory read in place

    def export(self, t: torch.Tensor) -> Source | None:
        """Where tensor `t`'s bytes lie in memory exported to the receivers (its storage is
        exported on first use, once, and handed to every receiver by the next `hand_over`);
        None if it cannot be (another device, not contiguous, or memory the plane cannot
        export)."""
        if t.device != self.device or not t.is_contiguous():
            return None
        storage = t.untyped_storage()
        segment = self._exports.get(storage)
        if segment is None:  # a new storage (or a new one at a dead one's address)
            try:
                handle, fds = self._share(storage)
            except RuntimeError:
                segment = -1
            else:
                segment = self._exports.number()
                self._unsent.append((segment, handle, fds, storage))
            self._forgot += self._exports.add(storage, segment)  # no plan names these again
        if segment < 0:
            return None
        return Source(segment, t.storage_offset() * t.element_size())

    def hand_over(self) -> None:
        """Hand every receiver the memory exported since the last call, and the segments
        that died meanwhile (receivers take them while they wait for the plan). A receiver
        whose handoff socket fails (its buffer stayed full for the timeout: it never waited
        for a plan) is named in the log; it refuses any plan that names this memory."""
        hub: Hub = self.pg.peer
        gone = set(hub.gone)
        hub.forget(self._forgot)
        self._forgot = []
        if self._unsent:
            hub.hand_over([(segment, handle, fds) for segment, handle, fds, _ in self._unsent])
            self._unsent = []
        for rank in hub.gone.keys() - gone:
            log.warning("%s plane: rank %d no longer gets memory to read in place: %s",
                        self.backend, rank, hub.gone[rank])

    def side_socket(self) -> tuple[int, Callable[[], bool]] | None:
        """A receiver's handoff socket, and how to take what arrived on it."""
        return None if self.rank == 0 else (self.pg.peer.fileno(), self.pg.peer.take)

    def mapped(self, at: Source, length: int) -> torch.Tensor:
        """The `length` bytes at `at`, mapped (each segment once); `ValueError` naming what is
        wrong: a segment the sender never exported, a handle the plane refuses, or a range past
        the segment's end."""
        return self._mappings.view(at, length)

    def _segment(self, segment: int) -> torch.Tensor:
        try:
            handle, fds = self.pg.peer.segment(segment)
        except (OSError, ConnectionError) as e:
            raise ValueError(f"the sender's handoff socket failed: {e}") from None
        return self._map(handle, fds, f"the sender's memory segment {segment}")

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

    def _post(self, tensor: torch.Tensor, src: int, to: Collection[int] | None) -> Handle:
        i = self._index(tensor)
        ranks = [self.rank] if self.rank != src else \
            range(1, self.world_size) if to is None else sorted(to)
        n = {r: self._n[r] for r in ranks}
        for r in ranks:
            self._n[r] += 1
        if self.rank != src:
            self._last[i] = n[self.rank]
            return _Posted(self, i, n, tensor.numel())
        ctrl = self.pg.ctrl
        self._written(i)
        ctrl[_LENGTH + i] = tensor.numel()
        for r, k in n.items():  # last: the length is in place before a receiver sees it
            ctrl[_ready(r, i)] = k + 1
        return _Posted(self, i, n, tensor.numel())

    def _wait(self, p: _Posted) -> None:
        """Host side of a broadcast: the sender waits until every live receiver of it released
        buffer `p.i`; a receiver until the sender published its collective (length checked)."""
        ctrl, deadline = self.pg.ctrl, time.monotonic() + self._timeout_s
        delay, checked = 1e-6, time.monotonic()
        if self.rank == 0:
            waiting = [r for r in p.n if r not in self.lost]
        else:
            n = p.n[self.rank]
        while True:
            if self.pg.aborted:
                raise RuntimeError(f"{self.backend} plane aborted: {self.pg.aborted}")
            if self.rank == 0:
                waiting = [r for r in waiting if int(ctrl[_released(r, p.i)]) <= p.n[r]]
                if not waiting:
                    return
            elif (got := int(ctrl[_ready(self.rank, p.i)])) > n:
                if got != n + 1:
                    raise RuntimeError(f"{self.backend} plane: buffer {p.i} holds collective "
                                       f"{got - 1}, this receiver expected {n}")
                length = int(ctrl[_LENGTH + p.i])
                if length != p.length:
                    raise RuntimeError(f"{self.backend} plane: the sender published {length} "
                                       f"bytes for collective {n}, the header said {p.length}")
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
            raise RuntimeError(f"{self.backend} plane: the sender {how} "
                               f"(collective {p.n[self.rank]})")
        ctrl = self.pg.ctrl
        late = dead or [r for r in p.n if r not in self.lost
                        and int(ctrl[_released(r, p.i)]) <= p.n[r]]
        self.lost.update(late)
        raise PeerFailed(f"{self.backend} plane: rank {late[0]} {how} "
                         f"(collective {p.n[late[0]]})", late[0])

    def release(self, i: int) -> None:
        """A receiver is done with buffer `i` (its reads so far, on CUDA: once they executed)."""
        if self.rank == 0 or self._last[i] < 0:
            return
        self._read(i)
        self.pg.ctrl[_released(self.rank, i)] = self._last[i] + 1

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
        self.pg.peer.close()
