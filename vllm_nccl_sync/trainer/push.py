"""Sender: the trainer-side push client (rank 0 of the transfer group).

`PushClient.push` streams `(name, tensor)` pairs (a `state_dict()`, a generator, FSDP full
tensors gathered one at a time) as buckets to every receiver of every engine at once: one
broadcast per bucket feeds them all.

Agreement comes before the data, once: the `Plan` carries every bucket header of a state dict
(the first `window` of a stream), every receiver checks them all and answers once, and one `Go`
covers them. Then the collectives run back to back, double-buffered, with no control round trip
between them: bucket k+1 is packed into the other buffer while bucket k flies, and a buffer is
refilled only after the collective that last read it. A stream announces each next header while
the buckets before it fly, so its `Go`s arrive ahead of the collectives they cover; by default
each tensor is copied into a buffer as soon as it is pulled (`StreamPacker`), so a trainer
gathering full tensors one at a time holds at most one of them beyond the two buffers.

Integrity: on gloo each bucket's checksum is computed while its bytes fly and sent as a `Digest`
right after; on CUDA it is computed on the GPU on a side stream, beside the collective, and all
of them are read once, for the `Seal`. On CUDA nothing here blocks the host on the GPU between
buckets: a buffer is refilled after `wait()` on the collective that last read it, which orders
the current stream after it. A bucket holding one tensor (or one chunk of it) is broadcast
straight from the tensor's memory, without a pack copy.

After the last bucket the sender seals the update and commits it only when every receiver of
every engine acknowledged. Every wait is bounded. Once a `Go` was sent, every collective it covers
is posted, whatever fails (a receiver's `Error`, the tensor source): the group stays in step, and
the failure is answered by `Abort` after the last agreed collective. A timeout after a collective
was posted aborts the NCCL communicator (the client must then be replaced).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import msgspec
import torch

from vllm_nccl_sync.outcomes import PeerFailed, PushError, UpdateRefused, as_push_error
from vllm_nccl_sync.planes.base import Handle, Transport
from vllm_nccl_sync.wire.channel import SenderChannel, clip
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.integrity import checksum, checksum_gpu
from vllm_nccl_sync.wire.packing import (
    Bucket,
    StreamPacker,
    alone_bytes,
    as_bytes,
    dtype_name,
    pack,
    plan_buckets,
    tensor_nbytes,
)
from vllm_nccl_sync.wire.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    AdapterSpec,
    BucketHeader,
    Commit,
    Digest,
    Error,
    Go,
    Hello,
    Plan,
    Ready,
    Seal,
    SenderHello,
    TensorSpec,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PushResult:
    """What one update moved, and every receiver's acknowledgement."""

    version: int
    buckets: int
    bytes: int
    tensors: int
    seconds: float
    acks: list[Ack]
    per_sender: dict[int, int] = field(default_factory=dict)
    """Several senders, on the coordinator: the bytes each sender rank sent (`bytes`: its own)."""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


Progress = Callable[[int, int, float], None]
"""Called after each bucket is sent with (buckets so far, bytes so far, seconds so far)."""


def _without_aliases(tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The mapping's items, minus later names for a tensor already listed (tied weights)."""
    seen: set[tuple] = set()
    for name, t in tensors.items():
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        yield name, t


def _each(items: Iterable[tuple[str, torch.Tensor]],
          cast: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """`items` with `cast` applied, letting each tensor go before the next one is pulled (a
    generator expression would keep the previous one alive while the source makes the next)."""
    for name, t in items:
        t = cast(t)
        yield name, t
        del t


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
        self._peer = None
        if rank > 0:  # another sender: joins the coordinator, pushes only its own buckets
            from vllm_nccl_sync.trainer.multisend import PeerSender

            self._peer = PeerSender(cfg, rank, device)
            return
        self.channel = SenderChannel(cfg.host, cfg.control_port, cfg.secret_bytes)
        self.transport: Transport | None = None
        self.hellos: dict[int, Hello] = {}
        self._buffers: list[torch.Tensor] = []
        self._cksum_stream: torch.cuda.Stream | None = None
        self._cksum_done: list[torch.cuda.Event] = []
        self._lost: list[PeerFailed] = []  # receivers whose data-plane transfer failed (gloo)
        self.peers: set[int] = set()
        """The other senders that joined (several senders only)."""
        self.early: list[tuple[int, object]] = []
        """Other senders' messages that came before the first update (their `Offer`s)."""

    @property
    def ranks(self) -> list[int]:
        """The receivers' ranks."""
        return list(range(self.cfg.num_senders, self.cfg.world_size))

    def connect(self) -> dict[int, Hello]:
        """Rendezvous with every receiver (blocks until all joined, at most `timeout_s`)."""
        if self._peer is not None:
            return self._peer.connect()
        self.transport = Transport(self.cfg.group(0), 0, self.device)
        deadline = time.monotonic() + self.cfg.timeout_s
        while len(self.hellos) < len(self.ranks) or len(self.peers) < self.cfg.num_senders - 1:
            rank, msg = self.channel.recv(deadline)
            if isinstance(msg, SenderHello) and 0 < rank < self.cfg.num_senders:
                if (msg.bucket_bytes, msg.backend) != (self.cfg.bucket_bytes, self.cfg.backend):
                    raise PushError(f"sender {rank} runs bucket_bytes={msg.bucket_bytes} "
                                    f"backend={msg.backend}, the coordinator "
                                    f"{self.cfg.bucket_bytes} {self.cfg.backend}")
                self.peers.add(rank)
                continue
            if rank in self.peers:  # a sender that joined already may offer its first update
                self.early.append((rank, msg))
                continue
            if not isinstance(msg, Hello):
                raise PushError(f"expected Hello from rank {rank}, got {msg!r:.200}")
            if msg.rank != rank or rank not in self.ranks:
                raise PushError(f"Hello from socket rank {rank} claims rank {msg.rank}")
            if (msg.bucket_bytes, msg.backend) != (self.cfg.bucket_bytes, self.cfg.backend):
                raise PushError(
                    f"rank {rank} runs bucket_bytes={msg.bucket_bytes} backend={msg.backend}, "
                    f"the trainer {self.cfg.bucket_bytes} {self.cfg.backend}"
                )
            self.hellos[rank] = msg
        dev = self.transport.device
        self._buffers = [
            torch.empty(self.cfg.bucket_bytes, dtype=torch.uint8, device=dev) for _ in range(2)
        ]
        if dev.type == "cuda":
            self._cksum_stream = torch.cuda.Stream(dev)
            self._cksum_done = [torch.cuda.Event(), torch.cuda.Event()]
        return self.hellos

    def _send_all(self, msg) -> None:
        """Send `msg` to every receiver; a receiver that cannot be reached fails the update."""
        lost = self.channel.send_all(self.ranks, msg)
        if lost:
            raise PushError(f"ranks {lost} cannot be reached (gone?) sending "
                            f"{type(msg).__name__}", missing=lost)

    def _tell(self, msg) -> None:
        """Send `msg` to every receiver mid-update; one that cannot be reached fails the update
        later (`self._lost`), after the live ones got every collective they agreed to."""
        for r in self.channel.send_all(self.ranks, msg):
            self._lost.append(PeerFailed(f"rank {r} cannot be reached (gone?) sending "
                                         f"{type(msg).__name__}", r))

    def _abort_all(self, version: int, seq: int, reason: str) -> None:
        """Tell every live receiver (and other sender) that update `version` is abandoned
        (never raises)."""
        to = self.ranks + sorted(self.peers)  # and every other sender
        lost = self.channel.send_all(to, Abort(PROTOCOL_VERSION, version, seq, clip(reason)))
        if lost:
            log.warning("Abort of update %d did not reach ranks %s", version, lost)

    def _gather(self, kind: type, seq: int, version: int, phase: int = 1,
                ranks: list[int] | None = None) -> dict[int, object]:
        """One message from every receiver (or `ranks`) for `seq`: all `kind`, or a `PushError`
        naming who failed (`errors`) or said nothing in time (`missing`). Messages of other
        updates are skipped."""
        ranks = self.ranks if ranks is None else ranks
        deadline = time.monotonic() + self.cfg.timeout_s
        self.transport.extend(2 * self.cfg.timeout_s)  # the deadman never beats this wait
        got: dict[int, object] = {}
        errors: dict[int, str] = {}
        while len(got) + len(errors) < len(ranks):
            try:
                rank, msg = self.channel.recv(deadline)
            except TimeoutError:
                missing = sorted(set(ranks) - set(got) - set(errors))
                text = "; ".join(f"rank {r}: {m}" for r, m in sorted(errors.items()))
                raise PushError(f"update {version}: no {kind.__name__} for bucket {seq} from "
                                f"ranks {missing} within {self.cfg.timeout_s:.1f} s"
                                + (f"; {text}" if text else ""), errors, missing) from None
            if rank not in ranks:
                log.warning("ignoring %s from rank %d, which is not in this group",
                            type(msg).__name__, rank)
            elif getattr(msg, "version", version) not in (version, -1):
                log.info("ignoring %s of update %s from rank %d during update %d",
                         type(msg).__name__, msg.version, rank, version)
            elif isinstance(msg, Error):  # replaces an earlier answer of that rank
                errors[rank] = clip(msg.message)
                got.pop(rank, None)
            elif (isinstance(msg, kind) and getattr(msg, "seq", seq) == seq
                  and getattr(msg, "phase", phase) == phase and rank not in errors):
                got[rank] = msg
            else:
                log.warning("ignoring stale %s from rank %d while waiting for %s %d",
                            type(msg).__name__, rank, kind.__name__, seq)
        if errors:
            text = "; ".join(f"rank {r}: {m}" for r, m in sorted(errors.items()))
            raise PushError(f"update {version} failed at bucket {seq}: {text}", errors)
        return got

    def _await_ready(self, version: int, seq: int) -> None:
        """Wait until every receiver accepted the (already sent) plan/header `seq`; on a refusal,
        send `Abort` to all and raise."""
        try:
            self._gather(Ready, seq, version)
        except PushError as e:
            self._abort_all(version, seq, str(e))
            raise UpdateRefused(str(e), e.errors, e.missing) from None

    def _free(self, seq: int, works: list[Handle | None]) -> torch.Tensor:
        """Buffer seq%2, once the collective that last read it is done (on CUDA: ordered on the
        current stream, no host wait)."""
        prev = works[seq % 2]
        if prev is not None:
            works[seq % 2] = None
            try:
                prev.wait()
            except PeerFailed as e:  # gloo: the others got their bytes; go on without it
                self._lost.append(e)
            if self._cksum_stream is not None:  # and the checksum that read it
                torch.cuda.current_stream(self.transport.device).wait_event(
                    self._cksum_done[seq % 2])
        return self._buffers[seq % 2]

    def _checksum_beside(self, wire: torch.Tensor, seq: int) -> torch.Tensor:
        """GPU checksum of bucket `seq` on a side stream, beside its collective (both only read
        the bytes), instead of between the pack and the collective."""
        cur = torch.cuda.current_stream(self.transport.device)
        with torch.cuda.stream(self._cksum_stream):
            self._cksum_stream.wait_stream(cur)  # after the pack
            digest = checksum_gpu(wire)
            self._cksum_done[seq % 2].record(self._cksum_stream)
        return digest

    def _wire(self, seq: int, bucket: Bucket, works: list[Handle | None]) -> torch.Tensor:
        """Bucket `seq`'s wire bytes: the tensor's own memory for a bucket of one tensor (or one
        chunk; zero-byte tensors beside it move nothing), else packed into buffer seq%2 once the
        collective that last read it is done."""
        buf = self._free(seq, works)  # at most two collectives in flight
        moving = [(s, t) for s, t in zip(bucket.slots, bucket.sources) if s.nbytes]
        if len(moving) == 1 and moving[0][0].offset == 0 \
                and moving[0][1].device == self.transport.device:
            slot, src = moving[0]  # zero copy: the collective reads the tensor's own memory
            return as_bytes(src)[slot.start : slot.start + slot.nbytes]
        return pack(bucket, buf)

    def _opening(self, version: int, plan: Plan, last: int) -> None:
        """Send the plan; wait until every receiver accepted every header in it; send one `Go`
        for them all. A refusal is answered by `Abort` to all and raised (`UpdateRefused`)."""
        self._send_all(plan)
        self._await_ready(version, last)
        self._send_all(Go(PROTOCOL_VERSION, version, last))

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
    ) -> PushResult:
        """Send one complete update; returns once every receiver of every engine committed it.

        A mapping (a `state_dict()`) is announced first as a `Plan` holding every tensor and
        every bucket header, which every receiver checks against its model (names, shapes,
        dtypes; with `full`, that nothing is missing) before any byte moves; tied aliases sharing
        one storage are sent once. An iterable (a generator gathering FSDP shards one at a time)
        is streamed: each tensor is copied into a bucket buffer as soon as it is pulled (at most
        one full tensor is held beyond the two buffers), and each bucket's header is announced
        (and agreed) while the bucket before it flies; `window` > 1 announces that many buckets
        ahead of the wire instead, holding their tensors until they are sent. `dtype` casts floating-point tensors before packing (fp32 master weights to
        the engine's bf16 halves the bytes). Receivers refuse a `version` not newer than the one
        they hold unless `force`. `staged`: receivers load nothing until every bucket of every
        receiver arrived and verified. After the last bucket comes the commit round: receivers
        stamp the version only once all acknowledged. Raises `PushError` if any side failed;
        every live receiver then ends the update the same way (none is left inside a collective:
        on a timeout the NCCL communicator is aborted and this client must be replaced).
        `adapter`: the tensors are this LoRA adapter's (a mapping only); receivers add it or
        replace the weights of the adapter of that name, and version it on its own.

        Several senders: every sender rank calls `push` with the same `version` and flags and a
        mapping of the tensors it owns; with `balance`, of every tensor it can produce, and the
        coordinator gives each tensor one owner, balancing bytes (`owners.plan_owners`). Each
        rank returns the same outcome (its own `bytes`; `per_sender` on the coordinator) or
        raises `PushError` with the reason.
        """
        if self.cfg.num_senders > 1 and (adapter is not None or window != 1):
            raise ValueError("several senders send base weights as a state dict: no adapter, "
                             "no window")
        if self._peer is not None:
            return self._peer.push(named_tensors, version, dtype=dtype, force=force, full=full,
                                   staged=staged, balance=balance)
        if self.cfg.num_senders > 1:
            from vllm_nccl_sync.trainer.multisend import coordinate

            if self.transport is None:
                raise RuntimeError("call connect() before push()")
            return coordinate(self, named_tensors, version, dtype=dtype, force=force, full=full,
                              staged=staged, balance=balance, progress=progress)
        if balance:
            raise ValueError("balance takes several senders (SyncConfig.senders)")
        if self.transport is None:
            raise RuntimeError("call connect() before push()")
        if self.transport.broken:
            raise PushError(f"transfer group is broken ({self.transport.broken}); "
                            "connect a new PushClient")
        if window < 1:
            raise ValueError(f"window {window} must be at least 1")
        check = self.cfg.bucket_checksums is not False
        strict = sorted(r for r, h in self.hellos.items() if h.checksums)
        if strict and not check:
            raise PushError(f"ranks {strict} require bucket checksums; this client has "
                            "bucket_checksums=False")
        cast = (lambda t: t.to(dtype) if t.is_floating_point() else t) if dtype else (lambda t: t)
        if adapter is not None and not isinstance(named_tensors, Mapping):
            raise TypeError("an adapter update takes a mapping of its tensors, not a stream")
        specs: list[TensorSpec] = []
        packer = None
        alone = alone_bytes(self.cfg.bucket_bytes, self.cfg.backend)
        if isinstance(named_tensors, Mapping):
            items = [(n, cast(t)) for n, t in _without_aliases(named_tensors)]
            specs = [TensorSpec(n, dtype_name(t.dtype), list(t.shape)) for n, t in items]
            planned = _with_last(plan_buckets(items, self.cfg.bucket_bytes, alone))
            del items
        elif window > 1:  # holds the tensors of up to `window` announced buckets
            planned = _with_last(plan_buckets(_each(named_tensors, cast), self.cfg.bucket_bytes,
                                              alone))
        else:  # each tensor is copied into a buffer as soon as it is pulled, and let go (so
            # none is sent from its own memory: buckets stay full)
            packer = StreamPacker(_each(named_tensors, cast), self.cfg.bucket_bytes)
        gpu = self.transport.device.type == "cuda"
        pending: deque[tuple[BucketHeader, Callable[[], torch.Tensor]]] = deque()
        """Announced buckets not yet sent: header, and how to get the wire bytes."""

        def plan_next() -> BucketHeader:
            seq = pending[-1][0].seq + 1 if pending else sent
            if packer is not None:  # packed now, into the buffer it is sent from
                buf = self._free(seq, works)
                slots, is_last = packer.fill(buf)
                length = slots[-1].offset + slots[-1].nbytes if slots else 0
                h = BucketHeader(PROTOCOL_VERSION, version, seq, length, is_last, slots, force,
                                 staged)
                wire = buf[:length]
                pending.append((h, lambda: wire))
            else:
                bucket, is_last = next(planned)
                h = bucket.header(version, seq, is_last, PROTOCOL_VERSION, force, staged)
                pending.append((h, lambda: self._wire(seq, bucket, works)))
            return h

        t0 = time.perf_counter()
        works: list[Handle | None] = [None, None]
        sums: list = []
        sent, nbytes, ntensors, posted = 0, 0, 0, False
        agreed = -1  # the highest bucket a Go covers
        ready = dict.fromkeys(self.ranks, -1)  # each receiver's highest Ready
        errors: dict[int, str] = {}
        failure: BaseException | None = None  # the trainer's own failure after a Go
        self._lost = []
        try:
            with self.transport.armed(self.cfg.timeout_s, f"update {version}"):
                headers = [plan_next()]
                limit = MAX_FRAME_BYTES // 2
                size = len(msgspec.msgpack.encode(specs)) + len(msgspec.msgpack.encode(headers))
                while not headers[-1].is_last and (specs or len(headers) < window):
                    h = plan_next()
                    size += len(msgspec.msgpack.encode(h))
                    headers.append(h)
                    if size > limit:  # the rest of a huge plan follows as a stream
                        break
                self._opening(version, Plan(PROTOCOL_VERSION, version, specs, full, force,
                                            adapter, headers, staged), headers[-1].seq)
                agreed = headers[-1].seq
                ready = dict.fromkeys(self.ranks, agreed)
                window = max(window, len(headers))  # a plan too big for one frame: the rest
                # of its headers follow at the same distance
                t0 = time.perf_counter()
                while True:
                    if sent > agreed:  # a stream's window fell behind the wire: wait for it
                        agreed = self._await_go(version, sent, ready, errors)
                    header, make_wire = pending.popleft()
                    try:
                        wire = make_wire()
                    except Exception as e:  # noqa: BLE001 - agreed: the collective still runs
                        failure = failure or e
                        wire = self._free(sent, works)[: header.length]
                    del make_wire
                    posted = True
                    works[sent % 2] = self.transport.broadcast(wire) if header.length else None
                    digest = 0
                    if check and header.length:
                        digest = self._checksum_beside(wire, sent) if gpu else checksum(wire)
                    sums.append(digest)
                    if not gpu and header.length:
                        self._tell(Digest(PROTOCOL_VERSION, version, sent, digest))
                    del wire
                    self.transport.extend(self.cfg.timeout_s)  # progress: restart the deadman
                    nbytes += header.length
                    ntensors += sum(s.start + s.nbytes == tensor_nbytes(s.dtype, s.shape)
                                    for s in header.slots)
                    if progress:
                        progress(sent + 1, nbytes, time.perf_counter() - t0)
                    sent += 1
                    if header.is_last:
                        break
                    if failure is None and not errors and len(pending) < window:
                        last = pending[-1][0] if pending else header
                        if not last.is_last:  # announce one more while this bucket flies
                            try:
                                nxt = plan_next()
                            except Exception as e:  # noqa: BLE001 - the tensor source failed
                                failure = e
                            else:
                                self._tell(nxt)
                    agreed = self._poll(version, ready, errors, agreed)
                    if (failure is not None or errors or self._lost) and sent > agreed:
                        break  # every agreed collective is posted: the live ranks are in step
                for i in range(2):
                    self._free(i, works)
                failure = failure or (self._lost[0] if self._lost else None)
                if failure is not None or errors:
                    if failure is not None:
                        raise failure
                    text = "; ".join(f"rank {r}: {m}" for r, m in sorted(errors.items()))
                    raise PushError(f"update {version} failed at bucket {sent - 1}: {text}",
                                    errors)
                if gpu:
                    cur = torch.cuda.current_stream(self.transport.device)
                    cur.wait_stream(self._cksum_stream)
                    self.transport.wait_stream(cur, self.cfg.timeout_s)
                    dev = [d for d in sums if isinstance(d, torch.Tensor)]
                    values = iter(torch.stack(dev).tolist() if dev else [])
                    sums = [next(values) if isinstance(d, torch.Tensor) else d for d in sums]
                self._send_all(Seal(PROTOCOL_VERSION, version, sent, sums))
                acks = self._commit_round(version, sent, 1)
                if staged:
                    self._commit_round(version, sent, 2)
        except Exception as e:  # a receiver or the tensor source failed: end every wait
            if not isinstance(e, UpdateRefused):  # (a refusal was already answered by Abort)
                self._abort_all(version, sent, str(e))
            missing = getattr(e, "missing", [])
            in_step = sent > agreed  # every collective a Go covers was posted
            if posted and (missing or not in_step or isinstance(e, PeerFailed) or self._lost):
                # A collective may be pending that will never complete: give the group up.
                self.transport.abort(f"update {version} failed: {clip(str(e), 300)}")
            err = as_push_error(e, f"update {version} failed at bucket {sent}", "the trainer")
            if err is e:
                raise
            raise err from e
        seconds = time.perf_counter() - t0
        return PushResult(version, sent, nbytes, ntensors, seconds, list(acks.values()))

    def _poll(self, version: int, ready: dict[int, int], errors: dict[int, str],
              agreed: int, deadline: float | None = None) -> int:
        """Take the receivers' answers queued so far (until `deadline`: wait for one at least);
        send `Go` for what all of them accepted. Returns the bucket the last `Go` covers."""
        while True:
            try:
                rank, msg = self.channel.recv(deadline or time.monotonic())
            except TimeoutError:
                break
            if rank not in self.ranks or getattr(msg, "version", version) not in (version, -1):
                log.info("ignoring %s from rank %d during update %d", type(msg).__name__, rank,
                         version)
            elif isinstance(msg, Error):
                errors[rank] = clip(msg.message)
            elif isinstance(msg, Ready) and msg.seq > ready[rank]:
                ready[rank] = msg.seq
            else:
                log.warning("ignoring %s from rank %d mid-update", type(msg).__name__, rank)
            if deadline is not None:
                break
        if not errors and not self._lost and min(ready.values()) > agreed:
            agreed = min(ready.values())
            self._tell(Go(PROTOCOL_VERSION, version, agreed))
        return agreed

    def _await_go(self, version: int, seq: int, ready: dict[int, int],
                  errors: dict[int, str]) -> int:
        """Wait (bounded) until every receiver accepted header `seq`, and send its `Go`."""
        deadline = time.monotonic() + self.cfg.timeout_s
        self.transport.extend(2 * self.cfg.timeout_s)
        agreed = seq - 1
        while agreed < seq:
            if self._lost:
                raise self._lost[0]
            if errors:
                text = "; ".join(f"rank {r}: {m}" for r, m in sorted(errors.items()))
                raise PushError(f"update {version} failed at bucket {seq}: {text}", errors)
            if time.monotonic() > deadline:
                missing = sorted(r for r, k in ready.items() if k < seq)
                raise PushError(f"update {version}: no Ready for bucket {seq} from ranks "
                                f"{missing} within {self.cfg.timeout_s:.1f} s", missing=missing)
            agreed = self._poll(version, ready, errors, agreed, deadline)
        return agreed

    def _commit_round(self, version: int, buckets: int, phase: int) -> dict[int, Ack]:
        """Gather every receiver's `Ack(phase)`, then tell them all to `Commit(phase)`."""
        acks = self._gather(Ack, -1, version, phase)
        bad = sorted(r for r, a in acks.items() if a.version != version or a.buckets != buckets)
        if bad:
            raise PushError(f"update {version}: ranks {bad} acknowledged another version or "
                            f"bucket count")
        self._send_all(Commit(PROTOCOL_VERSION, version, phase))
        return acks

    def close(self) -> None:
        if self._peer is not None:
            self._peer.close()
            return
        if self.transport is not None:
            self.transport.close()
        self.channel.close()

