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

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping

import msgspec
import torch

from vllm_nccl_sync.outcomes import PeerFailed, PushError, UpdateRefused, as_push_error, clip
from vllm_nccl_sync.planes.base import Transport
from vllm_nccl_sync.planes.registry import open_transport
from vllm_nccl_sync.trainer.lane import BucketLane
from vllm_nccl_sync.trainer.multisend import PeerSender, coordinate
from vllm_nccl_sync.trainer.rounds import Rounds
from vllm_nccl_sync.trainer.tensors import (
    Caster,
    Progress,
    PushResult,
    engine_dtype,
    without_aliases,
)
from vllm_nccl_sync.wire.channel import SenderChannel
from vllm_nccl_sync.wire.config import SyncConfig
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
    Seal,
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


class PushClient:
    """Binds the control socket and hosts the group's rendezvous; then pushes updates.

    Several senders (`cfg.senders`): every trainer rank that sends makes one with its `rank`
    (0..M-1) and calls `connect` and `push` with the tensors it owns (or, `balance=True`, all it
    can produce). Rank 0 is the coordinator: it hosts the control socket and runs the agreement
    and the commit round for all of them (`multisend`).
    """

    def __init__(self, cfg: SyncConfig, device: torch.device | None = None, *,
                 rank: int = 0) -> None:
        if not 0 <= rank < cfg.num_senders:
            raise ValueError(f"sender rank {rank} outside [0, {cfg.num_senders})")
        self.cfg = cfg
        self.device = device
        self.rank = rank
        self.hellos: dict[int, Hello] = {}
        self.peers: set[int] = set()
        """The other senders that joined (several senders only)."""
        self.transport: Transport | None = None
        self.lane: BucketLane | None = None
        self.rounds: Rounds | None = None
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
        deadline = time.monotonic() + cfg.timeout_s
        while len(self.hellos) < len(self.ranks) or len(self.peers) < cfg.num_senders - 1:
            rank, msg = self.channel.recv(deadline)
            if isinstance(msg, SenderHello) and 0 < rank < cfg.num_senders:
                if (msg.bucket_bytes, msg.backend) != (cfg.bucket_bytes, cfg.backend):
                    raise PushError(f"sender {rank} runs bucket_bytes={msg.bucket_bytes} "
                                    f"backend={msg.backend}, the coordinator "
                                    f"{cfg.bucket_bytes} {cfg.backend}")
                self.peers.add(rank)
                continue
            if rank in self.peers:  # a sender that joined already may offer its first update
                early.append((rank, msg))
                continue
            if not isinstance(msg, Hello):
                raise PushError(f"expected Hello from rank {rank}, got {msg!r:.200}")
            if msg.rank != rank or rank not in self.ranks:
                raise PushError(f"Hello from socket rank {rank} claims rank {msg.rank}")
            if (msg.bucket_bytes, msg.backend) != (cfg.bucket_bytes, cfg.backend):
                raise PushError(
                    f"rank {rank} runs bucket_bytes={msg.bucket_bytes} backend={msg.backend}, "
                    f"the trainer {cfg.bucket_bytes} {cfg.backend}"
                )
            self.hellos[rank] = msg
        self.rounds = Rounds(self.channel, self.ranks, cfg.timeout_s, peers=sorted(self.peers),
                             early=early, extend=self.transport.extend)
        self.lane = BucketLane(self.transport, cfg.bucket_bytes,
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
        if self.cfg.num_senders > 1:
            result = coordinate(self.rounds, self.lane, self.cfg, named_tensors, version, caster,
                                force=force, full=full, staged=staged, balance=balance,
                                progress=progress)
        else:
            result = self._send(named_tensors, version, caster, progress=progress, force=force,
                                full=full, staged=staged, adapter=adapter, window=window,
                                verified=verified)
        caster.report(version)
        return result

    def _send(self, named_tensors: Mapping[str, torch.Tensor] | Iterable, version: int,
              caster: Caster, *, progress: Progress | None, force: bool, full: bool,
              staged: bool, adapter: AdapterSpec | None, window: int,
              verified: Callable[[], None] | None = None) -> PushResult:
        """One sender's update (see `push`)."""
        cfg, lane, rounds = self.cfg, self.lane, self.rounds
        lane.begin()
        rounds.begin(version)
        specs: list[TensorSpec] = []
        packer = None
        in_place = False  # a state dict's tensors may be read where they lie (`lane.layout`)
        alone = alone_bytes(cfg.bucket_bytes, cfg.backend)
        if isinstance(named_tensors, Mapping):
            items = [(n, caster(n, t)) for n, t in without_aliases(named_tensors)]
            specs = [TensorSpec(n, dtype_name(t.dtype), list(t.shape)) for n, t in items]
            planned = _with_last(lane.layout(items, alone))
            in_place = True
            del items
        elif window > 1:  # holds the tensors of up to `window` announced buckets
            planned = _with_last(plan_buckets(caster.each(named_tensors), cfg.bucket_bytes,
                                              alone))
        else:  # each tensor is packed into a buffer as soon as it is pulled, and let go
            packer = StreamPacker(caster.each(named_tensors), cfg.bucket_bytes)
        pending: deque[tuple[BucketHeader, Callable[[], torch.Tensor]]] = deque()
        """Announced buckets not yet sent: header, and how to get the wire bytes."""

        def plan_next() -> BucketHeader:
            seq = pending[-1][0].seq + 1 if pending else lane.posted
            if packer is not None:  # packed now, into the buffer it is sent from
                slots, is_last, wire = lane.fill(packer)
                h = BucketHeader(PROTOCOL_VERSION, version, seq, wire.numel(), is_last, slots,
                                 force, staged)
                pending.append((h, lambda: wire))
            else:
                bucket, is_last = next(planned)
                at = lane.at(bucket, seq) if in_place else None
                h = bucket.header(version, seq, is_last, PROTOCOL_VERSION, force, staged, at)
                pending.append((h, lambda: lane.wire(bucket.slots, bucket.sources)))
            return h

        t0 = time.perf_counter()
        failure: BaseException | None = None  # the tensor source's, after a Go
        try:
            with self.transport.armed(cfg.timeout_s, f"update {version}"):
                headers = [plan_next()]
                size = len(msgspec.msgpack.encode(specs)) + len(msgspec.msgpack.encode(headers))
                while (not headers[-1].is_last and (specs or len(headers) < window)
                       and size <= MAX_FRAME_BYTES // 2 and len(headers) < MAX_PLAN_BUCKETS):
                    headers.append(plan_next())  # past the bounds: the rest follows as a stream
                    size += len(msgspec.msgpack.encode(headers[-1]))
                if any(h.at is not None for h in headers):
                    lane.settle()  # what receivers read where it lies is final, and summed
                rounds.open(Plan(PROTOCOL_VERSION, version, specs, full, force, adapter, headers,
                                 staged), headers[-1].seq)
                window = max(window, len(headers))  # a plan too big for one frame: the rest
                # of its headers follow at the same distance
                t0 = time.perf_counter()
                while True:
                    if lane.posted > rounds.agreed:  # a stream's window fell behind the wire
                        rounds.await_go(lane.posted)
                    header, make_wire = pending.popleft()
                    lane.post(header, make_wire)
                    del make_wire
                    if progress:
                        progress(lane.posted, lane.bytes, time.perf_counter() - t0)
                    if header.is_last:
                        break
                    held = failure or lane.failure or lane.lost
                    last = pending[-1][0] if pending else header
                    if not (held or rounds.errors) and len(pending) < window and not last.is_last:
                        try:  # announce one more while this bucket flies
                            nxt = plan_next()
                        except Exception as e:  # noqa: BLE001 - the tensor source failed
                            failure = e
                        else:
                            rounds.tell(nxt)
                    rounds.poll(hold=bool(failure or lane.failure or lane.lost))
                    failed = failure or lane.failure or lane.lost or rounds.errors or \
                        rounds.unreachable
                    if failed and lane.posted > rounds.agreed:
                        break  # every agreed collective is posted: the live ranks are in step
                sums = lane.drain()
                failure = failure or lane.failure
                if failure is not None:
                    raise failure
                lost, left = lane.lost_problem(0)
                if lost or rounds.errors or rounds.unreachable:
                    raise rounds.failure(f"failed at bucket {lane.posted - 1}", left, lost)
                rounds.send_all(Seal(PROTOCOL_VERSION, version, lane.posted,
                                     [sums.get(k, 0) for k in range(lane.posted)]))
                acks = rounds.commit(lane.posted, 1)
                if staged:
                    if verified is not None:
                        verified()
                    rounds.commit(lane.posted, 2)
        except Exception as e:  # a receiver or the tensor source failed: end every wait
            if not isinstance(e, UpdateRefused):  # (a refusal was already answered by Abort)
                rounds.abort(lane.posted, str(e))
            in_step = lane.posted > rounds.agreed  # every collective a Go covers was posted
            if lane.posted and (getattr(e, "missing", []) or not in_step or lane.lost
                                or isinstance(e, PeerFailed)):
                # A collective may be pending that will never complete: give the group up.
                self.transport.abort(f"update {version} failed: {clip(str(e), 300)}")
            err = as_push_error(e, f"update {version} failed at bucket {lane.posted}",
                                "the trainer")
            if err is e:
                raise
            raise err from e
        return PushResult(version, lane.posted, lane.bytes, lane.tensors,
                          time.perf_counter() - t0, list(acks.values()), cast=dict(caster.cast))

    def close(self) -> None:
        if self._peer is not None:
            self._peer.close()
            return
        if self.transport is not None:
            self.transport.close()
        self.channel.close()
