"""Receiver: one worker's side of an update (engine-agnostic; the vLLM glue lives in `ext`).

Per bucket: header (control plane) -> checked -> `Ready` -> `Go` -> exactly `length` bytes by
broadcast into one of two preallocated buffers -> views handed to a `WeightLoader`. The header
of bucket k+1 is read and answered while bucket k is on the wire, so the link never waits for the
control round trip.

Buffer reuse on CUDA is ordered by events, never by a host or device-wide synchronize: loads run on
the caller's current stream (after `work.wait()` made it wait for the collective), and an event
recorded after the loads of bucket k marks buffer k%2 free. The collective of bucket k+2 is issued
from a side stream that waits only on that event, so the broadcast of k+1 overlaps the loads of k
(issuing it from the current stream would make NCCL wait for the loads of k too, serialising link
and loads). On CPU (gloo) the loads finish before the next collective is issued.

A receiver that fails (bad header, loader error) keeps taking part in every collective it already
agreed to, then answers the next header or the end with `Error`; the sender then aborts every
rank the same way. Nothing blocks past `timeout_s`.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .channel import ReceiverChannel
from .config import SyncConfig
from .handshake import Reference
from .integrity import checksum
from .metrics import observe_update
from .packing import Reassembler, validate_header
from .protocol import PROTOCOL_VERSION, Abort, Ack, BucketHeader, Error, Go, Hello, Plan, Ready, TensorSpec
from .transport import Transport

log = logging.getLogger(__name__)


class WeightLoader(Protocol):
    """Where received tensors go. `load` must not keep references to the tensors it is given."""

    def begin(self) -> None: ...

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> set[str]: ...

    def finish(self) -> None: ...

    def abort(self) -> None: ...


class UpdateFailed(RuntimeError):
    """This update did not complete; the text says why and on which side."""


@dataclass(slots=True)
class ReceiverState:
    """What this worker holds and has done; reported by `nccl_sync_state`."""

    version: int = -1
    """Version of the last complete update (-1: the weights the engine started with)."""
    consistent: bool = True
    """False after an update failed part-way in place: some tensors are new, some old."""
    updates: int = 0
    failures: int = 0
    bytes: int = 0
    last_seconds: float = 0.0
    last_error: str = ""
    history: list[dict] = field(default_factory=list)


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
    ) -> None:
        """Join as `rank`; `reference` (the engine's tensors) lets plans and headers be checked
        against the model before any byte moves; `state` carries what the worker holds across
        re-joins (a re-joined worker must not forget that its weights are inconsistent)."""
        if rank == 0:
            raise ValueError("rank 0 is the sender")
        self.cfg = cfg
        self.rank = rank
        self.reference = reference
        self.broken = ""  # why the data-plane group can no longer be trusted ("" while healthy)
        self._refused_seq = -1  # the bucket this receiver last answered with Error
        self.state = state if state is not None else ReceiverState()
        self.channel = ReceiverChannel(cfg.host, cfg.control_port, rank, cfg.secret_bytes)
        self.channel.send(
            Hello(PROTOCOL_VERSION, rank, replica, tp_rank, tp_size, cfg.bucket_bytes, cfg.backend)
        )
        self.transport = Transport(cfg, rank, device)
        dev = self.transport.device
        self.buffers = [torch.empty(cfg.bucket_bytes, dtype=torch.uint8, device=dev) for _ in range(2)]
        self._cuda = dev.type == "cuda"
        if self._cuda:
            # Collectives are issued from this stream: it waits only for the loads that last read
            # the buffer being refilled (see the module docstring).
            self._issue_stream = torch.cuda.Stream(dev)
            self._free = [torch.cuda.Event(), torch.cuda.Event()]

    def _broadcast_into(self, i: int, length: int):
        """Start the collective filling `buffers[i][:length]` once its previous loads are done."""
        buf = self.buffers[i][:length]
        if not self._cuda:
            return self.transport.broadcast(buf)
        with torch.cuda.stream(self._issue_stream):
            self._issue_stream.wait_event(self._free[i])
            return self.transport.broadcast(buf)

    def _error(self, seq: int, message: str) -> None:
        self.channel.send(Error(PROTOCOL_VERSION, self.rank, seq, message, traceback.format_exc()))

    def _answer(
        self, header: BucketHeader, seq: int, failed: str | None, planned: bool = False
    ) -> str | None:
        """Check header `seq`; reply Ready, or Error naming the problem. Returns the failure."""
        if (failed is None and seq == 0 and not planned and header.version <= self.state.version
                and not header.force):
            failed = (f"rank {self.rank} refused update {header.version}: it holds version "
                      f"{self.state.version} (push with force=True to go back)")
        if failed is None:
            try:
                validate_header(header, seq, self.cfg.bucket_bytes)
            except ValueError as e:
                failed = f"rank {self.rank} rejected bucket {seq}: {e}"
        if failed is None and self.reference is not None:
            specs = [TensorSpec(x.name, x.dtype, x.shape) for x in header.slots]
            problems = self.reference.problems(specs)
            if problems:
                failed = f"rank {self.rank} rejected bucket {seq}: " + "; ".join(problems[:5])
        if failed is None:
            self.channel.send(Ready(PROTOCOL_VERSION, self.rank, seq))
        else:
            self._error(seq, failed)
            self._refused_seq = seq
        return failed

    def _expect(self, kind: type, seq: int, version: int | None, timeout_s: float):
        """Next control message of this update: `kind` for `seq`, else `UpdateFailed`.

        While waiting for the first header (`version` None), leftovers of an earlier, aborted
        update are skipped; afterwards an `Abort` of this update ends it.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.channel.recv(max(deadline - time.monotonic(), 0.0))
            if version is None and not isinstance(msg, BucketHeader):
                log.info("skipping a stale %s before the next update", type(msg).__name__)
                continue
            if isinstance(msg, Abort) and msg.version == version:
                raise UpdateFailed(f"sender aborted update {version} at bucket {msg.seq}: {msg.reason}")
            if isinstance(msg, kind) and msg.seq == seq and (version is None or msg.version == version):
                return msg
            text = f"expected {kind.__name__} for bucket {seq}, got {msg!r:.200}"
            self._error(seq, f"rank {self.rank}: {text}")  # the sender may be waiting for us
            raise UpdateFailed(text)

    def _first(self, timeout_s: float) -> tuple[Plan | None, BucketHeader]:
        """The update's opening: an optional `Plan` (answered here), then header 0.

        Leftovers of an earlier, aborted update are skipped. A refused plan still waits for the
        sender's `Abort`, so both sides end the update the same way.
        """
        deadline = time.monotonic() + timeout_s
        plan = None
        while True:
            msg = self.channel.recv(max(deadline - time.monotonic(), 0.0))
            if isinstance(msg, Plan) and plan is None:
                plan = msg
                problem = self._plan_problem(plan)
                if problem:
                    self._error(-1, problem)
                    try:  # the sender answers a refusal with Abort: end in step with it
                        self._expect(Abort, -1, plan.version, self.cfg.timeout_s)
                    except (UpdateFailed, TimeoutError):
                        pass
                    raise UpdateFailed(problem)
                self.channel.send(Ready(PROTOCOL_VERSION, self.rank, -1))
                deadline = time.monotonic() + self.cfg.timeout_s
            elif isinstance(msg, BucketHeader):
                if plan is not None and msg.version != plan.version:
                    raise UpdateFailed(f"header of update {msg.version} after plan {plan.version}")
                return plan, msg
            elif plan is not None and isinstance(msg, Abort) and msg.version == plan.version:
                raise UpdateFailed(f"sender aborted update {msg.version}: {msg.reason}")
            else:
                log.info("skipping a stale %s before the next update", type(msg).__name__)

    def _start(self, header: BucketHeader, seq: int, failed: str | None) -> tuple[Go, Any]:
        """Wait for `Go` of bucket `seq` and post its collective; `(go, handle or None)`.

        `failed` is what this receiver answered for the header: a sender must `Abort` a refused
        bucket, and a collective is never sized by a refused header.
        """
        go = self._expect(Go, seq, header.version, self.cfg.timeout_s)
        if failed is not None and self._refused_seq == seq:
            raise UpdateFailed(f"sender sent Go for bucket {seq}, refused: {failed}")
        work = self._broadcast_into(seq % 2, header.length) if header.length else None
        return go, work

    def _plan_problem(self, plan: Plan) -> str:
        """Why this receiver refuses `plan` ("" if it accepts it)."""
        if plan.version <= self.state.version and not plan.force:
            return (f"rank {self.rank} refused update {plan.version}: it holds version "
                    f"{self.state.version} (push with force=True to go back)")
        if self.reference is None:
            return ""
        problems = self.reference.problems(plan.tensors, plan.full)
        if not problems:
            return ""
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        return f"rank {self.rank} refused update {plan.version}: " + "; ".join(problems[:5]) + more

    def receive(self, loader: WeightLoader, timeout_s: float | None = None) -> dict:
        """Receive one whole update into `loader`; returns a msgpack-native summary.

        `timeout_s` bounds the wait for the update to start (the trainer may still be training);
        every later wait is bounded by the config's `timeout_s`. In place, tensors are loaded
        bucket by bucket; `staged` updates are held (cloned) until the last bucket arrived and
        verified, then loaded at once, so a failure leaves the model untouched.
        """
        if self.broken:
            return self._summary(ok=False, seq=-1, nbytes=0,
                                 error=f"transfer group is broken ({self.broken}); join again")
        t_wait = self.cfg.timeout_s
        self._refused_seq = -1
        re = Reassembler()
        seq, nbytes, ntensors = 0, 0, 0
        failed: str | None = None
        began = False
        staged: list[tuple[str, torch.Tensor]] = []
        t0 = 0.0
        try:
            plan, header = self._first(timeout_s or t_wait)
            t0 = time.perf_counter()
            if self._cuda:
                cur = torch.cuda.current_stream(self.transport.device)
                for ev in self._free:  # all earlier work on the caller's stream precedes bucket 0/1
                    ev.record(cur)
            failed = self._answer(header, 0, failed, plan is not None)
            go, work = self._start(header, 0, failed)
            while True:
                buf = self.buffers[seq % 2]
                nxt = nxt_go = nxt_work = None
                if not header.is_last:
                    nxt = self._expect(BucketHeader, seq + 1, header.version, t_wait)
                    failed = self._answer(nxt, seq + 1, failed)
                if work is not None:
                    try:
                        work.wait()
                    except RuntimeError as e:
                        self.broken = f"collective of bucket {seq} failed: {e}"
                        raise
                nbytes += header.length
                if failed is None and go.checksum:
                    got = checksum(buf[: header.length])
                    if got != go.checksum:
                        failed = (f"rank {self.rank}: bucket {seq} arrived corrupted "
                                  f"(checksum {got:#x} != sender's {go.checksum:#x}); not loaded")
                if nxt is not None and not self._cuda:
                    # CPU loads block the host: start bucket k+1 first so the link never waits
                    # for them (its buffer's previous loads, of k-1, are finished).
                    nxt_go, nxt_work = self._start(nxt, seq + 1, failed)
                if failed is None:
                    try:
                        named = re.unpack(header, buf)
                        ntensors += len(named)
                        if header.staged:
                            staged += [(n, t.clone()) for n, t in named]
                            named = staged if header.is_last else []
                        if named or header.is_last:
                            if not began:
                                loader.begin()
                                began = True
                            loader.load(named)
                        if header.is_last:
                            re.finish()
                            loader.finish()
                    except Exception as e:  # the loader is user/vLLM code: report, don't crash
                        failed = f"rank {self.rank} failed loading bucket {seq}: {e!r}"
                        log.exception("loading bucket %d failed", seq)
                if self._cuda:  # buffer seq%2 may be refilled once the loads issued so far ran
                    self._free[seq % 2].record(cur)
                if nxt is None:
                    break
                if nxt_go is None:
                    nxt_go, nxt_work = self._start(nxt, seq + 1, failed)
                header, seq, go, work = nxt, seq + 1, nxt_go, nxt_work
            if self.transport.device.type == "cuda":
                torch.cuda.current_stream(self.transport.device).synchronize()
            seconds = time.perf_counter() - t0
            if failed is not None:
                self._error(seq, failed)
                raise UpdateFailed(failed)
            self.channel.send(
                Ack(PROTOCOL_VERSION, self.rank, header.version, seq + 1, nbytes, ntensors, seconds)
            )
        except (UpdateFailed, TimeoutError, RuntimeError, ValueError) as e:
            if not isinstance(e, UpdateFailed):  # tell a sender that may still be waiting
                self._error(seq, f"rank {self.rank}: {e}")
                if t0:  # mid-update: collectives may be out of step with the sender's
                    self.broken = self.broken or f"update {header.version} died mid-way: {e}"
            self.state.failures += 1
            self.state.last_error = str(e)
            if began:
                self.state.consistent = False
                try:
                    loader.abort()
                except Exception:
                    log.exception("loader.abort() failed")
            error = str(e) if failed is None or failed in str(e) else f"{failed}; then: {e}"
            return self._summary(ok=False, error=error, seq=seq, nbytes=nbytes)
        st = self.state
        st.version, st.consistent, st.updates = header.version, True, st.updates + 1
        st.bytes += nbytes
        st.last_seconds = seconds
        return self._summary(ok=True, seq=seq, nbytes=nbytes, tensors=ntensors, seconds=seconds)

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
        self.transport.close()
        self.channel.close()
