"""Sender: the trainer-side push client (rank 0 of the transfer group).

`PushClient.push` streams `(name, tensor)` pairs (a `state_dict()`, a generator, FSDP full
tensors gathered one at a time) as buckets to every receiver of every engine at once: one
broadcast per bucket feeds them all. Double-buffered: bucket k+1 is planned, announced and packed
while bucket k is on the wire; a buffer is refilled only after the collective that read it.

The receivers see `H0 G0 H1 G1 ...`. To keep the control round trip off the link's critical path,
everything that does not need the receivers' answer is done before waiting for it: bucket k+1 is
announced right after the collective of k is queued, and packed (speculatively, into our own
buffer) while the receivers check its header, so `Ready k+1` is answered by `Go k+1` at once.
On CUDA nothing here blocks the host on the GPU: a buffer is refilled after `wait()` on the
collective that last read it, which orders the current stream after it. A bucket holding one
tensor (or one chunk of it) is broadcast straight from the tensor's memory, without a pack copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from .channel import SenderChannel
from .config import SyncConfig
from .integrity import checksum
from .packing import Bucket, as_bytes, dtype_name, pack, plan_buckets, tensor_nbytes
from .protocol import PROTOCOL_VERSION, Abort, Ack, Error, Go, Hello, Plan, Ready, TensorSpec
from .transport import Handle, Transport

log = logging.getLogger(__name__)


class PushError(RuntimeError):
    """An update failed; `errors` holds each failing receiver's message by rank."""

    def __init__(self, message: str, errors: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or {}


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
        return self.hellos

    def _gather(self, kind: type, seq: int) -> dict[int, object]:
        """One message from every receiver for `seq`: all `kind`, or a `PushError` naming who failed."""
        deadline = time.monotonic() + self.cfg.timeout_s
        got: dict[int, object] = {}
        errors: dict[int, str] = {}
        while len(got) + len(errors) < len(self.ranks):
            try:
                rank, msg = self.channel.recv(deadline)
            except TimeoutError:
                missing = sorted(set(self.ranks) - set(got) - set(errors))
                raise PushError(f"no {kind.__name__} for bucket {seq} from ranks {missing}") from None
            if rank not in self.ranks:
                log.warning("ignoring %s from rank %d, which is not in this group",
                            type(msg).__name__, rank)
            elif isinstance(msg, Error):
                errors[rank] = msg.message
            elif isinstance(msg, kind) and getattr(msg, "seq", seq) == seq:
                got[rank] = msg
            else:
                log.warning("ignoring stale %s from rank %d while waiting for %s %d",
                            type(msg).__name__, rank, kind.__name__, seq)
        if errors:
            text = "; ".join(f"rank {r}: {m}" for r, m in sorted(errors.items()))
            raise PushError(f"update failed at bucket {seq}: {text}", errors)
        return got

    def _await_ready(self, version: int, seq: int) -> None:
        """Wait until every receiver accepted the (already sent) plan/header `seq`; on a refusal,
        send `Abort` to all and raise."""
        try:
            self._gather(Ready, seq)
        except PushError as e:
            self.channel.send_all(self.ranks, Abort(PROTOCOL_VERSION, version, seq, str(e)))
            raise UpdateRefused(str(e), e.errors) from None

    def _wire(self, bucket: Bucket, seq: int, works: list[Handle | None]) -> torch.Tensor:
        """The bytes of `bucket` to broadcast: packed into buffer seq%2, or the tensor itself."""
        prev = works[seq % 2]  # the collective that last read this buffer
        if prev is not None:
            prev.wait()  # orders the pack after it on the current stream (no host wait on CUDA)
            works[seq % 2] = None
        if len(bucket.slots) == 1 and bucket.sources[0].device == self.transport.device:
            slot = bucket.slots[0]  # zero copy: NCCL reads the tensor's own (contiguous) memory
            return as_bytes(bucket.sources[0])[slot.start : slot.start + slot.nbytes]
        return pack(bucket, self._buffers[seq % 2])

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
    ) -> PushResult:
        """Send one complete update; returns once every receiver acknowledged it.

        A mapping (a `state_dict()`) is announced first as a `Plan` that every receiver checks
        against its model (names, shapes, dtypes; with `full`, that nothing is missing) before
        any byte moves; tied aliases sharing one storage are sent once. An iterable (a generator
        gathering FSDP shards one at a time) is streamed, and each bucket header is checked.
        `dtype` casts floating-point tensors before packing (fp32 master weights to the engine's
        bf16 halves the bytes). Receivers refuse a `version` not newer than the one they hold
        unless `force`. `staged`: receivers load nothing until every bucket arrived and verified.
        Raises `PushError` if any side failed; every receiver then ends the update the same way
        (none is left inside a collective).
        """
        if self.transport is None:
            raise RuntimeError("call connect() before push()")
        cast = (lambda t: t.to(dtype) if t.is_floating_point() else t) if dtype else (lambda t: t)
        plan = None
        if isinstance(named_tensors, Mapping):
            items = [(n, cast(t)) for n, t in _without_aliases(named_tensors)]
            specs = [TensorSpec(n, dtype_name(t.dtype), list(t.shape)) for n, t in items]
            plan = Plan(PROTOCOL_VERSION, version, specs, full, force)
        else:
            items = ((n, cast(t)) for n, t in named_tensors)
        buckets = _with_last(plan_buckets(items, self.cfg.bucket_bytes))
        check = self.cfg.bucket_checksums
        if check is None:
            check = self.cfg.backend == "gloo"
        if plan is not None:
            self.channel.send_all(self.ranks, plan)
            self._await_ready(version, -1)
        t0 = time.perf_counter()
        works: list[Handle | None] = [None, None]
        seq, nbytes, ntensors = 0, 0, 0
        try:
            bucket, is_last = next(buckets)
            header = bucket.header(version, 0, is_last, PROTOCOL_VERSION, force, staged)
            self.channel.send_all(self.ranks, header)
            wire = self._wire(bucket, 0, works)
            while True:
                nxt = None if is_last else next(buckets)  # planned before Ready: off the path
                digest = checksum(wire) if check and header.length else 0  # while they check
                self._await_ready(version, seq)
                self.channel.send_all(self.ranks, Go(PROTOCOL_VERSION, version, seq, digest))
                # Nothing may fail between Go and queueing the collective it announces.
                works[seq % 2] = self.transport.broadcast(wire) if header.length else None
                done = header
                if nxt is not None:  # announce k+1 at once: receivers check it while k flies
                    bucket, is_last = nxt
                    header = bucket.header(
                        version, seq + 1, is_last, PROTOCOL_VERSION, force, staged
                    )
                    self.channel.send_all(self.ranks, header)
                nbytes += done.length
                ntensors += sum(
                    s.start + s.nbytes == tensor_nbytes(s.dtype, s.shape) for s in done.slots
                )
                if progress:
                    progress(seq + 1, nbytes, time.perf_counter() - t0)
                if nxt is None:
                    break
                seq += 1
                wire = self._wire(bucket, seq, works)  # speculative: unused if it is refused
            for w in works:
                if w is not None:
                    w.wait()
            if self.transport.device.type == "cuda":
                torch.cuda.current_stream(self.transport.device).synchronize()
        except UpdateRefused:
            raise
        except Exception as e:  # the tensor source or packing failed: end every receiver's wait
            self.channel.send_all(self.ranks, Abort(PROTOCOL_VERSION, version, seq, repr(e)))
            raise PushError(f"update {version} failed at bucket {seq} on the trainer: {e!r}") from e
        acks = self._gather(Ack, -1)
        seconds = time.perf_counter() - t0
        bad = [a for a in acks.values() if a.version != version]
        if bad:
            raise PushError(f"receivers acknowledged versions {[a.version for a in bad]}, not {version}")
        return PushResult(version, seq + 1, nbytes, ntensors, seconds, list(acks.values()))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.channel.close()

