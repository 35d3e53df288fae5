"""The bucket lane: how one sender puts its buckets on its data-plane group.

Two buffers, at most two collectives in flight: a buffer is refilled only after the collective
that last read it (and its checksum) is done; on CUDA that orders the current stream after them,
the host does not wait. A bucket whose only moving slot is one tensor's bytes on the lane's device
is broadcast straight from the tensor's memory (zero-byte slots beside it move nothing); any
other bucket is packed into the next buffer (a stream's `StreamPacker` packs into it directly).
On a plane whose receivers map this sender's memory (`ipc`), a state dict's tensors are not
sent at all: they are gathered into buckets whose headers say where each slot lies (`layout`,
`at`), receivers copy them from there, and the lane only checksums them, once the plan is out.

Every bucket a `Go` covers is posted, whatever fails: a tensor source that fails leaves the
buffer's bytes on the wire (the failure is recorded, the update is aborted afterwards), and a
broadcast that fails is recorded as a lost peer while the loop goes on (on gloo a receiver that
died fails only its own transfers: `planes.gloo`), so the live receivers get every collective
they agreed to.

The checksum of each bucket runs beside its collective (both only read the bytes): on CUDA on a
side stream, read back once for the `Seal`; on the CPU inline, while gloo's sends fly. Whether each
bucket's checksum is also sent right away as a `Digest` is the data plane's policy
(`Transport.digest_per_bucket`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from vllm_nccl_sync.outcomes import Kind, PeerFailed, Problem, clip
from vllm_nccl_sync.planes.base import Handle, Transport
from vllm_nccl_sync.wire.cuda_sums import warm
from vllm_nccl_sync.wire.integrity import (
    Pending,
    checksum,
    checksum_gpu,
    checksum_parts,
    checksum_parts_gpu,
    read_back,
)
from vllm_nccl_sync.wire.packing import (
    Bucket,
    StreamPacker,
    as_bytes,
    pack,
    plan_buckets,
    slot_total,
)
from vllm_nccl_sync.wire.protocol import PROTOCOL_VERSION, BucketHeader, Digest, Slot, Source
from vllm_nccl_sync.wire.taps import Tap


class BucketLane:
    """One sender's buckets on `transport`: double-buffered, checksummed per bucket (`check`).

    `digest(msg, to)` sends a bucket's `Digest` to the receivers it went to (`to`; None: all)
    where the data plane wants one per bucket; each post restarts the transport's deadman for
    `timeout_s`.
    """

    def __init__(self, transport: Transport, bucket_bytes: int, *, check: bool,
                 timeout_s: float, digest: Callable[[Digest, list[int] | None], None],
                 offset: int = 0) -> None:
        self.transport = transport
        self.offset = offset
        """A receiver's rank minus its rank in this lane's group (a header's `to` names ranks)."""
        self.device = transport.device
        self.shared = transport.shares_buffers
        """The plane's buffers are what receivers read (same host): every bucket is packed."""
        self.capacity = bucket_bytes
        self.buffers = (transport.shared_buffers() if self.shared else
                        [torch.empty(bucket_bytes, dtype=torch.uint8, device=self.device)
                         for _ in range(2)])
        self.check = check
        self.timeout_s = timeout_s
        self._cut: tuple[tuple, list[tuple]] | None = None
        """The last state dict's cut (`cut`): its key, and per bucket its slots, the index of
        each slot's item, and its receivers."""
        self._laid: tuple[list, set[str], list[Bucket], dict[int, tuple]] | None = None
        """The last state dict's layout read in place: its key, the names it gathered, its
        buckets, and per bucket its places and parts (`layout`)."""
        self._digest = digest
        self._packed: dict[int, tuple] = {}
        """Per bucket seq, the views of its buffer that bucket was last packed into (`pack`)."""
        cuda = self.device.type == "cuda"
        if cuda and check and self.shared:  # ipc: the checksum kernel built now, not in a push
            warm(self.device)
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._summed = [torch.cuda.Event(), torch.cuda.Event()] if cuda else []
        self.settled = True
        """Every collective posted so far was drained: no receiver reads the buffers now (an
        update that failed mid-way leaves it False until the next one drains)."""
        self.begin()

    def begin(self) -> None:
        """Start a new update: counters, checksums and failures from zero."""
        self.works: list[Handle | None] = [None, None]
        self.lost: list[PeerFailed] = []
        """Receivers whose data-plane transfer failed (rank -1: not known which)."""
        self.failure: BaseException | None = None
        """The tensor source's failure while a bucket was made (the bucket was still posted)."""
        self.sums: dict[int, Any] = {}
        self.posted = self.bytes = self.tensors = 0
        self.to_all = 0
        """Bytes of the buckets for every receiver."""
        self.to_some: dict[int, int] = {}
        """Per receiver rank: bytes of the buckets for some receivers that named it."""
        self.held: list[torch.Tensor] = []
        """Tensors receivers read where they lie in this update."""
        self._ahead = Tap()
        """Their checksums' terms, summed in one launch (`sum_ahead`)."""
        self._summed_ahead = False
        self._unsummed: dict[int, list[torch.Tensor]] = {}
        """The parts of buckets read in place whose checksum `post` computes."""
        self._early: dict[int, int] = {}
        """On the host: checksums of buckets made before their post (`ahead`), by seq."""

    # ------------------------------------------------------------------ buffers

    def _free(self, i: int) -> torch.Tensor:
        work, self.works[i] = self.works[i], None
        if work is not None:
            try:
                work.wait()  # gloo: bounded by the group's timeout
            except PeerFailed as e:  # the others got their bytes; go on without that receiver
                self.lost.append(e)
        if self._stream is not None:  # and the checksum that read it
            torch.cuda.current_stream(self.device).wait_event(self._summed[i])
        return self.buffers[i]

    def next_buffer(self) -> torch.Tensor:
        """The buffer the next bucket posted goes out of, once nothing reads it any more."""
        return self._free(self.posted % 2)

    def wire(self, slots: Sequence[Slot], sources: Sequence[torch.Tensor]) -> torch.Tensor:
        """The next bucket's wire bytes: the tensor's own memory when its only moving slot is one
        tensor's bytes on this device and the plane does not share its buffers, else packed into
        the next buffer."""
        bucket = Bucket(list(slots), list(sources))
        moving = bucket.moving()
        buf = self.next_buffer()
        if moving is not None and moving[1].device == self.device and not self.shared:
            slot, src = moving  # zero copy: the collective reads the tensor's own memory
            return as_bytes(src)[slot.start : slot.start + slot.nbytes]
        return pack(bucket, buf, self._packed, self.posted)

    # ------------------------------------------------------------------ read in place

    def layout(self, items: list[tuple[str, torch.Tensor]], alone: int) -> Iterator[Bucket]:
        """A state dict's buckets: on a plane whose receivers map this sender's memory, every
        non-empty tensor on this device that it can export first, gathered into buckets of up to
        the capacity (each read where its slots lie: `at`), then the rest packed; elsewhere
        `cut` of them. Gathered, not one bucket per tensor: each bucket costs each
        side about 0.3 ms of host time (171 tensors of a 7B model read one bucket each were
        slower than packing them). A state dict whose tensors lie where the last one's did (same
        names, addresses, dtypes, shapes, strides: the same storages, which the last layout
        holds until the next state dict's layout) reuses that layout and its places: per push,
        the host then only compares the tensors and queues their checksums."""
        if not self.shared:  # gloo, nccl: nothing is read where it lies
            return iter(self.cut(items, alone))
        key = [(n, t.data_ptr(), t.dtype, t.shape, t.stride(), t.device) for n, t in items]
        if self._laid is None or self._laid[0] != key:
            self._laid = None  # the storages the last one held may go
            mine = [(n, t) for n, t in items if t.numel() and t.device == self.device
                    and self.transport.export(t) is not None]
            gathered = list(plan_buckets(mine, self.capacity, self.capacity + 1))  # none alone
            self._laid = (key, {n for n, _ in mine}, gathered,
                          {id(b): (self._places(b), _parts(b)) for b in gathered})
        _, names, gathered, laid = self._laid
        rest = [(n, t) for n, t in items if n not in names]
        return itertools.chain(gathered, self.cut(rest, alone))

    def cut(self, items: list[tuple[str, torch.Tensor]], alone: int) -> list[Bucket]:
        """`plan_buckets` of a state dict's `items`, the cut kept: items of the same names,
        dtypes and shapes as the last ones cut are laid out as they were (the same slots, each
        slot's source the item's tensor; about 3 us per tensor less, 0.5 ms for 171)."""
        key = [(n, t.dtype, t.shape) for n, t in items]
        if self._cut is None or self._cut[0] != (key, alone):
            index = {n: i for i, (n, _) in enumerate(items)}
            buckets = list(plan_buckets(items, self.capacity, alone))
            self._cut = ((key, alone), [(b.slots, [index[s.name] for s in b.slots], b.to)
                                        for b in buckets])
            return buckets
        return [Bucket(slots, [items[i][1] for i in which], to)
                for slots, which, to in self._cut[1]]

    def _places(self, bucket: Bucket) -> list[Source] | None:
        """Where each slot of `bucket` lies in memory the receivers map, if every one does."""
        places = []
        for slot, src in zip(bucket.slots, bucket.sources, strict=True):
            where = self.transport.export(src) if slot.nbytes and src.device == self.device \
                else None
            if where is None:
                return None
            places.append(Source(where.segment, where.offset + slot.start))
        return places or None

    def at(self, bucket: Bucket, seq: int) -> list[Source] | None:
        """Where each slot of bucket `seq` lies in memory the receivers map, if every one does
        (the tensors are held until the next update: receivers read them until they
        acknowledge). Its checksum is computed once the plan is out (`sum_ahead`; on the host
        at its `post`): the plan waits only for the tensors to be final (`settle`)."""
        laid = self._laid[3].get(id(bucket)) if self._laid is not None else None
        places = laid[0] if laid is not None else self._places(bucket)
        if places is None:
            return None
        self.held += bucket.sources
        if self.check:
            self._unsummed[seq] = laid[1] if laid is not None else _parts(bucket)
        return places

    def settle(self) -> None:
        """Before a plan names memory read where it lies: the receivers got it (`hand_over`),
        and this device's queued work is done (bounded): what they read is final."""
        self.transport.hand_over()
        if self.device.type == "cuda":
            self.transport.wait_stream(torch.cuda.current_stream(self.device), self.timeout_s)

    def ahead(self, seq: int, wire: torch.Tensor) -> None:
        """Bucket `seq`'s wire bytes were made before its post, while the receivers check the
        plan or before a `Repeat` (nothing writes them until it is posted): on the host its
        checksum is taken now too, so its `Digest` follows the post at once (measured: 0.07-0.1
        ms sooner for 349 KB, on a 2-core host where summing beside the transfer shares the
        cores with it)."""
        if self.check and self._stream is None and wire.numel():
            self._early[seq] = checksum(wire)

    def fill(self, packer: StreamPacker) -> tuple[list[Slot], bool, torch.Tensor]:
        """Pack a stream's next bucket straight into the next buffer: its slots, whether it is
        the last one, and its wire bytes."""
        buf = self.next_buffer()
        slots, is_last = packer.fill(buf)
        length = slots[-1].offset + slots[-1].nbytes if slots else 0
        return slots, is_last, buf[:length]

    # ------------------------------------------------------------------ posting

    def post(self, header: BucketHeader, make_wire: Callable[[], torch.Tensor]) -> None:
        """Post bucket `header` (always: a `Go` covers it) from `make_wire()`'s bytes, with its
        checksum beside it (and its `Digest` where the plane wants one). A failing `make_wire`
        or broadcast is recorded (`failure`, `lost`), never raised."""
        self.settled = False
        if header.at is not None:  # read where it lies: nothing to send, its checksum made
            self.posted += 1
            self.sums[header.seq] = self._read_in_place(header.seq)
        else:
            try:
                wire = make_wire()
            except Exception as e:  # noqa: BLE001 - agreed: the collective still runs
                self.failure = self.failure or e
                wire = self.next_buffer()[: header.length]
            i = self.posted % 2
            self.posted += 1
            if header.length:
                try:
                    self.works[i] = self.transport.broadcast(wire, to=self._to(header))
                except RuntimeError as e:  # the group was given up meanwhile (`Transport.broken`)
                    self.lost.append(PeerFailed(f"broadcast of bucket {header.seq} failed: "
                                                f"{clip(str(e), 300)}", -1))
            digest: Any = self._early.pop(header.seq, 0)
            if self.check and header.length and not digest:
                digest = checksum(wire) if self._stream is None else self._beside(wire, i)
            self.sums[header.seq] = digest
        digest = self.sums[header.seq]
        if self.transport.digest_per_bucket and header.length:
            try:
                self._digest(Digest(PROTOCOL_VERSION, header.version, header.seq, digest),
                             header.to)
            except Exception as e:  # noqa: BLE001 - the next collectives are still owed
                self.failure = self.failure or e
        self.transport.extend(self.timeout_s)  # progress: restart the deadman
        self.bytes += header.length
        self.tensors += sum(s.start + s.nbytes == slot_total(s) for s in header.slots)

    def sum_ahead(self) -> None:
        """CUDA: queue the checksums of every bucket read in place laid out so far, in one
        launch on the side stream, after this device's queued work (once per update). Called
        once the plan is out, while receivers check it, before they read (both only read):
        summed before the plan instead, the plan waited 1.3-2.0 ms for them on one H100, after
        1.5 ms of host time to queue them; queued after the `Go` (at the first post), the `Go`
        came 0.1-0.2 ms sooner but the push took 0.4-1.0 ms longer there (colocated; likely,
        not established: the receivers' copies and these sums interleave on the device)."""
        if self._stream is None or self._summed_ahead or not self._unsummed:
            return
        self._summed_ahead = True
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            self._ahead.sum_missing([p for ps in self._unsummed.values() for p in ps])

    def _read_in_place(self, seq: int) -> Any:
        """The checksum of bucket `seq`, read where it lies (0: unchecked): on the host
        computed now, on CUDA made of what `sum_ahead` queued."""
        self.sum_ahead()
        parts = self._unsummed.pop(seq, None)
        if parts is None:
            return 0
        if self._stream is None:
            return checksum_parts(parts)
        with torch.cuda.stream(self._stream):
            return checksum_parts_gpu(parts, [self._ahead.take(p) for p in parts])

    def _to(self, header: BucketHeader) -> list[int] | None:
        """The group ranks bucket `header` goes to (None: every receiver), counted."""
        if header.to is None:
            self.to_all += header.length
            return None
        for r in header.to:
            self.to_some[r] = self.to_some.get(r, 0) + header.length
        return [r - self.offset for r in header.to]

    def per_receiver(self, ranks: Sequence[int]) -> dict[int, int]:
        """The bytes each receiver of `ranks` was sent in this update ({} when every bucket
        went to every receiver)."""
        if not self.to_some:
            return {}
        return {r: self.to_all + self.to_some.get(r, 0) for r in ranks}

    def _beside(self, wire: torch.Tensor, i: int) -> Pending:
        """CUDA: the checksum on the side stream, after the pack, beside the collective."""
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            digest = checksum_gpu(wire)
            self._summed[i].record(self._stream)
        wire.record_stream(self._stream)  # a tensor's own memory outlives its use here
        return digest

    def drain(self) -> dict[int, int]:
        """Wait (bounded) for the last collectives and checksums; every checksum by seq."""
        for i in range(2):
            self._free(i)
        if self._stream is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self._stream)
            self.transport.wait_stream(cur, self.timeout_s)
            keys = list(self.sums)  # one read back per update
            self.sums.update(zip(keys, read_back([self.sums[k] for k in keys]), strict=True))
        self.settled = True
        return {k: int(v) for k, v in self.sums.items()}

    def lost_problem(self, offset: int) -> tuple[Problem | None, list[int]]:
        """What the lost peers say (None if none), and the receivers (group rank + `offset`)
        that left the data plane."""
        named = [e for e in self.lost if e.rank >= 0]
        left = sorted({e.rank + offset for e in named})
        parts = []
        if left:
            who = f"rank {left[0]}" if len(left) == 1 else f"ranks {left}"
            parts.append(f"{who} left the data plane: {clip(str(named[0]), 300)}")
        parts += [clip(str(e), 300) for e in self.lost if e.rank < 0][:1]
        return (Problem(Kind.LOST, "; ".join(parts)) if parts else None), left


def _parts(bucket: Bucket) -> list[torch.Tensor]:
    """The bytes of each slot of `bucket` where they lie (flat uint8 views)."""
    return [as_bytes(src)[s.start : s.start + s.nbytes]
            for s, src in zip(bucket.slots, bucket.sources, strict=True)]
