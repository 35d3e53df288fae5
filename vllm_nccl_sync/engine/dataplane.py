"""A receiver's data plane: two bucket buffers, one collective per bucket, what arrived checked.

Bucket k's collective fills buffer k % 2 with its header's `length` bytes, from the group of the
sender its header names. The transport's policy decides how a bucket is checked: where it checks
each bucket on its own (`digest_per_bucket`), the bucket's checksum is computed on the host as
soon as it arrived and compared with the sender's `Digest` before anything of it is loaded;
otherwise it is computed on the device beside the collective and every one is read back once, at
the `Seal`. Where the transport asks for `canary_bytes`, the whole buffer is posted with that many
random bytes past `length`: a sender that broadcasts more than it announced is caught instead of
ending the process, and one that broadcasts fewer leaves stale bytes the checksum rejects. A
bucket read where its slots lie in the sender's memory (`ipc`, `shm`) is checksummed part by
part: by the loads themselves where they copy a part whole (`taps.Tap`: one read of those
bytes, summed as written), the other parts once the loads ran (read a second time), before this
receiver's `Ack` lets the sender write them again; on `shm` compared with the bucket's `Digest`
right after its loads, on `ipc` at the `Seal`.

CUDA ordering: the host only queues work. Collectives are issued from a side stream that waits
only for the loads that last read the buffer; loads run on a second side stream that waits for
the collective; checksums on a third. vLLM's own stream never waits on a collective: `settle`
polls the load stream to completion within the deadline, and a collective that will not finish
gets its communicator aborted (`Transport.armed`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vllm_nccl_sync.outcomes import Kind, Problem, clip
from vllm_nccl_sync.planes.base import Transport
from vllm_nccl_sync.wire.cuda_sums import warm
from vllm_nccl_sync.wire.integrity import (
    checksum,
    checksum_gpu,
    checksum_parts,
    checksum_parts_gpu,
    copy_summed_host,
    reading,
)
from vllm_nccl_sync.wire.protocol import BucketHeader, Seal
from vllm_nccl_sync.wire.taps import Tap, tapping

_MASK = (1 << 64) - 1


class ReceivePlane:
    """The buffers, streams and collectives of one receiver over `transports` (one per sender)."""

    def __init__(self, transports: list[Transport], bucket_bytes: int,
                 engine: torch.device | None = None) -> None:
        """`engine`: the worker's device; a host plane feeding a CUDA engine receives into
        pinned buffers, so the loads (or a shadow's copies) are DMA transfers that hold no host
        thread."""
        self.transports = transports
        first = transports[0]
        self.device = first.device
        self.digest_per_bucket = first.digest_per_bucket
        self.canary_bytes = first.canary_bytes
        self.shared = first.shares_buffers
        """The sender's buffers, mapped (same-host planes): each is handed back (`release`) once
        this receiver is done reading it."""
        self.cuda = self.device.type == "cuda"
        feeds_cuda = (self.device.type == "cpu" and engine is not None and engine.type == "cuda"
                      and torch.cuda.is_available())
        self.copies = self.shared and not self.cuda
        """A host plane sharing the sender's buffers (`shm`): each packed bucket is copied once
        into this receiver's own buffer, which is checksummed and loaded, and the sender's
        buffer goes back at once (a bucket read in place is loaded from where it lies)."""
        self.loads_in_place = self.shared and not self.copies
        """Every load reads the sender's memory where it lies (`ipc`, packed buckets too)."""
        if self.shared and len(transports) != 1:
            raise ValueError(f"the {first.backend} plane takes one sender")
        if self.loads_in_place:
            self.buffers = first.shared_buffers()
        else:
            self.buffers = first.receive_buffers(2, bucket_bytes, pin=feeds_cuda)
        self.wire = first.shared_buffers() if self.shared else self.buffers
        """The buffers the collectives fill (the sender's, on same-host planes)."""
        self._pinned_for = engine if feeds_cuda else None
        self.in_place: dict[int, list[torch.Tensor]] = {}
        """Buckets read where their slots lie in the sender's memory (`BucketHeader.at`), by
        seq: one flat tensor per slot."""
        self.read_in_place = 0
        self.tap = Tap()
        """What this receiver checksums of the sender's memory, and what its loads summed."""
        if self.cuda:
            if self.shared:  # ipc: its checksum kernels built now, not in the first updates
                warm(self.device)
            self._issue = torch.cuda.Stream(self.device)
            self._load = torch.cuda.Stream(self.device)
            self._cksum = torch.cuda.Stream(self.device)
            self._free = [torch.cuda.Event(), torch.cuda.Event()]
            self._cksum_done = [torch.cuda.Event(), torch.cuda.Event()]

    @property
    def broken(self) -> str:
        """Why one of the groups can no longer be trusted ("" while all are healthy)."""
        return next((t.broken for t in self.transports if t.broken), "")

    @contextlib.contextmanager
    def armed(self, seconds: float, what: str) -> Iterator[None]:
        """Every group's deadman armed for `seconds` (see `Transport.armed`)."""
        with contextlib.ExitStack() as stack:
            for t in self.transports:
                stack.enter_context(t.armed(seconds, what))
            yield

    def extend(self, seconds: float) -> None:
        for t in self.transports:
            t.extend(seconds)

    def abort(self, reason: str) -> None:
        for t in self.transports:
            t.abort(reason)

    def begin(self) -> None:
        """A new update: CUDA loads queue after whatever the engine queued before."""
        self.in_place.clear()
        self.read_in_place = 0
        self.tap = Tap()
        if self.cuda:
            self._load.wait_stream(torch.cuda.current_stream(self.device))
            for ev in self._free:
                ev.record(self._load)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Where loads run: the load stream on CUDA, the current thread elsewhere; on a plane
        sharing the sender's memory their copies may sum what they read of it for this receiver
        (`tap`)."""
        token = tapping.set(self.tap) if self.shared else None
        try:
            with torch.cuda.stream(self._load) if self.cuda else contextlib.nullcontext():
                yield
        finally:
            if token is not None:
                tapping.reset(token)

    def mapping_problem(self, headers: list[BucketHeader], rank: int,
                        plan: bool = False) -> Problem | None:
        """Why headers naming the sender's memory (`at`) cannot be read (None if they can): a
        plane that maps none, a segment never exported, on another GPU, or a range past it.
        Each segment is mapped once; a `plan` that reads some in place unmaps the segments it
        no longer names (a plan that reads none, a stream, says nothing about them)."""
        if plan:
            for src, t in enumerate(self.transports):
                named = {at.segment for h in headers if h.src == src for at in h.at or []}
                if named:
                    t.keep_mapped(named)
        for h in headers:
            if h.to is not None and not self.transports[h.src].reaches_some:
                return Problem(Kind.HEADER, f"rank {rank} refused bucket {h.seq}: it is for some "
                               f"receivers only, and the {self.transports[h.src].backend} plane "
                               "sends every bucket to every receiver")
            if h.at is not None:
                try:
                    self._parts(h)
                except (ValueError, RuntimeError) as e:
                    return Problem(Kind.MAPPING, f"rank {rank} refused bucket {h.seq}: "
                                   f"{clip(str(e))}")
        return None

    def _parts(self, header: BucketHeader) -> list[torch.Tensor]:
        """The slots of a bucket read where they lie, mapped: one flat tensor each."""
        t = self.transports[header.src]
        return [t.mapped(at, s.nbytes) for at, s in zip(header.at or [], header.slots, strict=True)]

    def post(self, header: BucketHeader, seq: int) -> tuple[Any, torch.Tensor | None]:
        """Post the collective filling buffer seq % 2; returns its handle and canary (if any).
        A bucket read where it lies posts nothing: its handle holds the mapped bytes."""
        if header.at is not None:
            return _Mapped(self._parts(header), header.slots), None
        i, length = seq % 2, header.length
        buf, t = self.wire[i], self.transports[header.src]
        to = None if header.to is None else [t.rank]  # point to point: from the sender to here
        if self.canary_bytes:
            room = min(self.canary_bytes, buf.numel() - length)
            canary = None
            if room:
                canary = torch.frombuffer(bytearray(os.urandom(room)), dtype=torch.uint8)
                buf[length : length + room].copy_(canary)
            return t.broadcast(buf, length=length, to=to), canary
        if not self.cuda:
            return t.broadcast(buf[:length], to=to), None
        with torch.cuda.stream(self._issue):  # after the loads that last read this buffer
            self._issue.wait_event(self._free[i])
            return t.broadcast(buf[:length], to=to), None

    def arrived(self, seq: int, length: int, work: Any) -> Any:
        """Wait for bucket `seq`'s bytes (CUDA: the current stream waits) and return their
        checksum: an int now (`digest_per_bucket`), else one queued beside on the device, or
        one owed by the loads of a bucket read in place (`owed`)."""
        work.wait()
        if isinstance(work, _Mapped):
            self.read_in_place += 1
            parts = self.in_place[seq] = work.parts
            for p in parts:  # summed by the loads that copy them whole, the rest at the Seal
                self.tap.want(p)
            return _Gathered(parts)
        data = self.buffers[seq % 2][:length]
        if self.copies:  # one read of the sender's buffer, which goes back at once: summed as
            terms = copy_summed_host(data, self.wire[seq % 2][:length])  # it is copied
            self.transports[0].release(seq % 2)
            return checksum_parts([data], [terms])
        if self.digest_per_bucket:
            return checksum(data)  # while the sender's Digest (and bucket k+1) fly
        with torch.cuda.stream(self._cksum):  # beside the loads; the buffer waits for both
            work.wait()
            got = checksum_gpu(data)
            self._cksum_done[seq % 2].record(self._cksum)
        return got

    @staticmethod
    def owed(got: Any) -> bool:
        """Whether checksum `got` (of `arrived`) is computed by the bucket's loads: it can be
        read (`values`) only once they ran."""
        return isinstance(got, _Gathered)

    def bucket(self, seq: int) -> torch.Tensor | list[torch.Tensor]:
        """Where bucket `seq`'s bytes are to be unpacked from (once `arrived`): the buffer, or
        one flat tensor per slot where they lie."""
        got = self.in_place.get(seq)
        return self.buffers[seq % 2] if got is None else got

    def overran(self, seq: int, length: int, canary: torch.Tensor | None) -> bool:
        """The bytes past `length` changed: the sender broadcast more than it announced."""
        buf = self.buffers[seq % 2]
        return canary is not None and not torch.equal(buf[length : length + canary.numel()], canary)

    def loaded(self, seq: int) -> None:
        """Bucket `seq`'s loads are queued: CUDA frees its buffer once they and its checksum ran;
        a pinned host buffer, once the copies out of it ran (a load may copy asynchronously); a
        shared one goes back to the sender (on CUDA ordered after the loads). A bucket read in
        place frees nothing: the sender's memory is its own until this receiver's `Ack`."""
        if self.in_place.pop(seq, None) is not None:
            return
        if self.copies:  # given back when copied
            return
        if self._pinned_for is not None:
            torch.cuda.current_stream(self._pinned_for).synchronize()
        if self.cuda:
            self._load.wait_event(self._cksum_done[seq % 2])
            self._free[seq % 2].record(self._load)
        if self.shared:
            with self.loading():  # CUDA: the sender's reuse waits for the load stream
                self.transports[0].release(seq % 2)

    def settle(self, timeout_s: float) -> None:
        """CUDA: wait (bounded, polling) until every load and collective queued so far ran."""
        if self.cuda:
            self.transports[0].wait_stream(self._load, timeout_s)

    def settle_reads(self, timeout_s: float) -> None:
        """Wait (bounded) until every read of the sender's memory in this update ran (the
        sender may write it again once this receiver acknowledged)."""
        if self.read_in_place:
            self.settle(timeout_s)

    def values(self, sums: list[Any]) -> list[int | None]:
        """The checksums of `arrived` as ints (device ones read back in one go, once the
        streams that computed them ran)."""
        return self.reading(sums)()

    def reading(self, sums: list[Any]) -> Callable[[], list[int | None]]:
        """`values` in two steps: the device's sums queued behind the loads now (no host sync),
        read when the returned call is made; queued before the receiver waits for the loads,
        the host work of gathering them runs while the device copies."""
        if not self.cuda:
            got = [checksum_parts(s.parts, [self.tap.take(p) for p in s.parts])
                   if isinstance(s, _Gathered) else s for s in sums]
            return lambda: got
        cur = torch.cuda.current_stream(self.device)
        cur.wait_stream(self._cksum)
        cur.wait_stream(self._load)
        self.tap.sum_missing([p for s in sums if isinstance(s, _Gathered) for p in s.parts])
        sums = [checksum_parts_gpu(s.parts, [self.tap.take(p) for p in s.parts])
                if isinstance(s, _Gathered) else s for s in sums]
        return reading(sums)

    def drain(self, posted: dict[int, Any], clean: bool, timeout_s: float) -> str:
        """Wait for every collective still posted (after a clean abort each completes; else
        barely wait); returns why the group can no longer be trusted ("" if it still can). A
        shared plane's buffers all go back to the sender."""
        if self.cuda and not self.shared:
            with torch.cuda.stream(self._load):
                for w, _ in posted.values():
                    w.wait()
            try:
                self.transports[0].wait_stream(self._load, timeout_s if clean else 1.0)
            except (TimeoutError, RuntimeError) as err:
                return clip(str(err))
            return ""
        why = ""
        for w, _ in posted.values():  # bounded by the group's own timeout (or the plane's)
            try:
                w.wait()
            except RuntimeError as err:
                why = why or clip(str(err))
        if self.shared:
            with self.loading():  # CUDA: after the loads already queued
                self.transports[0].release_all()
        return why

    def close(self) -> None:
        for t in self.transports:
            t.close()


class _Gathered:
    """The checksum of a bucket read where its slots lie, owed: the loads may compute parts of
    it as they copy (`tap`); `values` computes the rest once the loads ran."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts


class _Mapped:
    """A bucket read where its slots lie: nothing to wait for, they are the sender's memory."""

    def __init__(self, parts: list[torch.Tensor], slots: list[Any]) -> None:
        self.parts = parts
        self.slots = slots

    def wait(self) -> bool:
        return True


# Texts told to the sender name the problem, never a checksum this receiver computed of the
# sender's bytes: a forger must not learn what to send. Both checksums go to the engine's log.
_log = logging.getLogger(__name__)


def digest_problem(rank: int, seq: int, got: int, theirs: int, require: bool,
                   loaded: bool = False) -> Problem | None:
    """Why bucket `seq` (checksum `got`) must not be loaded, or kept where it was `loaded`
    (read in place: its loads computed `got`), given the sender's `Digest` (None: it may be)."""
    fate = "loaded, the update fails" if loaded else "not loaded"
    if not theirs and require:
        return Problem(Kind.DIGEST, f"rank {rank}: Digest for bucket {seq} carries no checksum, "
                       f"and this receiver requires one (VLLM_NCCL_SYNC_REQUIRE_CHECKSUMS); {fate}")
    if theirs and got != theirs:
        _mismatch(rank, seq, got, theirs)
        return Problem(Kind.DIGEST, f"rank {rank}: bucket {seq} arrived corrupted or short: its "
                       f"checksum does not match the sender's; {fate}")
    return None


def _mismatch(rank: int, seq: int, mine: int, theirs: int) -> None:
    """Log both checksums of a bucket that arrived other than sent (the engine's own record)."""
    _log.warning("rank %d: bucket %d arrived other than sent: checksum %#x, the sender's %#x",
                 rank, seq, mine, theirs)


def seal_problem(rank: int, version: int, seal: Seal, got: list[int | None],
                 require: bool) -> Problem | None:
    """Why the sender's `Seal` disagrees with what arrived (`got`: one checksum per bucket, None
    for an empty one): the bucket count or a checksum (None if it agrees)."""
    n = len(got)
    if seal.buckets != n or len(seal.checksums) != n:
        return Problem(Kind.SEAL, f"rank {rank}: sender sealed update {version} with "
                       f"{seal.buckets} buckets / {len(seal.checksums)} checksums, {n} arrived")
    for k, (mine, theirs) in enumerate(zip(got, seal.checksums, strict=True)):
        if mine is None or (not theirs and not require):
            continue
        if not theirs:
            return Problem(Kind.SEAL, f"rank {rank}: no checksum for bucket {k} in the seal, and "
                           "this receiver requires one (VLLM_NCCL_SYNC_REQUIRE_CHECKSUMS)")
        if mine & _MASK != theirs:
            _mismatch(rank, k, mine & _MASK, theirs)
            return Problem(Kind.SEAL, f"rank {rank}: bucket {k} arrived corrupted: its checksum "
                           "does not match the sender's")
    return None
