"""Receiver: one worker's side of an update (engine-agnostic; the vLLM glue lives in `ext`).

The update opens with the sender's `Plan`: every bucket header of a state dict (the first window of
a stream) is checked against the buffer and the model at once and answered with one `Ready`; one
`Go` covers them all. Then the buckets arrive back to back: exactly `length` bytes by broadcast
into one of two preallocated buffers, bucket k+1 posted before bucket k is checked and handed to
a `WeightLoader`. A stream's later headers are answered as they come, between buckets. After the
last bucket comes the commit round (see `protocol`): the sender's `Seal` lists every bucket's
checksum, the receiver answers `Ack` once everything arrived and verified, and stamps the version
only on `Commit`.

This receiver decides integrity, not the sender: with `require_checksums` (the default; turned off
only on the engine side, `VLLM_NCCL_SYNC_REQUIRE_CHECKSUMS=0`), a bucket that no checksum covers is
refused. On gloo the checksum of bucket k comes in a `Digest` right after its collective and is
checked before loading; on CUDA the receiver computes each bucket's checksum on the GPU and
compares them all once, at the `Seal`.

CUDA ordering: the host only queues work. Collectives are issued from a side stream that waits
only for the loads that last read the buffer; loads run on a second side stream that waits for
the collective; nothing between buckets waits on the host. vLLM's own stream never waits on a
collective: before `receive` returns, the load stream is polled to completion within the
deadline, and a collective that will not finish gets its communicator aborted
(`Transport.armed`), so a dead trainer can never hang the engine or reach its compute stream.

A receiver that fails tells the sender at once (`Error`) and keeps taking part in every
collective a `Go` covers; the sender then aborts every rank the same way after the last of them.
A worker whose weights may differ from what its peers hold under the stamped version reports
`consistent: False` until the next complete update.

Several senders (`SyncConfig.senders`): the receiver joins one data-plane group per sender and
takes bucket k from the group its header's `src` names; everything else is as above (see
`multisend`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from vllm_nccl_sync.engine.handshake import Reference
from vllm_nccl_sync.engine.metrics import observe_update
from vllm_nccl_sync.outcomes import UpdateFailed
from vllm_nccl_sync.planes.base import Transport
from vllm_nccl_sync.wire.channel import ReceiverChannel, clip
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.integrity import checksum, checksum_gpu
from vllm_nccl_sync.wire.packing import Reassembler, validate_header
from vllm_nccl_sync.wire.protocol import (
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
    ProtocolError,
    Ready,
    Seal,
    TensorSpec,
)

log = logging.getLogger(__name__)

_CANARY = 8
"""Bytes past `length` that a gloo receiver fills with random bytes and checks afterwards."""


class WeightLoader(Protocol):
    """Where received tensors go. `load` must not keep references to the tensors it is given.

    A loader may also offer `load_rows(name, rows, first_row, shape) -> bool` (see
    `packing.RowLoader`): then the chunks of a tensor larger than a bucket are loaded as they
    arrive, rows of dim 0 at a time, instead of being reassembled in a staging copy first; it
    answers False at a tensor's first chunk when that tensor cannot be loaded piecewise.
    """

    def begin(self) -> None: ...

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> set[str]: ...

    def finish(self) -> None: ...

    def abort(self) -> None: ...


def require_checksums_default() -> bool:
    """The engine-side policy: `VLLM_NCCL_SYNC_REQUIRE_CHECKSUMS` ("1" unless set to "0")."""
    return os.environ.get("VLLM_NCCL_SYNC_REQUIRE_CHECKSUMS", "1") != "0"


@dataclass(slots=True)
class ReceiverState:
    """What this worker holds and has done; reported by `nccl_sync_state`."""

    version: int = -1
    """Version of the last committed update (-1: the weights the engine started with)."""
    consistent: bool = True
    """False once an update failed after data may have been loaded anywhere: this worker (or a
    peer) may hold tensors of another version than `version`."""
    updates: int = 0
    failures: int = 0
    bytes: int = 0
    last_seconds: float = 0.0
    last_error: str = ""
    history: list[dict] = field(default_factory=list)
    adapters: dict[str, int] = field(default_factory=dict)
    """Version of the last committed update of each LoRA adapter, by adapter name."""


@dataclass(slots=True)
class _Update:
    """Book-keeping of the update in progress."""

    version: int = -1
    staged: bool = False
    seq: int = 0
    """The bucket being received."""
    headers: dict[int, BucketHeader] = field(default_factory=dict)
    """Accepted headers of buckets not yet received."""
    accepted: int = -1
    """The highest header accepted (answered `Ready`)."""
    refused: int = -2
    """The header this receiver refused (answered `Error`); -2: none."""
    agreed: int = -1
    """The highest bucket a `Go` covers."""
    last: int = -1
    """Seq of the header marked `is_last` once accepted (-1: not yet)."""
    posted: dict[int, Any] = field(default_factory=dict)
    """Per posted bucket: (handle, canary); removed once arrived."""
    digests: dict[int, int] = field(default_factory=dict)
    """gloo: the sender's `Digest` of each bucket."""
    told: bool = False
    """The sender was sent an `Error` for this update."""
    reference: Reference | None = None
    plan_tensors: dict[str, TensorSpec] = field(default_factory=dict)
    nbytes: int = 0
    ntensors: int = 0
    failed: str | None = None
    began: bool = False
    exposed: bool = False
    """Data of this update may have been loaded by some worker: a failure now leaves it mixed."""
    in_step: bool = True
    """Every collective this receiver agreed to was joined (the group stays usable)."""
    sums: list[Any] = field(default_factory=list)
    """Per bucket: the checksum of what arrived (int on CPU, a 0-d GPU tensor on CUDA)."""
    staged_tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    adapter: AdapterSpec | None = None
    """The LoRA adapter this update targets (None: base weights)."""
    t0: float = 0.0


class Receiver:
    """Joins the transfer group as `rank` and receives updates into a `WeightLoader`."""

    def __init__(
        self,
        cfg: SyncConfig,
        rank: int,
        *,
        replica: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        device: torch.device | None = None,
        reference: Reference | None = None,
        state: ReceiverState | None = None,
        require_checksums: bool | None = None,
        adapters: Callable[[AdapterSpec], WeightLoader] | None = None,
    ) -> None:
        """Join as `rank`; `reference` (the engine's tensors) lets plans and headers be checked
        against the model before any byte moves; `state` carries what the worker holds across
        re-joins (a re-joined worker must not forget that its weights are inconsistent);
        `require_checksums` (default: `require_checksums_default()`) refuses unchecked buckets;
        `adapters` gives the loader of an update whose plan targets a LoRA adapter (None: such
        updates are refused)."""
        if rank < cfg.num_senders:
            raise ValueError(f"ranks 0..{cfg.num_senders - 1} are the senders")
        self.cfg = cfg
        self.rank = rank
        self.reference = reference
        self.adapters = adapters
        self.require_checksums = (require_checksums_default() if require_checksums is None
                                  else require_checksums)
        self._broken = ""  # a failure that left this receiver out of step with the group
        self._version = -1  # the update in progress (for the versions of our Errors)
        # The trainer waits `timeout_s` for the slowest receiver, then sends its verdict (Go,
        # Commit or Abort): receivers wait a little longer for it, so a dead peer is named by the
        # trainer and every live receiver hears the same verdict instead of racing it.
        self._verdict_s = cfg.timeout_s + max(1.0, 0.1 * cfg.timeout_s)
        self.state = state if state is not None else ReceiverState()
        self.channel = ReceiverChannel(cfg.host, cfg.control_port, rank, cfg.secret_bytes)
        self.channel.send(Hello(PROTOCOL_VERSION, rank, replica, tp_rank, tp_size,
                                cfg.bucket_bytes, cfg.backend, self.require_checksums),
                          cfg.timeout_s)
        # One data-plane group per sender: {sender s} + every receiver (one sender: the config's).
        group_rank = rank - cfg.num_senders + 1
        self.transports = [Transport(cfg.group(s), group_rank, device)
                           for s in range(cfg.num_senders)]
        self.transport = self.transports[0]
        dev = self.transport.device
        self.buffers = [torch.empty(cfg.bucket_bytes, dtype=torch.uint8, device=dev) for _ in range(2)]
        self._cuda = dev.type == "cuda"
        if self._cuda:
            self._issue_stream = torch.cuda.Stream(dev)
            self._load_stream = torch.cuda.Stream(dev)
            self._cksum_stream = torch.cuda.Stream(dev)
            self._free = [torch.cuda.Event(), torch.cuda.Event()]
            self._cksum_done = [torch.cuda.Event(), torch.cuda.Event()]

    @property
    def broken(self) -> str:
        """Why the data-plane group can no longer be trusted ("" while healthy)."""
        return next((t.broken for t in self.transports if t.broken), "") or self._broken

    # ------------------------------------------------------------------ control-plane helpers

    def _error(self, seq: int, message: str, tb: str = "") -> None:
        """Tell the sender (bounded: a dead or unreachable sender must not block us)."""
        try:
            self.channel.send(Error(PROTOCOL_VERSION, self.rank, seq, clip(message),
                                    tb or traceback.format_exc(), self._version),
                              min(self.cfg.timeout_s, 5.0))
        except (TimeoutError, OSError, ValueError) as e:
            log.warning("rank %d could not report its error to the trainer: %s", self.rank, e)

    def _recv(self, deadline: float):
        msg = self.channel.recv(max(deadline - time.monotonic(), 0.0), fail_on_drop=True)
        self._extend()  # progress: the deadman restarts its count
        return msg

    def _extend(self) -> None:
        for t in self.transports:
            t.extend(self._verdict_s)

    def _abort(self, reason: str) -> None:
        for t in self.transports:
            t.abort(reason)

    def _fail(self, u: _Update, text: str, seq: int | None = None) -> None:
        """Record the first failure of `u` and tell the sender at once (once per update), so it
        stops announcing buckets; every collective a `Go` covers is still joined."""
        if u.failed is None:
            u.failed = text
        if not u.told:
            u.told = True
            self._error(u.seq if seq is None else seq, u.failed, " ")

    def _violation(self, u: _Update, text: str) -> UpdateFailed:
        """A message that breaks the protocol: tell the sender (it may be waiting for us)."""
        self._error(u.seq, f"rank {self.rank}: {text}")
        u.told = True
        return UpdateFailed(text)

    def _header_problem(self, header: BucketHeader, seq: int, u: _Update) -> str:
        """Why this receiver refuses header `seq` ("" if it accepts it)."""
        if header.version != u.version:
            return f"header of update {header.version} in update {u.version}"
        if header.staged != u.staged:
            return f"rank {self.rank} rejected bucket {seq}: staged flag differs from the plan's"
        if u.last >= 0:
            return f"rank {self.rank} rejected bucket {seq}: it follows the last bucket {u.last}"
        if not 0 <= header.src < self.cfg.num_senders:
            return (f"rank {self.rank} rejected bucket {seq}: sender {header.src} is not one of "
                    f"the {self.cfg.num_senders} sender(s)")
        try:
            validate_header(header, seq, self.cfg.bucket_bytes)
        except ValueError as e:
            return f"rank {self.rank} rejected bucket {seq}: {clip(str(e))}"
        specs = [TensorSpec(x.name, x.dtype, x.shape) for x in header.slots]
        problems = []
        if u.plan_tensors:
            problems = [f"tensor {x.name!r} ({x.dtype} {x.shape}) is not the plan's"
                        for x in specs if u.plan_tensors.get(x.name) != x]
        if not problems and u.reference is not None:
            problems = u.reference.problems(specs)
        if problems:
            return f"rank {self.rank} rejected bucket {seq}: " + clip("; ".join(problems[:5]))
        return ""

    def _accept(self, header: BucketHeader, u: _Update) -> str:
        """Check the next header; on success remember it, else record the refusal."""
        seq = u.accepted + 1
        problem = u.failed or self._header_problem(header, seq, u)
        if problem:
            if u.refused < 0:
                u.refused = header.seq
            if u.failed is None:
                u.failed = problem
            return problem
        u.headers[seq] = header
        u.accepted = seq
        if header.is_last:
            u.last = seq
        return ""

    def _pump(self, u: _Update, want: Callable[[], bool], what: str) -> None:
        """Handle the sender's messages until `want()` holds: a stream's headers (answered),
        `Go`s, `Digest`s. An `Abort` of this update, or anything else, ends it (`UpdateFailed`).
        Each wait is bounded by the verdict timeout."""
        while not want():
            msg = self._recv(time.monotonic() + self._verdict_s)
            if getattr(msg, "version", u.version) != u.version:
                log.info("skipping a %s of update %s during update %d", type(msg).__name__,
                         msg.version, u.version)
                continue
            if isinstance(msg, Abort):
                if any(k >= msg.seq for k in u.posted):
                    u.in_step = False  # we wait in a collective the sender never posts
                raise UpdateFailed(f"sender aborted update {u.version} at bucket {msg.seq}: "
                                   f"{clip(msg.reason)}")
            if isinstance(msg, BucketHeader) and u.failed is None and u.last < 0:
                problem = self._accept(msg, u)
                if problem:
                    self._fail(u, problem, msg.seq)
                else:
                    self.channel.send(Ready(PROTOCOL_VERSION, self.rank, msg.seq, u.version),
                                      self.cfg.timeout_s)
            elif isinstance(msg, BucketHeader) and u.failed is not None and u.last < 0:
                if u.refused < 0:  # failed already: not answered, never joined
                    u.refused = msg.seq
            elif isinstance(msg, Go) and u.agreed < msg.seq <= u.accepted:
                u.agreed = msg.seq
                if not u.staged:
                    u.exposed = True  # in place: from now on some worker may load this update
            elif isinstance(msg, Go) and u.refused >= 0 and msg.seq >= u.refused:
                u.in_step = False
                raise UpdateFailed(f"sender sent Go for bucket {msg.seq}, refused: {u.failed}")
            elif (isinstance(msg, Digest) and not self._cuda and msg.seq not in u.digests
                  and msg.seq <= u.agreed and msg.seq >= u.seq):
                u.digests[msg.seq] = msg.checksum
            else:
                raise self._violation(u, f"expected {what}, got {clip(repr(msg), 200)}")

    def _first(self, timeout_s: float, u: _Update) -> Plan:
        """The update's opening: the `Plan` with its first headers, answered here.

        Leftovers of an earlier update are skipped. A refused plan still waits for the sender's
        `Abort`, so both sides end the update the same way.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self.channel.recv(max(deadline - time.monotonic(), 0.0))
            except ProtocolError as e:  # junk left from before this update: not its concern
                log.warning("rank %d skipping an undecodable frame before the update: %s",
                            self.rank, clip(str(e), 200))
                continue
            if isinstance(msg, Plan):
                break
            log.info("skipping a stale %s before the next update", type(msg).__name__)
        plan = msg
        self._version = u.version = plan.version
        u.staged = plan.staged
        problem = self._plan_problem(plan)
        if not problem:
            if plan.adapter is None:
                u.reference = self.reference
                u.plan_tensors = {t.name: t for t in plan.tensors}
            if not plan.buckets:
                problem = f"rank {self.rank} refused update {plan.version}: a plan without buckets"
            for h in plan.buckets:
                if h.force != plan.force:
                    problem = (f"rank {self.rank} rejected bucket {h.seq}: force flag differs "
                               "from the plan's")
                problem = problem or self._accept(h, u)
                if problem:
                    break
        if problem:
            self._error(-1, problem, " ")
            u.told, u.failed, u.refused = True, problem, 0
            # The sender answers a refusal with Abort: end in step with it (a Go instead means
            # it posts collectives this receiver never joins: out of step).
            self._pump(u, lambda: False, "Abort")
        self.channel.send(Ready(PROTOCOL_VERSION, self.rank, u.accepted, plan.version),
                          self.cfg.timeout_s)
        return plan

    def _held(self, adapter: AdapterSpec | None) -> int:
        """The version this worker holds of the update's target (base weights or an adapter)."""
        if adapter is None:
            return self.state.version
        return self.state.adapters.get(adapter.name, -1)

    def _plan_problem(self, plan: Plan) -> str:
        """Why this receiver refuses `plan` ("" if it accepts it)."""
        what = "" if plan.adapter is None else f" of adapter {plan.adapter.name!r}"
        held = self._held(plan.adapter)
        if plan.version <= held and not plan.force:
            return (f"rank {self.rank} refused update {plan.version}{what}: it holds version "
                    f"{held} (push with force=True to go back)")
        if plan.adapter is not None:
            if self.adapters is None:
                return (f"rank {self.rank} refused adapter {plan.adapter.name!r}: this engine "
                        "takes no LoRA adapters (start it with enable_lora=True)")
            return ""  # the adapter loader checks names and shapes in `begin`
        if self.reference is None:
            return ""
        problems = self.reference.problems(plan.tensors, plan.full)
        if not problems:
            return ""
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        return clip(f"rank {self.rank} refused update {plan.version}: "
                    + "; ".join(problems[:5]) + more)

    # ------------------------------------------------------------------ data plane

    def _post(self, header: BucketHeader, seq: int, u: _Update) -> Any:
        """Post the collective filling buffer seq%2 (gloo: the whole buffer, with a canary past
        `length`, so a longer broadcast is caught instead of aborting the process)."""
        i, length = seq % 2, header.length
        buf = self.buffers[i]
        if not self._cuda:
            room = min(_CANARY, buf.numel() - length)
            canary = torch.frombuffer(bytearray(os.urandom(room)), dtype=torch.uint8) if room else None
            if canary is not None:
                buf[length : length + room].copy_(canary)
            return self.transports[header.src].broadcast(buf, length=length), canary
        with torch.cuda.stream(self._issue_stream):
            self._issue_stream.wait_event(self._free[i])
            return self.transports[header.src].broadcast(buf[:length]), None

    def _start(self, seq: int, u: _Update) -> None:
        """Post bucket `seq`'s collective once its header is accepted and a `Go` covers it."""
        self._pump(u, lambda: u.agreed >= seq, f"Go for bucket {seq}")
        header = u.headers[seq]
        if header.length:
            u.posted[seq] = self._post(header, seq, u)

    def _arrived(self, seq: int, u: _Update) -> None:
        """Wait for bucket `seq`'s bytes (CPU: on the host; CUDA: on the load stream) and check
        what can be checked now (CPU: canary and the sender's `Digest`, before any load)."""
        header = u.headers[seq]
        if seq not in u.posted:
            u.sums.append(None)
            return
        work, canary = u.posted.pop(seq)
        buf = self.buffers[seq % 2]
        try:
            work.wait()
        except RuntimeError as e:
            u.in_step = False
            self._broken = (f"collective of bucket {seq} from sender {header.src} failed: "
                            f"{clip(str(e))}")
            raise RuntimeError(self._broken) from e
        u.nbytes += header.length
        if self._cuda:  # beside the loads, on its own stream; the buffer waits for both
            with torch.cuda.stream(self._cksum_stream):
                work.wait()
                u.sums.append(checksum_gpu(buf[: header.length]))
                self._cksum_done[seq % 2].record(self._cksum_stream)
            return
        length = header.length
        got = checksum(buf[:length])  # while the sender's Digest (and bucket k+1) fly
        u.sums.append(got)
        self._pump(u, lambda: seq in u.digests, f"Digest for bucket {seq}")
        theirs = u.digests.pop(seq)
        if canary is not None and not torch.equal(buf[length : length + canary.numel()], canary):
            self._fail(u, f"rank {self.rank}: bucket {seq} broadcast more bytes than its "
                          f"header's length {length}; not loaded")
        elif not theirs and self.require_checksums:
            self._fail(u, f"rank {self.rank}: Digest for bucket {seq} carries no checksum, and "
                          "this receiver requires one (VLLM_NCCL_SYNC_REQUIRE_CHECKSUMS); "
                          "not loaded")
        elif theirs and got != theirs:
            self._fail(u, f"rank {self.rank}: bucket {seq} arrived corrupted or short (checksum "
                          f"{got:#x} != sender's {theirs:#x}); not loaded")

    def _load(self, seq: int, loader: WeightLoader, re: Reassembler, u: _Update) -> None:
        """Hand bucket `seq`'s tensors to the loader (or keep clones of them when staged)."""
        if u.failed is not None:
            return
        header = u.headers[seq]
        try:
            if not u.began and not u.staged:  # rows may go to the loader while unpacking
                loader.begin()
                u.began = True
            by_rows = re.loaded_by_rows
            named = re.unpack(header, self.buffers[seq % 2])
            u.ntensors += len(named) + re.loaded_by_rows - by_rows
            if u.staged:
                u.staged_tensors += [(n, t.clone()) for n, t in named]
                if header.is_last:
                    re.finish()
                return
            if named or header.is_last:
                loader.load(named)
            if header.is_last:
                re.finish()
        except Exception as e:  # the loader is user/vLLM code: report, don't crash
            self._fail(u, f"rank {self.rank} failed loading bucket {seq}: {clip(repr(e))}")
            log.exception("loading bucket %d failed", seq)

    def _expect_seal(self, u: _Update) -> Seal:
        """The sender's `Seal` of this update (an `Abort` ends it; anything else is an error)."""
        deadline = time.monotonic() + self._verdict_s
        while True:
            msg = self._recv(deadline)
            if getattr(msg, "version", u.version) != u.version:
                continue
            if isinstance(msg, Seal):
                return msg
            if isinstance(msg, Abort):
                raise UpdateFailed(f"sender aborted update {u.version} at bucket {msg.seq}: "
                                   f"{clip(msg.reason)}")
            raise self._violation(u, f"expected Seal after bucket {u.seq}, "
                                     f"got {clip(repr(msg), 200)}")

    def _settle(self) -> None:
        """CUDA: wait (bounded, polling) until every load and collective of this update ran."""
        if self._cuda:
            self.transport.wait_stream(self._load_stream, self.cfg.timeout_s)

    def _verify(self, seal: Seal, u: _Update) -> None:
        """Compare the sender's `Seal` with what arrived: bucket count and every checksum."""
        if u.failed is not None:
            return
        n = u.seq + 1
        if seal.buckets != n or len(seal.checksums) != n:
            u.failed = (f"rank {self.rank}: sender sealed update {u.version} with "
                        f"{seal.buckets} buckets / {len(seal.checksums)} checksums, "
                        f"{n} arrived")
            return
        if self._cuda:
            dev = [s for s in u.sums if s is not None]
            values = iter(torch.stack(dev).tolist() if dev else [])
            got = [None if s is None else next(values) for s in u.sums]
        else:
            got = u.sums
        for k, (mine, theirs) in enumerate(zip(got, seal.checksums, strict=True)):
            if mine is None:
                continue
            if not theirs:
                if self.require_checksums:
                    u.failed = (f"rank {self.rank}: no checksum for bucket {k} in the seal, and "
                                "this receiver requires one (VLLM_NCCL_SYNC_REQUIRE_CHECKSUMS)")
                    return
                continue
            if mine & ((1 << 64) - 1) != theirs:
                u.failed = (f"rank {self.rank}: bucket {k} arrived corrupted (checksum "
                            f"{mine & ((1 << 64) - 1):#x} != sender's {theirs:#x})")
                return

    def _commit(self, phase: int, u: _Update) -> None:
        """Wait for `Commit(phase)` of this update (an `Abort` or a timeout fails it)."""
        deadline = time.monotonic() + self._verdict_s
        while True:
            msg = self._recv(deadline)
            if getattr(msg, "version", None) != u.version:
                continue
            if isinstance(msg, Commit) and msg.phase == phase:
                return
            if isinstance(msg, Abort):
                if u.staged and phase == 1:
                    u.exposed = False  # no worker was told to load: the model is intact
                raise UpdateFailed(f"sender aborted update {u.version} in the commit round: "
                                   f"{clip(msg.reason)}")
            text = f"expected Commit({phase}) of update {u.version}, got {clip(repr(msg), 200)}"
            self._error(u.seq + phase, f"rank {self.rank}: {text}")  # the sender may be waiting
            raise UpdateFailed(text)

    # ------------------------------------------------------------------ one update

    def receive(self, loader: WeightLoader, timeout_s: float | None = None) -> dict:
        """Receive one whole update into `loader`; returns a msgpack-native summary.

        `timeout_s` bounds the wait for the update to start (the trainer may still be training);
        every later wait is bounded by the config's `timeout_s`. The version is stamped only when
        the sender commits, i.e. when every receiver of every engine confirmed the update.
        """
        if self.broken:
            return self._summary(ok=False, seq=-1, nbytes=0,
                                 error=f"transfer group is broken ({self.broken}); join again")
        self._version = -1
        u = _Update()
        re = Reassembler()
        try:
            plan = self._first(timeout_s or self.cfg.timeout_s, u)
            u.t0 = time.perf_counter()
            if plan.adapter is not None:
                assert self.adapters is not None  # `_plan_problem` refused it otherwise
                u.adapter, loader = plan.adapter, self.adapters(plan.adapter)
            if not u.staged:  # staged updates keep whole copies anyway
                re = Reassembler(getattr(loader, "load_rows", None))
            with contextlib.ExitStack() as armed:
                for t in self.transports:
                    armed.enter_context(t.armed(self._verdict_s, f"update {u.version}"))
                self._buckets(loader, re, u)
        except Exception as e:  # noqa: BLE001 - a failed update must never take the engine down
            if not isinstance(e, (UpdateFailed, TimeoutError)):
                log.exception("update %d failed on rank %d", u.version, self.rank)
            return self._failed(e, u, loader)
        st = self.state
        if u.adapter is not None:
            st.adapters[u.adapter.name] = u.version
        else:
            st.version, st.consistent = u.version, True
        st.updates += 1
        st.bytes += u.nbytes
        st.last_seconds = time.perf_counter() - u.t0
        return self._summary(ok=True, seq=u.seq, nbytes=u.nbytes, tensors=u.ntensors,
                             seconds=st.last_seconds)

    def _buckets(self, loader: WeightLoader, re: Reassembler, u: _Update) -> None:
        """Every bucket, then the commit round; raises on any failure.

        Bucket k+1's collective is posted before bucket k is checked and loaded. On CUDA every
        step is only queued (collective on the issue stream, checksum beside it, loads on the
        load stream, buffer reuse ordered by events): the host never waits between buckets.
        """
        if self._cuda:
            vllm_stream = torch.cuda.current_stream(self.transport.device)
            self._load_stream.wait_stream(vllm_stream)  # after whatever vLLM queued before
            for ev in self._free:
                ev.record(self._load_stream)
        self._start(0, u)
        while True:
            seq = u.seq
            is_last = u.headers[seq].is_last
            if not is_last:
                self._pump(u, lambda: u.accepted > seq, f"BucketHeader for bucket {seq + 1}")
                self._start(seq + 1, u)
            if self._cuda:
                with torch.cuda.stream(self._load_stream):
                    self._arrived(seq, u)
                    self._load(seq, loader, re, u)
                    self._load_stream.wait_event(self._cksum_done[seq % 2])
                    self._free[seq % 2].record(self._load_stream)
            else:
                self._arrived(seq, u)
                self._load(seq, loader, re, u)
            self._extend()  # progress: the deadman restarts its count
            if is_last:
                break
            del u.headers[seq]
            u.seq = seq + 1
        seal = self._expect_seal(u)
        self._settle()
        self._verify(seal, u)
        if u.failed is None and u.began:
            try:
                with torch.cuda.stream(self._load_stream) if self._cuda else contextlib.nullcontext():
                    loader.finish()
                self._settle()
            except Exception as e:  # noqa: BLE001 - vLLM's post-processing: report it
                u.failed = f"rank {self.rank} failed finishing the load: {clip(repr(e))}"
                log.exception("finishing the load failed")
        if u.failed is not None:
            self._fail(u, u.failed)
            raise UpdateFailed(u.failed)
        seconds = time.perf_counter() - u.t0
        self.channel.send(Ack(PROTOCOL_VERSION, self.rank, u.version, u.seq + 1, u.nbytes,
                              u.ntensors, seconds, 1), self.cfg.timeout_s)
        if u.staged:
            u.exposed = True  # the sender may tell others to load from here on
        self._commit(1, u)
        if not u.staged:
            return
        try:
            with torch.cuda.stream(self._load_stream) if self._cuda else contextlib.nullcontext():
                loader.begin()
                u.began = True
                loader.load(u.staged_tensors)
                u.staged_tensors = []
                loader.finish()
            self._settle()
        except Exception as e:  # noqa: BLE001
            u.failed = f"rank {self.rank} failed loading the staged update: {clip(repr(e))}"
            log.exception("loading the staged update failed")
            self._error(u.seq + 1, u.failed)
            raise UpdateFailed(u.failed) from None
        self.channel.send(Ack(PROTOCOL_VERSION, self.rank, u.version, u.seq + 1, u.nbytes,
                              u.ntensors, time.perf_counter() - u.t0, 2), self.cfg.timeout_s)
        self._commit(2, u)

    def _failed(self, e: BaseException, u: _Update, loader: WeightLoader) -> dict:
        """End a failed update the same way on every path; returns the summary.

        The group stays usable when every collective this receiver posted completed; otherwise
        (a collective that may never complete, or one the sender posted that this receiver
        refused to join) it is given up: aborted on NCCL, so nothing stays pending.
        """
        clean = isinstance(e, UpdateFailed)
        if not clean and not u.told:  # tell a sender that may still be waiting
            self._error(u.seq, f"rank {self.rank}: {clip(str(e))}")
        if not u.in_step:
            self._broken = self._broken or f"update {u.version} died mid-way: {clip(str(e))}"
            self._abort(self._broken)  # NCCL: no collective may stay pending
        if self.cfg.num_senders > 1 and u.agreed >= 0:  # any sender's group may be out of step
            self._broken = self._broken or (f"update {u.version} failed with several senders: "
                                            f"{clip(str(e), 300)}")
        if self._cuda:
            with torch.cuda.stream(self._load_stream):
                for w, _ in u.posted.values():
                    w.wait()
            try:  # after a clean abort every posted collective completes; else barely wait
                self.transport.wait_stream(self._load_stream, self.cfg.timeout_s if clean else 1.0)
            except (TimeoutError, RuntimeError) as err:
                self._broken = self._broken or f"update {u.version}: {clip(str(err))}"
        else:
            for w, _ in u.posted.values():  # gloo: bounded by the group's own timeout
                try:
                    w.wait()
                except RuntimeError as err:
                    self._broken = self._broken or f"update {u.version}: {clip(str(err))}"
        u.posted = {}
        u.staged_tensors = []
        self.state.failures += 1
        self.state.last_error = clip(str(e))
        if u.began:
            try:
                loader.abort()
            except Exception:  # noqa: BLE001
                log.exception("loader.abort() failed")
        if u.exposed and u.adapter is None:  # an adapter loader's `abort` undoes its own work
            self.state.consistent = False
        error = str(e) if u.failed is None or u.failed in str(e) else f"{u.failed}; then: {e}"
        return self._summary(ok=False, error=clip(error), seq=u.seq, nbytes=u.nbytes)

    def _summary(self, *, ok: bool, seq: int, nbytes: int, **extra) -> dict:
        out = {
            "ok": ok,
            "rank": self.rank,
            "version": self.state.version,
            "consistent": self.state.consistent,
            "buckets": seq + 1,
            "bytes": nbytes,
        }
        out.update(extra)
        observe_update(self, out)  # every update ends here: one event line, Prometheus series
        return out

    def close(self) -> None:
        for t in self.transports:
            t.close()
        self.channel.close()
