"""Sender: the trainer-side push client (rank 0 of the transfer group).

`PushClient.push` streams `(name, tensor)` pairs (a `state_dict()`, a generator, FSDP full
tensors gathered one at a time) as buckets to every receiver of every engine at once: one
broadcast per bucket feeds them all. Double-buffered: bucket k+1 is planned, announced and packed
while bucket k is on the wire; a buffer is refilled only after the collective that read it.

The receivers see `[Plan] H0 G0 H1 G1 ... Seal Commit [Commit(2)]`: after the last bucket the
sender seals the update (bucket count and every bucket's checksum; on CUDA computed on the GPU
and read once per update) and commits it only when every receiver of every engine acknowledged.
Every wait is bounded; a failure is answered by `Abort` to every live receiver, and a timeout
after a collective was posted aborts the NCCL communicator (the client must then be replaced).

The receivers see `H0 G0 H1 G1 ...`. To keep the control round trip off the link's critical path,
everything that does not need the receivers' answer is done before waiting for it: bucket k+1 is
announced right after the collective of k is queued, and packed (speculatively, into our own
buffer) while the receivers check its header, so `Ready k+1` is answered by `Go k+1` at once.
On CUDA nothing here blocks the host on the GPU: a buffer is refilled after `wait()` on the
collective that last read it, which orders the current stream after it. For a mapping (all
tensors in memory already) a bucket holding one tensor (or one chunk of it) is broadcast straight
from the tensor's memory, without a pack copy. An iterable is consumed by `StreamPacker`: each
tensor is copied into a buffer as soon as it is pulled and let go, so a trainer gathering full
tensors one at a time holds at most one of them beyond the two buffers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from .channel import SenderChannel, clip
from .config import SyncConfig
from .integrity import checksum, checksum_gpu
from .packing import (
    Bucket,
    StreamPacker,
    as_bytes,
    dtype_name,
    pack,
    plan_buckets,
    tensor_nbytes,
)
from .protocol import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    AdapterSpec,
    BucketHeader,
    Commit,
    Error,
    Go,
    Hello,
    Plan,
    Ready,
    Seal,
    Slot,
    TensorSpec,
)
from .transport import Handle, PeerFailed, Transport

log = logging.getLogger(__name__)


class PushError(RuntimeError):
    """An update failed; `errors` holds each failing receiver's message by rank."""

    def __init__(self, message: str, errors: dict[int, str] | None = None,
                 missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or {}
        self.missing = missing or []
        """Ranks that said nothing in time (gone, or stuck)."""


class UpdateRefused(PushError):
    """A receiver refused the plan or a header; every receiver has already been sent `Abort`."""


@dataclass(frozen=True, slots=True)
class PushResult:
    """What one update moved, and every receiver's acknowledgement."""

    version: int
    buckets: int
    bytes: int
    tensors: int
    seconds: float
    acks: list[Ack]

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


Producer = Callable[[int, list], tuple[list[Slot], bool, torch.Tensor]]
"""Makes bucket `seq` (waiting for its buffer's last collective): its slots, whether it is the
last one, and its wire bytes."""

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
    """Binds the control socket and hosts the group's rendezvous; then pushes updates."""

    def __init__(self, cfg: SyncConfig, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.device = device
        self.channel = SenderChannel(cfg.host, cfg.control_port, cfg.secret_bytes)
        self.transport: Transport | None = None
        self.hellos: dict[int, Hello] = {}
        self._buffers: list[torch.Tensor] = []
        self._cksum_stream: torch.cuda.Stream | None = None
        self._cksum_done: list[torch.cuda.Event] = []

    @property
    def ranks(self) -> list[int]:
        return list(range(1, self.cfg.world_size))

    def connect(self) -> dict[int, Hello]:
        """Rendezvous with every receiver (blocks until all joined, at most `timeout_s`)."""
        self.transport = Transport(self.cfg, 0, self.device)
        deadline = time.monotonic() + self.cfg.timeout_s
        while len(self.hellos) < len(self.ranks):
            rank, msg = self.channel.recv(deadline)
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

    def _abort_all(self, version: int, seq: int, reason: str) -> None:
        """Tell every live receiver that update `version` is abandoned (never raises)."""
        lost = self.channel.send_all(self.ranks, Abort(PROTOCOL_VERSION, version, seq,
                                                       clip(reason)))
        if lost:
            log.warning("Abort of update %d did not reach ranks %s", version, lost)

    def _gather(self, kind: type, seq: int, version: int, phase: int = 1) -> dict[int, object]:
        """One message from every receiver for `seq`: all `kind`, or a `PushError` naming who
        failed (`errors`) or said nothing in time (`missing`). Messages of other updates are
        skipped."""
        deadline = time.monotonic() + self.cfg.timeout_s
        self.transport.extend(2 * self.cfg.timeout_s)  # the deadman never beats this wait
        got: dict[int, object] = {}
        errors: dict[int, str] = {}
        while len(got) + len(errors) < len(self.ranks):
            try:
                rank, msg = self.channel.recv(deadline)
            except TimeoutError:
                missing = sorted(set(self.ranks) - set(got) - set(errors))
                text = "; ".join(f"rank {r}: {m}" for r, m in sorted(errors.items()))
                raise PushError(f"update {version}: no {kind.__name__} for bucket {seq} from "
                                f"ranks {missing} within {self.cfg.timeout_s:.1f} s"
                                + (f"; {text}" if text else ""), errors, missing) from None
            if rank not in self.ranks:
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
            prev.wait()
            works[seq % 2] = None
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

    def _planned(self, items: list[tuple[str, torch.Tensor]]) -> Producer:
        """Buckets of tensors that are all in memory already (a mapping): planned, then packed;
        a bucket holding one tensor (or one chunk) is sent straight from its memory."""
        buckets = _with_last(plan_buckets(items, self.cfg.bucket_bytes))

        def produce(seq: int, works: list[Handle | None]) -> tuple[list[Slot], bool, torch.Tensor]:
            bucket, is_last = next(buckets)
            buf = self._free(seq, works)
            if len(bucket.slots) == 1 and bucket.sources[0].device == self.transport.device:
                slot = bucket.slots[0]  # zero copy: the collective reads the tensor's own memory
                wire = as_bytes(bucket.sources[0])[slot.start : slot.start + slot.nbytes]
            else:
                wire = pack(bucket, buf)
            return bucket.slots, is_last, wire

        return produce

    def _streamed(self, items: Iterable[tuple[str, torch.Tensor]]) -> Producer:
        """Buckets of a stream (a generator gathering full tensors one at a time): each tensor is
        copied into a buffer as soon as it is pulled, so at most one is held beyond the buffers."""
        packer = StreamPacker(items, self.cfg.bucket_bytes)

        def produce(seq: int, works: list[Handle | None]) -> tuple[list[Slot], bool, torch.Tensor]:
            buf = self._free(seq, works)
            slots, is_last = packer.fill(buf)
            length = slots[-1].offset + slots[-1].nbytes if slots else 0
            return slots, is_last, buf[:length]

        return produce

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
    ) -> PushResult:
        """Send one complete update; returns once every receiver of every engine committed it.

        A mapping (a `state_dict()`) is announced first as a `Plan` that every receiver checks
        against its model (names, shapes, dtypes; with `full`, that nothing is missing) before
        any byte moves; tied aliases sharing one storage are sent once. An iterable (a generator
        gathering FSDP shards one at a time) is streamed, and each bucket header is checked.
        `dtype` casts floating-point tensors before packing (fp32 master weights to the engine's
        bf16 halves the bytes). Receivers refuse a `version` not newer than the one they hold
        unless `force`. `staged`: receivers load nothing until every bucket of every receiver
        arrived and verified. After the last bucket comes the commit round: receivers stamp the
        version only once all acknowledged. Raises `PushError` if any side failed; every live
        receiver then ends the update the same way (none is left inside a collective: on a
        timeout the NCCL communicator is aborted and this client must be replaced).
        `adapter`: the tensors are this LoRA adapter's (a mapping only); receivers add it or
        replace the weights of the adapter of that name, and version it on its own.
        """
        if self.transport is None:
            raise RuntimeError("call connect() before push()")
        if self.transport.broken:
            raise PushError(f"transfer group is broken ({self.transport.broken}); "
                            "connect a new PushClient")
        check = self.cfg.bucket_checksums is not False
        strict = sorted(r for r, h in self.hellos.items() if h.checksums)
        if strict and not check:
            raise PushError(f"ranks {strict} require bucket checksums; this client has "
                            "bucket_checksums=False")
        cast = (lambda t: t.to(dtype) if t.is_floating_point() else t) if dtype else (lambda t: t)
        plan = None
        if adapter is not None and not isinstance(named_tensors, Mapping):
            raise TypeError("an adapter update takes a mapping of its tensors, not a stream")
        if isinstance(named_tensors, Mapping):
            items = [(n, cast(t)) for n, t in _without_aliases(named_tensors)]
            specs = [TensorSpec(n, dtype_name(t.dtype), list(t.shape)) for n, t in items]
            plan = Plan(PROTOCOL_VERSION, version, specs, full, force, adapter)
            produce = self._planned(items)
        else:
            produce = self._streamed(_each(named_tensors, cast))
        gpu = self.transport.device.type == "cuda"
        t0 = time.perf_counter()
        works: list[Handle | None] = [None, None]
        sums: list = []
        seq, nbytes, ntensors, posted = -1, 0, 0, False

        def header_of(k: int, slots: list[Slot], is_last: bool) -> BucketHeader:
            length = slots[-1].offset + slots[-1].nbytes if slots else 0
            return BucketHeader(PROTOCOL_VERSION, version, k, length, is_last, slots, force, staged)

        try:
            with self.transport.armed(self.cfg.timeout_s, f"update {version}"):
                if plan is not None:
                    self._send_all(plan)
                    self._await_ready(version, -1)
                t0 = time.perf_counter()
                seq = 0
                slots, is_last, wire = produce(0, works)
                header = header_of(0, slots, is_last)
                self._send_all(header)
                while True:
                    # Bucket k+1 is planned and packed (speculatively, into the buffer whose
                    # collective k-1 was posted long ago) while the receivers check header k.
                    nxt = None if header.is_last else produce(seq + 1, works)
                    digest = 0
                    if check and header.length:
                        digest = self._checksum_beside(wire, seq) if gpu else checksum(wire)
                    sums.append(digest)
                    self._await_ready(version, seq)
                    self._send_all(Go(PROTOCOL_VERSION, version, seq, 0 if gpu else digest))
                    # Nothing may fail between Go and queueing the collective it announces.
                    posted = True
                    works[seq % 2] = self.transport.broadcast(wire) if header.length else None
                    done = header
                    if nxt is not None:  # announce k+1 at once: receivers check it while k flies
                        slots, is_last, wire = nxt
                        header = header_of(seq + 1, slots, is_last)
                        self._send_all(header)
                    nbytes += done.length
                    ntensors += sum(
                        s.start + s.nbytes == tensor_nbytes(s.dtype, s.shape) for s in done.slots
                    )
                    if progress:
                        progress(seq + 1, nbytes, time.perf_counter() - t0)
                    if nxt is None:
                        break
                    seq += 1
                for w in works:
                    if w is not None:
                        w.wait()
                if gpu:
                    cur = torch.cuda.current_stream(self.transport.device)
                    cur.wait_stream(self._cksum_stream)
                    self.transport.wait_stream(cur, self.cfg.timeout_s)
                    dev = [d for d in sums if isinstance(d, torch.Tensor)]
                    values = iter(torch.stack(dev).tolist() if dev else [])
                    sums = [next(values) if isinstance(d, torch.Tensor) else d for d in sums]
                self._send_all(Seal(PROTOCOL_VERSION, version, seq + 1, sums))
                acks = self._commit_round(version, seq + 1, 1)
                if staged:
                    self._commit_round(version, seq + 1, 2)
        except Exception as e:  # a receiver or the tensor source failed: end every wait
            if not isinstance(e, UpdateRefused):  # (a refusal was already answered by Abort)
                self._abort_all(version, seq + 1 if posted else seq, str(e))
            missing = getattr(e, "missing", [])
            if posted and (missing or not isinstance(e, PushError)):
                # A collective may be pending that will never complete: give the group up.
                self.transport.abort(f"update {version} failed: {clip(str(e), 300)}")
            if isinstance(e, PushError):
                raise
            if isinstance(e, PeerFailed):
                raise PushError(f"update {version} failed at bucket {seq}: rank {e.rank} left "
                                f"the data plane: {clip(str(e))}", missing=[e.rank]) from e
            raise PushError(f"update {version} failed at bucket {seq} on the trainer: "
                            f"{clip(repr(e))}") from e
        seconds = time.perf_counter() - t0
        return PushResult(version, seq + 1, nbytes, ntensors, seconds, list(acks.values()))

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
        if self.transport is not None:
            self.transport.close()
        self.channel.close()

