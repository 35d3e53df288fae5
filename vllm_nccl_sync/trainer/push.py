"""Sender: the trainer-side push client (rank 0 of the transfer group).

`PushClient.push` streams `(name, tensor)` pairs (a `state_dict()`, a generator, FSDP full
tensors gathered one at a time) as buckets to every receiver of every engine at once: one
broadcast per bucket feeds them all.

Agreement comes before the data, once: the `Plan` carries every bucket header of a state dict
(the first `window` of a stream), every receiver checks them all and answers once, and one `Go`
covers them (`rounds`). Then the collectives run back to back, double-buffered, with no control
round trip between them (`lane`). A stream announces each next header while the buckets before
it fly, so its `Go`s arrive ahead of the collectives they cover; by default each tensor is
copied into a buffer as soon as it is pulled (`StreamPacker`), so a trainer gathering full
tensors one at a time holds at most one of them beyond the two buffers.

After the last bucket the sender seals the update and commits it only when every receiver of
every engine acknowledged. Every wait is bounded. Once a `Go` was sent, every collective it covers
is posted, whatever fails (a receiver's `Error`, the tensor source): the group stays in step, and
the failure is answered by `Abort` after the last agreed collective. A timeout after a collective
was posted aborts the NCCL communicator (the client must then be replaced).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace

import msgspec
import torch

from vllm_nccl_sync.outcomes import PeerFailed, PushError, UpdateRefused
from vllm_nccl_sync.planes.base import Transport
from vllm_nccl_sync.planes.registry import open_transport
from vllm_nccl_sync.trainer.lane import BucketLane
from vllm_nccl_sync.trainer.multisend import Coordinator, PeerSender
from vllm_nccl_sync.trainer.rounds import Rounds
from vllm_nccl_sync.trainer.send import Buckets, Lead, Sender, Wire, send
from vllm_nccl_sync.trainer.shards import fallbacks, read_sets, shard_buckets
from vllm_nccl_sync.trainer.tensors import (
    Caster,
    Progress,
    PushResult,
    engine_dtype,
    without_aliases,
)
from vllm_nccl_sync.wire.channel import SenderChannel
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.deadline import Deadline
from vllm_nccl_sync.wire.packing import (
    Bucket,
    StreamPacker,
    alone_bytes,
    dtype_name,
    plan_buckets,
)
from vllm_nccl_sync.wire.protocol import (
    MAX_FRAME_BYTES,
    MAX_PLAN_BUCKETS,
    PROTOCOL_VERSION,
    AdapterSpec,
    BucketHeader,
    Hello,
    Plan,
    ReadSet,
    Repeat,
    SenderHello,
    TensorSpec,
)

__all__ = ["PeerFailed", "PushClient", "PushError", "PushResult", "UpdateRefused"]


def _with_last(it: Iterator[Bucket]) -> Iterator[tuple[Bucket, bool]]:
    """Pairs each bucket with whether it is the last one (one bucket of look-ahead)."""
    cur = next(it, None)
    if cur is None:
        yield Bucket(), True  # an empty update still completes the protocol
        return
    for nxt in it:
        yield cur, False
        cur = nxt
    yield cur, True


class OneSender(Sender):
    """One sender's update, as `send` takes it: a state dict laid out whole and announced in
    one `Plan` (its tensors read where they lie on a plane that maps them), or a stream whose
    next headers are announced while the buckets before them fly (see the module text)."""

    side = "the trainer"

    def __init__(self, rounds: Rounds, lane: BucketLane, cfg: SyncConfig,
                 named_tensors: Mapping[str, torch.Tensor] | Iterable, version: int,
                 caster: Caster, *, force: bool, full: bool, staged: bool,
                 adapter: AdapterSpec | None, window: int,
                 reads: Mapping[int, ReadSet] | None = None,
                 agreed: tuple[int, tuple] | None = None, layout_id: int = 0) -> None:
        self.rounds, self.lane, self.cfg = rounds, lane, cfg
        self.verdict = Lead(rounds)
        self.armed_s = cfg.timeout_s
        self.version, self.caster, self.window = version, caster, window
        self.force, self.full, self.staged, self.adapter = force, full, staged, adapter
        self._source: Mapping[str, torch.Tensor] | Iterable | None = named_tensors
        self.specs: list[TensorSpec] = []
        self.packer: StreamPacker | None = None
        self.planned: Iterator[tuple[Bucket, bool]] = iter(())
        self.in_place = False  # a state dict's tensors may be read where they lie (`lane.layout`)
        self.reads = reads
        """Every receiver's read set: a state dict goes shard to shard (`shards`)."""
        self.pending: deque[tuple[BucketHeader, Wire]] = deque()
        """Announced buckets not yet sent: header, and how to get the wire bytes."""
        self.failure: BaseException | None = None
        """The tensor source's, after a Go."""
        self.agreed, self.layout_id = agreed, layout_id
        """The id and key of the layout every receiver holds (`PushClient`), and the id this
        update's plan gives its own."""
        self.layout: tuple[int, tuple] | None = None
        """This update's layout (id, key), where it has one (`_opening`)."""

    def _lay_out(self) -> None:
        """The source as buckets: a state dict's planned now, a stream's as it is pulled."""
        named, self._source = self._source, None
        cfg, caster = self.cfg, self.caster
        alone = alone_bytes(cfg.bucket_bytes, cfg.backend)
        if isinstance(named, Mapping):
            items = [(n, caster(n, t)) for n, t in without_aliases(named)]
            self.specs = [TensorSpec(n, dtype_name(t.dtype), list(t.shape)) for n, t in items]
            if self.reads is not None:
                shards = shard_buckets(items, self.reads, cfg.bucket_bytes, alone)
                self.planned = _with_last(shards)
                return
            self.planned = _with_last(self.lane.layout(items, alone))
            self.in_place = True
        elif self.window > 1:  # holds the tensors of up to `window` announced buckets
            self.planned = _with_last(plan_buckets(caster.each(named), cfg.bucket_bytes, alone))
        else:  # each tensor is packed into a buffer as soon as it is pulled, and let go
            self.packer = StreamPacker(caster.each(named), cfg.bucket_bytes)

    def _plan_next(self) -> BucketHeader:
        """Make the next bucket's header (and how to get its bytes), pending until sent."""
        lane, pending = self.lane, self.pending
        seq = pending[-1][0].seq + 1 if pending else lane.posted
        if self.packer is not None:  # packed now, into the buffer it is sent from
            slots, is_last, wire = lane.fill(self.packer)
            h = BucketHeader(PROTOCOL_VERSION, self.version, seq, wire.numel(), is_last, slots,
                             self.force, self.staged)
            pending.append((h, lambda: wire))
        else:
            bucket, is_last = next(self.planned)
            at = lane.at(bucket, seq) if self.in_place else None
            h = bucket.header(self.version, seq, is_last, PROTOCOL_VERSION, self.force,
                              self.staged, at)
            pending.append((h, lambda: lane.wire(bucket.slots, bucket.sources)))
        return h

    def agree(self) -> Buckets:
        """The `Plan` (every header of a state dict; a stream's first `window`), one `Go`."""
        self.rounds.begin(self.version)
        self._lay_out()
        headers = [self._plan_next()]
        size = len(msgspec.msgpack.encode(self.specs)) + len(msgspec.msgpack.encode(headers))
        while (not headers[-1].is_last and (self.specs or len(headers) < self.window)
               and size <= MAX_FRAME_BYTES // 2 and len(headers) < MAX_PLAN_BUCKETS):
            headers.append(self._plan_next())  # past the bounds: the rest follows as a stream
            size += len(msgspec.msgpack.encode(headers[-1]))
        if any(h.at is not None for h in headers):
            self.lane.settle()  # what receivers read where it lies is final
        opening = self._opening(headers)
        repeat = isinstance(opening, Repeat)
        if repeat:  # its receivers check next to nothing: make the first bucket before it is sent
            self._pack_first()
        self.rounds.open(opening, headers[-1].seq,
                         meanwhile=self.lane.sum_ahead if repeat else self._meanwhile)
        # A plan too big for one frame: the rest of its headers follow at the same distance.
        self.window = max(self.window, len(headers))
        return self._buckets()

    def _opening(self, headers: list[BucketHeader]) -> Plan | Repeat:
        """The message that opens this update: a `Repeat` where the plan's layout is the one
        every receiver accepted for the last update, which committed (`agreed`); else the
        `Plan`, its layout given the id `layout[0]` where it holds every header of a state
        dict."""
        key = (self.specs, [(h.seq, h.length, h.is_last, h.slots, h.force, h.staged, h.src, h.at,
                             h.to) for h in headers], self.full, self.force, self.adapter,
               self.staged)
        if not (self.specs and headers[-1].is_last):
            self.layout = None
        elif self.agreed is not None and self.agreed[1] == key:
            self.layout = self.agreed
            return Repeat(PROTOCOL_VERSION, self.version, self.agreed[0])
        else:
            self.layout = (self.layout_id, key)
        return Plan(PROTOCOL_VERSION, self.version, self.specs, self.full, self.force,
                    self.adapter, headers, self.staged, self.layout[0] if self.layout else 0)

    def _meanwhile(self) -> None:
        """While the receivers check the plan: the checksums of what they read in place queued
        (`BucketLane.sum_ahead`), the first bucket made (`_pack_first`)."""
        self.lane.sum_ahead()
        self._pack_first()

    def _pack_first(self) -> None:
        """Make the first bucket's wire bytes before its post, where its buffer is free
        (the last update drained every collective; else a receiver may still read it until it
        answers this plan); what making them raised is raised when the bucket is posted, as it
        would have been then. A `Plan`'s first bucket is made while the receivers check it; a
        `Repeat`'s before it is sent, since its receivers check next to nothing (on a 2-core
        host 0.03 ms, against 0.15-0.3 ms to make 171 tensors' bucket and sum it): their
        update, from the `Repeat` to the `Commit`, then no longer waits for it (0.15-0.2 ms
        less side by side; the push about 0.1 ms more)."""
        header, make = self.pending[0]
        if header.at is not None or header.seq != self.lane.posted or not self.lane.settled:
            return
        try:
            wire = make()
        except Exception as e:  # noqa: BLE001 - the tensor source's, recorded at the post
            failed = e

            def made() -> torch.Tensor:
                raise failed
        else:
            self.lane.ahead(header.seq, wire)

            def made() -> torch.Tensor:
                return wire
        self.pending[0] = (header, made)

    def _buckets(self) -> Buckets:
        """Each pending bucket once its `Go` came; after each, one more announced and the
        answers taken. Ends early on a failure once every agreed bucket is out."""
        lane, rounds = self.lane, self.rounds
        while True:
            if lane.posted > rounds.agreed:  # a stream's window fell behind the wire
                rounds.await_go(lane.posted)
            header = self.pending[0][0]
            yield self.pending.popleft()
            if header.is_last:
                return
            self._announce(header)
            rounds.poll(hold=self._held())
            if (self._held() or rounds.errors or rounds.unreachable) and \
                    lane.posted > rounds.agreed:
                return  # every agreed collective is posted: the live ranks are in step

    def _held(self) -> bool:
        """Whether this side failed (the tensor source, or a collective)."""
        return bool(self.failure or self.lane.failure or self.lane.lost)

    def _announce(self, posted: BucketHeader) -> None:
        """Announce one more bucket while `posted` flies, up to `window` ahead of the wire."""
        last = self.pending[-1][0] if self.pending else posted
        if self._held() or self.rounds.errors or len(self.pending) >= self.window or \
                last.is_last:
            return
        try:
            nxt = self._plan_next()
        except Exception as e:  # noqa: BLE001 - the tensor source failed
            self.failure = e
        else:
            self.rounds.tell(nxt)

    def checked(self, sums: dict[int, int]) -> int:
        failure = self.failure or self.lane.failure
        if failure is not None:
            raise failure
        lost, left = self.lane.lost_problem(0)
        if lost or self.rounds.errors or self.rounds.unreachable:
            raise self.rounds.failure(f"failed at bucket {self.lane.posted - 1}", left,
                                      lost.text if lost else "")
        return self.lane.posted

    def stop(self) -> tuple[int, str]:
        return self.lane.posted, f" at bucket {self.lane.posted}"

    def per_receiver(self) -> dict[int, int]:
        return self.lane.per_receiver(self.rounds.receivers)

    def out_of_step(self, e: BaseException) -> bool:
        """Past a collective: a receiver that said nothing or left, or a `Go` whose collectives
        were not all posted."""
        lane = self.lane
        in_step = lane.posted > self.rounds.agreed  # every collective a Go covers was posted
        return bool(lane.posted and (getattr(e, "missing", []) or not in_step or lane.lost
                                     or isinstance(e, PeerFailed)))


class PushClient:
    """Binds the control socket and hosts the group's rendezvous; then pushes updates.

    Several senders (`cfg.senders`): every trainer rank that sends makes one with its `rank`
    (0..M-1) and calls `connect` and `push` with the tensors it owns (or, `balance=True`, all it
    can produce). Rank 0 is the coordinator: it hosts the control socket and runs the agreement
    and the commit round for all of them (`multisend`).

    Shard to shard (`cfg.shard`): `connect` takes every worker's read set (`reads`), and each
    push of a state dict sends each worker only what its loaders read (`shards`); with several
    senders, each rank passes its own `state_dict()` (FSDP2 DTensors: it sends from its shards).
    """

    def __init__(self, cfg: SyncConfig, device: torch.device | None = None, *,
                 rank: int = 0) -> None:
        if not 0 <= rank < cfg.num_senders:
            raise ValueError(f"sender rank {rank} outside [0, {cfg.num_senders})")
        self.cfg = cfg
        self.device = device
        self.rank = rank
        self.hellos: dict[int, Hello] = {}
        self.reads: dict[int, ReadSet] | None = None
        """Shard to shard (`cfg.shard`): every receiver's read set, checked at `connect`."""
        self.whole: dict[str, str] = {}
        """Shard to shard: the tensors some worker reads whole, and why (`PushResult.whole`)."""
        self.peers: set[int] = set()
        """The other senders that joined (several senders only)."""
        self.transport: Transport | None = None
        self.lane: BucketLane | None = None
        self.rounds: Rounds | None = None
        self._agreed: tuple[int, tuple] | None = None
        """The id and key of the layout of the last update, which committed: every receiver
        accepted its plan, so the next update of that layout opens with a `Repeat`."""
        self._layouts = 0
        """Layout ids given so far."""
        self._peer = PeerSender(cfg, rank, device) if rank > 0 else None
        if self._peer is None:
            self.channel = SenderChannel(cfg.host, cfg.control_port, cfg.secret_bytes)

    @property
    def ranks(self) -> list[int]:
        """The receivers' ranks."""
        return list(range(self.cfg.num_senders, self.cfg.world_size))

    def connect(self) -> dict[int, Hello]:
        """Rendezvous with every receiver (blocks until all joined, at most `timeout_s`)."""
        if self._peer is not None:
            out = self._peer.connect()
            self.transport, self.lane = self._peer.transport, self._peer.lane
            return out
        cfg = self.cfg
        self.transport = open_transport(cfg.group(0), 0, self.device)
        early: list[tuple[int, object]] = []  # other senders' first Offers
        deadline = Deadline(cfg.timeout_s)
        while len(self.hellos) < len(self.ranks) or len(self.peers) < cfg.num_senders - 1:
            rank, msg = self.channel.recv(deadline.at)
            if isinstance(msg, SenderHello) and 0 < rank < cfg.num_senders:
                who, us = f"sender {rank}", "the coordinator"
            elif rank in self.peers:  # a sender that joined already may offer its first update
                early.append((rank, msg))
                continue
            elif not isinstance(msg, Hello):
                raise PushError(f"expected Hello from rank {rank}, got {msg!r:.200}")
            elif msg.rank != rank or rank not in self.ranks:
                raise PushError(f"Hello from socket rank {rank} claims rank {msg.rank}")
            else:
                who, us = f"rank {rank}", "the trainer"
            if (msg.bucket_bytes, msg.backend) != (cfg.bucket_bytes, cfg.backend):
                raise PushError(f"{who} runs bucket_bytes={msg.bucket_bytes} "
                                f"backend={msg.backend}, {us} {cfg.bucket_bytes} {cfg.backend}")
            if isinstance(msg, Hello):
                self.hellos[rank] = msg
            else:
                self.peers.add(rank)
        if cfg.shard:
            self.reads = read_sets(self.hellos)
            self.whole = fallbacks(self.reads)
        self.rounds = Rounds(self.channel, self.ranks, cfg.timeout_s, peers=sorted(self.peers),
                             early=early, extend=self.transport.extend)
        self.lane = BucketLane(self.transport, cfg.bucket_bytes, offset=cfg.num_senders - 1,
                               check=cfg.bucket_checksums is not False, timeout_s=cfg.timeout_s,
                               digest=self.rounds.tell)
        return self.hellos

    def check(self, named_tensors: Mapping[str, torch.Tensor] | Iterable, *,
              dtype: torch.dtype | None = None, window: int = 1,
              adapter: AdapterSpec | None = None, balance: bool = False) -> None:
        """The preconditions of `push`, checked before anything is sent (every path): raises
        `ValueError`/`TypeError` for a combination of arguments that cannot work, `RuntimeError`
        before `connect()`, `PushError` for a broken group, for receivers that require checksums
        when this client sends none, for engines holding different dtypes and for a mapping
        that needs a cast into float16 (both without `dtype`).
        """
        several = self.cfg.num_senders > 1
        mapping = isinstance(named_tensors, Mapping)
        if window < 1:
            raise ValueError(f"window {window} must be at least 1")
        if several and (adapter is not None or window != 1):
            raise ValueError("several senders send base weights as a state dict: no adapter, "
                             "no window")
        if several and not mapping:
            raise TypeError("several senders take a mapping (a state dict) of each rank's "
                            "tensors, not a stream")
        if balance and not several:
            raise ValueError("balance takes several senders (SyncConfig.senders)")
        if adapter is not None and not mapping:
            raise TypeError("an adapter update takes a mapping of its tensors, not a stream")
        if self.transport is None:
            raise RuntimeError("call connect() before push()")
        if self.transport.broken:
            again = ("every sender and receiver must join again (new PushClient / Receiver)"
                     if several else "connect a new PushClient")
            raise PushError(f"transfer group is broken ({self.transport.broken}); {again}")
        strict = sorted(r for r, h in self.hellos.items() if h.checksums)
        if strict and self.cfg.bucket_checksums is False:
            raise PushError(f"ranks {strict} require bucket checksums; this client has "
                            "bucket_checksums=False")
        if dtype is None and self._peer is None:
            caster = Caster(None, engine_dtype(self.hellos))  # raises when the engines disagree
            for name, t in named_tensors.items() if mapping else ():
                caster.target(name, t.dtype)  # raises for a cast that could overflow

    def push(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        dtype: torch.dtype | None = None,
        progress: Progress | None = None,
        force: bool = False,
        full: bool = False,
        staged: bool = False,
        adapter: AdapterSpec | None = None,
        window: int = 1,
        balance: bool = False,
        verified: Callable[[], None] | None = None,
    ) -> PushResult:
        """Send one complete update; returns once every receiver of every engine committed it.

        A mapping (a `state_dict()`) is announced first as a `Plan` holding every tensor and
        every bucket header, which every receiver checks against its model (names, shapes,
        dtypes; with `full`, that nothing is missing) before any byte moves; tied aliases sharing
        one storage are sent once. An iterable (a generator gathering FSDP shards one at a time)
        is streamed: each tensor is copied into a bucket buffer as soon as it is pulled, and each
        bucket's header is announced (and agreed) while the bucket before it flies; `window` > 1
        announces that many buckets ahead of the wire instead, holding their tensors until sent.
        Floating-point tensors are cast to the engines' dtype where the cast is faithful, or to
        `dtype` when given (`tensors`; `PushResult.cast` says what was cast). Receivers refuse a
        `version` not newer than the one they hold unless `force`. `staged`: receivers load
        nothing until every bucket of every receiver arrived and verified. `adapter`: the
        tensors are this LoRA adapter's (a mapping only); receivers add it or replace the
        weights of the adapter of that name, and version it on its own. `verified` (staged
        updates of one sender) is called once every receiver verified everything and was told so
        (the first `Commit`), before the receivers load: engines receiving beside serving swap then.

        Several senders: every sender rank calls `push` with the same `version` and flags and a
        mapping of the tensors it owns; with `balance`, of every tensor it can produce, and the
        coordinator gives each tensor one owner, balancing bytes (`owners.plan_owners`). Each
        rank returns the same outcome (its own `bytes`; `per_sender` on the coordinator).

        Raises what `check` raises, `UpdateRefused` if a receiver refused the plan (nothing
        moved), else `PushError` naming who failed (`errors`) or said nothing (`missing`); every
        live receiver then ends the update the same way (on a timeout the NCCL communicator is
        aborted and this client must be replaced).
        """
        self.check(named_tensors, dtype=dtype, window=window, adapter=adapter, balance=balance)
        if verified is not None and (not staged or self.cfg.num_senders > 1):
            raise ValueError("verified= needs a staged update from one sender")
        if self._peer is not None:
            return self._peer.push(named_tensors, version, dtype=dtype, force=force, full=full,
                                   staged=staged, balance=balance)
        caster = Caster(dtype, engine_dtype(self.hellos) if dtype is None else "")
        sender = self._sender(named_tensors, version, caster, force=force, full=full,
                              staged=staged, adapter=adapter, window=window, balance=balance)
        result = send(sender, version, caster, staged=staged, progress=progress, verified=verified)
        self._agreed = sender.layout
        caster.report(version)
        return replace(result, whole=dict(self.whole)) if self.whole else result

    def _sender(self, named_tensors: Mapping[str, torch.Tensor] | Iterable, version: int,
                caster: Caster, *, force: bool, full: bool, staged: bool,
                adapter: AdapterSpec | None, window: int, balance: bool) -> Sender:
        """This update's `Sender`: the coordinator's with several senders, else one sender's,
        told the layout every receiver holds (which only an update that commits keeps)."""
        parts = (self.rounds, self.lane, self.cfg, named_tensors, version, caster)
        agreed, self._agreed = self._agreed, None
        self._layouts += 1
        if self.cfg.num_senders > 1:
            return Coordinator(*parts, force=force, full=full, staged=staged, balance=balance,
                               reads=self.reads)
        return OneSender(*parts, force=force, full=full, staged=staged, adapter=adapter,
                         window=window, reads=None if adapter else self.reads, agreed=agreed,
                         layout_id=self._layouts)

    def close(self) -> None:
        if self._peer is not None:
            self._peer.close()
            return
        if self.transport is not None:
            self.transport.close()
        self.channel.close()
