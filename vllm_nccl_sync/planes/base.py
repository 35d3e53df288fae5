"""Data plane: one broadcast per bucket, from a sender to every receiver (or, point to point, to
the receivers a bucket names), behind one interface.

`Transport` is what every data plane offers and promises: its verbs (`broadcast`, `armed`,
`extend`, `wait_stream`, `abort`, `close`; `export`/`mapped`/`keep_mapped` for memory read in
place) and the policies each plane states. Planes are found by name in `registry` (which opens
the one `cfg.backend` names: `open_transport`); each group meets through `rendezvous` and, on a
plane whose collectives can hang, is guarded by a `deadman`.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from vllm_nccl_sync.planes.deadman import Deadman
from vllm_nccl_sync.planes.rendezvous import open_store
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.protocol import Source

log = logging.getLogger(__name__)


class Handle(Protocol):
    """A collective in flight."""

    def wait(self) -> bool: ...


class Transport(abc.ABC):
    """A broadcast-only process group made without the default group: the data-plane interface.

    `broadcast` returns at once; the caller waits on the handle (on a GPU plane `wait()` only
    orders the current stream after the collective, which lets packing and loading overlap with
    the transfer). While an update is `armed`, a plane that can hang aborts its group once the
    deadline passes; an aborted group is `broken` for good and the next join builds a new one.

    What a peer can do to this process, plane by plane (`peer_harm`):
    - gloo: a broadcast longer than the receiver's whole bucket buffer aborts the receiving
      process inside gloo (`EnforceNotMet ... op.preamble.length <= op.nbytes`, the worker exits
      with -6); there is no way around it on gloo but receiving in another process
      (`receive_process`: then that process exits, not the worker). A longer send that still
      fits the posted buffer is caught by the canary (`canary_bytes`) and nothing of that bucket
      is loaded. A dead peer fails its transfers at the group's timeout; the others still get
      every bucket.
    - nccl: a peer cannot crash the process, but a dead peer leaves a collective pending until
      the deadman aborts the communicator (`armed`); the transport is then `broken`.
    - shm / ipc (`shared`): see their `peer_harm`.
    A new plane must state the same for itself (`peer_harm`, checked by `registry.plane`).

    Opened through `registry.open_transport` (the plane `cfg.backend` names). Planes implement
    `_device`, `_group`, `_post` and `_abort_group`; `broadcast` itself is defined here only (it
    checks and counts, then posts).
    """

    backend: ClassVar[str]
    """The plane's name (`cfg.backend`): its key in `registry.PLANES`."""
    digest_per_bucket: ClassVar[bool]
    """True (gloo): the sender sends each bucket's checksum in a `Digest` right after posting it,
    and a receiver checks it before loading the bucket. False (NCCL): both sides checksum on the
    device beside the collective and compare once, at the `Seal`."""
    canary_bytes: ClassVar[int]
    """Bytes past `length` a receiver posts and fills with random bytes (gloo: a longer send is
    then caught instead of aborting the process); 0: it posts exactly `length` bytes."""
    peer_harm: ClassVar[str]
    """What a peer (a hostile or dying sender or receiver) can do to this process."""
    reaches_some: ClassVar[bool] = False
    """True (every plane here): a bucket can go to some receivers only (`broadcast`'s `to`:
    shard to shard); a plane that cannot says False, and such buckets are refused on it."""
    shares_buffers: ClassVar[bool] = False
    """True (same-host planes, `shared`): the sender's two bucket buffers are mapped by every
    receiver (`shared_buffers()`); the sender packs every bucket into them, receivers load from
    them and hand each back with `release(i)` once their reads of it are done."""

    def __init__(self, cfg: SyncConfig, rank: int, device: torch.device | None = None) -> None:
        """Join the group as `rank` (0: the sender, which hosts the rendezvous). Raises
        `ValueError` for a rank outside the group, `TimeoutError` if the rendezvous is not
        reached within `cfg.timeout_s`, or what the plane's group raises."""
        if not 0 <= rank < cfg.world_size:
            raise ValueError(f"rank {rank} outside [0, {cfg.world_size})")
        self.rank = rank
        self.world_size = cfg.world_size
        self.pg: Any = None
        self.broken = ""
        """Why this group can no longer be used ("" while healthy); a new join rebuilds it."""
        self.bytes_moved = 0
        self.collectives = 0
        self.lost: set[int] = set()
        """Peers whose transfer failed (gone); later broadcasts from here skip them."""
        self.deadman = Deadman()
        """The deadline of the update in flight (`armed`); a plane that can hang `watch`es it."""
        self.device = self._device(device)
        self._store: dist.Store | None = None
        self.pg = self._join(cfg)

    def _join(self, cfg: SyncConfig) -> Any:
        """Meet the other ranks at the sender's rendezvous and build this rank's group."""
        self._store = open_store(cfg, self.rank)
        return self._group(dist.PrefixStore("vllm_nccl_sync", self._store), cfg)

    @abc.abstractmethod
    def _device(self, device: torch.device | None) -> torch.device:
        """The device of this plane's tensors (`device`, or the plane's default)."""

    @abc.abstractmethod
    def _group(self, store: dist.Store, cfg: SyncConfig) -> Any:
        """Build the process group of this rank on `store`."""

    @abc.abstractmethod
    def _post(self, tensor: torch.Tensor, src: int, to: Collection[int] | None) -> Handle:
        """Post the broadcast of `tensor` from `src` to every rank, or point to point to the
        ranks `to` (checked and counted by `broadcast`)."""

    @abc.abstractmethod
    def _abort_group(self, pg: Any) -> None:
        """End the pending collectives of group `pg` now, from any thread (`abort`, once)."""

    def _release(self) -> None:
        """Free the group's resources on `close` (default: nothing beyond dropping it)."""

    def receive_buffers(self, count: int, nbytes: int, pin: bool = False) -> list[torch.Tensor]:
        """Receiver: `count` buffers of `nbytes` for its collectives to fill (`pin`: page-locked,
        for a CUDA engine's copies out of them); by default memory of its own."""
        return [torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=pin)
                for _ in range(count)]

    def export(self, t: torch.Tensor) -> Source | None:
        """Sender: where `t`'s bytes lie in memory the receivers map, so its bucket is read in
        place (`BucketHeader.at`); None (gloo, nccl; the same-host planes where they cannot
        export it): it travels by broadcast."""
        return None

    def hand_over(self) -> None:
        """Sender: give the receivers what they need to read what `export` named, before a
        plan names it (the same-host planes: the memory exported since the last call)."""

    def side_socket(self) -> tuple[int, Callable[[], bool]] | None:
        """Receiver: a socket of this plane's own that must be served whenever the receiver
        waits for the trainer (`fd`, and what to call when it is readable: False once it
        needs no more), or None."""
        return None

    def mapped(self, at: Source, length: int) -> torch.Tensor:
        """Receiver: the `length` bytes a header's `at` names, mapped; `ValueError` if this
        plane maps no sender memory or the range is not the sender's."""
        raise ValueError(f"the {self.backend} plane maps no sender memory: a bucket to be read "
                         "where it lies cannot arrive on it")

    def keep_mapped(self, segments: set[int]) -> None:
        """Receiver: unmap the sender's memory segments other than `segments`."""

    def armed(self, seconds: float, what: str) -> contextlib.AbstractContextManager[None]:
        """Abort the group if the block (and the collectives it posted) is not done in `seconds`.

        A plane that watches its `deadman` (NCCL) aborts from another thread, so it also ends a
        host wait the caller is stuck in (a stream sync behind a collective that will never
        complete). A plane whose collectives time out on their own (gloo) only records it.
        """
        return self.deadman.armed(seconds, what)

    def extend(self, seconds: float) -> None:
        """Push an armed deadline to `seconds` from now (a new phase of the same update)."""
        self.deadman.extend(seconds)

    def wait_stream(self, stream: torch.cuda.Stream, timeout_s: float) -> None:
        """Wait for everything queued on `stream` so far, polling: never an unbounded host sync.

        Raises `TimeoutError` after `timeout_s` (the group is then aborted) or `RuntimeError` if
        the group was aborted meanwhile.
        """
        ev = torch.cuda.Event()
        ev.record(stream)
        deadline = time.monotonic() + timeout_s
        delay = 1e-5
        while not ev.query():
            if self.broken:
                raise RuntimeError(f"transfer group aborted: {self.broken}")
            if time.monotonic() > deadline:
                self.abort(f"GPU work did not finish within {timeout_s:.1f} s")
                ev.synchronize()  # the abort made the stuck kernels exit
                raise TimeoutError(f"GPU work did not finish within {timeout_s:.1f} s; "
                                   "transfer group aborted")
            time.sleep(delay)
            delay = min(delay * 2, 2e-4)
        if self.broken:
            raise RuntimeError(f"transfer group aborted: {self.broken}")

    def abort(self, reason: str) -> None:
        """Give the group up (pending collectives end at once where the plane can end them).

        Idempotent and safe from any thread; the transport is `broken` afterwards.
        """
        first = not self.broken
        self.broken = self.broken or reason
        pg = self.pg
        if not first or pg is None:
            return
        log.warning("aborting the %s transfer group (rank %d): %s", self.backend, self.rank, reason)
        self._abort_group(pg)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, length: int | None = None,
                  to: Collection[int] | None = None) -> Handle:
        """Start broadcasting `tensor` (uint8 on `device`) from rank `src` to every other rank,
        or, point to point, to the ranks `to` only (which alone call it, with the same `to`).

        `length`: the bytes announced (by default all of `tensor`), for the byte counters; a
        receiver may post more room than announced (`canary_bytes`). Every rank must wait on
        every handle it gets. Raises `RuntimeError` on a `broken` group, `ValueError` for a
        tensor of another dtype or device, or a `to` on a plane that cannot reach some ranks.
        """
        if self.broken:
            raise RuntimeError(f"transfer group is broken ({self.broken}); join again")
        if to is not None and not self.reaches_some:
            raise ValueError(f"the {self.backend} plane sends every bucket to every receiver: "
                             "it cannot send one to some of them (shard to shard)")
        if to is not None and not all(0 <= r < self.world_size and r != src for r in to):
            raise ValueError(f"point to point from rank {src} to ranks {sorted(to)}: outside "
                             f"the group's other ranks (world size {self.world_size})")
        if tensor.dtype != torch.uint8 or tensor.device != self.device:
            raise ValueError(
                f"broadcast takes uint8 on {self.device}, got {tensor.dtype} on {tensor.device}"
            )
        self.bytes_moved += tensor.numel() if length is None else length
        self.collectives += 1
        return self._post(tensor, src, to)

    def close(self) -> None:
        """Drop the group (a broken one included: the next join builds a new one)."""
        self.deadman.close()
        if self.pg is not None:
            self._release()
        self.pg = None
        self._store = None
