"""Receiver: one worker's side of an update (engine-agnostic; `session` puts it behind the engines).

The update opens with the sender's `Plan`, checked as a whole (`update`) and answered with one
`Ready` or refused; one `Go` covers its headers. The buckets then arrive back to back
(`dataplane`): bucket k+1 posted before bucket k is checked and handed to a `WeightLoader`; a
stream's later headers are answered between buckets. The commit round (see `protocol`): the
sender's `Seal` lists every bucket's checksum, the receiver answers `Ack` once everything arrived
and verified, and stamps the version only on the `Commit` that follows its `Ack`. Every wait has
an absolute deadline (`inbox`). With `require_checksums` (the engine's policy, never the
trainer's: `VLLM_NCCL_SYNC_REQUIRE_CHECKSUMS`) a bucket that no checksum covers is refused.

A receiver that fails tells the sender at once (`Error`) and joins every collective a `Go` covers;
the sender then aborts every rank. One that fails before a plan named the update tells nobody:
nobody asked. A worker whose weights may differ from its peers' under the stamped version
reports `consistent: False` until the next complete update. Several senders: one data-plane
group each; bucket k comes from its header's `src`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec
import torch

from vllm_nccl_sync.engine.commit import CommitRound
from vllm_nccl_sync.engine.dataplane import ReceivePlane, digest_problem, seal_problem
from vllm_nccl_sync.engine.handshake import Reference
from vllm_nccl_sync.engine.inbox import Inbox, Wait
from vllm_nccl_sync.engine.metrics import observe_update
from vllm_nccl_sync.engine.residency import Residency
from vllm_nccl_sync.engine.state import ReceiverState, WeightLoader, require_checksums_default
from vllm_nccl_sync.engine.update import Layout, Update, plan_problem
from vllm_nccl_sync.outcomes import Kind, Problem, UpdateFailed, WorkerSummary, clip
from vllm_nccl_sync.planes.registry import open_transport
from vllm_nccl_sync.wire.channel import ReceiverChannel
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.packing import (
    DTYPES,
    Blocks,
    KeptViews,
    Reassembler,
    align_up,
    forget_in_place,
    tensor_nbytes,
)
from vllm_nccl_sync.wire.protocol import (
    PROTOCOL_VERSION,
    AdapterSpec,
    BucketHeader,
    Digest,
    Go,
    Hello,
    Plan,
    ReadSet,
    Ready,
    Repeat,
    Seal,
    TensorSpec,
    UnreadablePlan,
)
from vllm_nccl_sync.wire.taps import clone_tapped

if TYPE_CHECKING:
    from vllm_nccl_sync.engine.shadow import BesideReceive

log = logging.getLogger(__name__)


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
        dtype: str = "",
        residency: Callable[[], Residency] | None = None,
        reads: ReadSet | None = None,
    ) -> None:
        """Join as `rank`; `reference` (the engine's tensors) lets plans and headers be checked
        against the model before any byte moves; `state` carries what the worker holds across
        re-joins (a re-joined worker must not forget that its weights are inconsistent);
        `require_checksums` (default: `require_checksums_default()`) refuses unchecked buckets;
        `adapters` gives the loader of an update whose plan targets a LoRA adapter (None: such
        updates are refused); `dtype` (a wire dtype name) is the engine's floating-point weight
        dtype, told to the trainer in the `Hello` so that it can cast to it; `residency` gives
        what vLLM's sleep mode did to the model's weights (`engine.residency`; None: nothing);
        `reads` what this worker's loaders read of each checkpoint tensor, told to the trainer
        in the `Hello` so that it sends the worker only that (None: every tensor whole)."""
        if rank < cfg.num_senders:
            raise ValueError(f"ranks 0..{cfg.num_senders - 1} are the senders")
        self.cfg = cfg
        self.rank = rank
        self.reference = reference
        self.adapters = adapters
        self.residency = residency
        self.reads = dict(reads.tensors) if reads is not None else None
        self._views: dict[int, KeptViews] = {}  # buckets of whole tensors (`Reassembler`)
        self._layout: Layout | None = None  # the last plan accepted (`update.Layout`)
        self.require_checksums = (require_checksums_default() if require_checksums is None
                                  else require_checksums)
        self._broken = ""  # a failure that left this receiver out of step with the group
        # The trainer waits `timeout_s` for the slowest receiver, then sends its verdict (Go,
        # Commit or Abort): receivers wait a little longer for it, so a dead peer is named by the
        # trainer and every live receiver hears the same verdict instead of racing it.
        self.verdict_s = cfg.timeout_s + max(1.0, 0.1 * cfg.timeout_s)
        self.state = state if state is not None else ReceiverState()
        self.channel = ReceiverChannel(cfg.host, cfg.control_port, rank, cfg.secret_bytes)
        self.inbox = Inbox(self.channel, rank, cfg.timeout_s, self._extend)
        self.inbox.send(Hello(PROTOCOL_VERSION, rank, replica, tp_rank, tp_size, cfg.bucket_bytes,
                              cfg.backend, self.require_checksums, dtype, reads))
        # One data-plane group per sender: {sender s} + every receiver (one sender: the config's).
        group_rank = rank - cfg.num_senders + 1
        self.plane = ReceivePlane([open_transport(cfg.group(s), group_rank, device)
                                   for s in range(cfg.num_senders)], cfg.bucket_bytes, device)
        self.transports = self.plane.transports
        self.transport = self.transports[0]
        for side in filter(None, (t.side_socket() for t in self.transports)):
            self.channel.serve(*side)  # served whenever this receiver waits for the trainer
        self.buffers = self.plane.buffers
        self._round = CommitRound(self.inbox, self.plane, rank, cfg.timeout_s, self.verdict_s,
                                  residency)

    @property
    def broken(self) -> str:
        """Why the data-plane group can no longer be trusted ("" while healthy)."""
        return self.plane.broken or self._broken

    def _extend(self) -> None:
        """Progress: the deadman restarts its count."""
        self.plane.extend(self.verdict_s)

    # ------------------------------------------------------------------ one update

    def receive(self, loader: WeightLoader, timeout_s: float | None = None) -> dict[str, Any]:
        """`run` as its msgpack-native summary (what crosses a process boundary)."""
        return self.run(loader, timeout_s).to_dict()

    def run(self, loader: WeightLoader, timeout_s: float | None = None,
            beside: BesideReceive | None = None) -> WorkerSummary:
        """Receive one whole update into `loader`; never raises for a failed update.

        `beside`: the update is received while the engine serves (`shadow`): kept in its shadow,
        and loaded only once its gate opens, after the commit round's first phase.

        `timeout_s` bounds the wait for the update to start (the trainer may still be training);
        every later wait is bounded by the config's `timeout_s` (and a little more for the
        sender's verdicts). The version is stamped only when the sender commits, i.e. when every
        receiver of every engine confirmed the update.
        """
        self.inbox.reset()
        u = Update(self.rank, self.cfg.bucket_bytes, self.cfg.num_senders, beside=beside,
                   reads=self.reads, layout=self._layout)
        if self.broken:
            return self._summary(u, False, f"transfer group is broken ({self.broken}); join again")
        try:
            plan = self._opening(u, timeout_s or self.cfg.timeout_s)
            u.mark("plan")
            self._open(plan, u)
            u.mark("ready")
            if plan.adapter is not None:
                assert self.adapters is not None  # `plan_problem` refused it otherwise
                u.adapter, loader = plan.adapter, self.adapters(plan.adapter)
            with self.plane.armed(self.verdict_s, f"update {u.version}"):
                self._buckets(loader, self._reassembler(loader, u), u)
                self._round.run(loader, u)
        except Exception as e:  # noqa: BLE001 - a failed update must never take the engine down
            if not isinstance(e, (UpdateFailed, TimeoutError)):
                log.exception("update %d failed on rank %d", u.version, self.rank)
            return self._failed(e, u, loader)
        u.committed(self.state)
        return self._summary(u, True, seconds=self.state.last_seconds,
                             load=dict(getattr(loader, "stats", None) or {}))

    def _reassembler(self, loader: WeightLoader, u: Update) -> Reassembler:
        """How update `u`'s buckets become tensors: in place, whole rows straight into the
        loader; staged, copies kept (of their blocks only), beside serving in the shadow (large
        tensors as their rows arrive)."""
        if not u.staged:
            return Reassembler(getattr(loader, "load_rows", None), self.reads, views=self._views)
        if u.beside is not None:
            shadow = u.beside.shadow
            return Reassembler(shadow.load_rows, self.reads, shadow.keep, self._views)
        return Reassembler(reads=self.reads, keep_blocks=torch.clone, views=self._views)

    def _opening(self, u: Update, seconds: float) -> Plan:
        """The next update's `Plan` (a `Repeat`: the plan it names), within `seconds`. A frame
        that claims to be the Plan of update v but does not decode opened v all the same: v is
        refused as a whole (raises)."""
        try:
            msg = self.inbox.opening(seconds)
        except UnreadablePlan as e:
            u.version = e.version
            self._refuse(u, Problem(Kind.PLAN, f"rank {self.rank} refused update {e.version}: "
                                    f"its plan does not decode ({clip(str(e), 300)})"))
        return self._repeated(msg, u) if isinstance(msg, Repeat) else msg

    def _repeated(self, msg: Repeat, u: Update) -> Plan:
        """The plan a `Repeat` names: the last accepted one, if its layout has that id, with the
        repeat's version; else update `msg.version` is refused (its buckets are not known here,
        so none is joined)."""
        kept = self._layout.plan if self._layout is not None else None
        if kept is None or kept.layout != msg.layout:
            u.version = msg.version
            held = f"layout {kept.layout}" if kept is not None and kept.layout else "no layout"
            self._refuse(u, Problem(Kind.PLAN, f"rank {self.rank} refused update {msg.version}: "
                                    f"it repeats layout {msg.layout}, and this receiver holds "
                                    f"{held} (the last plan it accepted since it joined)"))
        u.repeated = True
        v = msg.version
        return msgspec.structs.replace(kept, version=v, buckets=[
            msgspec.structs.replace(h, version=v) for h in kept.buckets])

    def _open(self, plan: Plan, u: Update) -> None:
        """Answer the plan: one `Ready` for every header in it, or a refusal of it as a whole,
        which still waits for the sender's `Abort` so that both sides end the update alike."""
        u.version, u.staged = plan.version, plan.staged
        held = (self.state.version if plan.adapter is None
                else self.state.adapters.get(plan.adapter.name, -1))
        problem = (plan_problem(plan, self.rank, held, self.reference, self.adapters is not None)
                   or u.residency_problem(plan, self.residency, self.reference)
                   or self._shadow_problem(plan, u)
                   or u.open(plan, self.reference)
                   or self.plane.mapping_problem(plan.buckets, self.rank, plan=True))
        if problem:
            self._refuse(u, problem)
        if not u.repeated:  # a repeat maps what the last plan mapped; another may not
            forget_in_place(self._views)
        self._layout = u.layout
        self.inbox.send(Ready(PROTOCOL_VERSION, self.rank, u.accepted, plan.version))

    def _refuse(self, u: Update, problem: Problem) -> NoReturn:
        """Refuse update `u`'s plan as a whole, then wait for the sender's `Abort` so that both
        sides end the update alike; raises (the Abort, a `Go`, or the deadline)."""
        u.refuse(problem)
        self.inbox.fail(u, problem, -1)
        # A Go instead, whatever bucket was refused: the sender posts collectives this
        # receiver never joins (`_pump` gives the group up).
        self._pump(u, lambda: False, "Abort")
        raise AssertionError("only a raise ends the wait for an Abort")

    def _shadow_problem(self, plan: Plan, u: Update) -> Problem | None:
        """Why an update received beside serving is refused (None if its shadow fits)."""
        if u.beside is None:
            return None
        where = f"rank {self.rank} refused update {plan.version}"
        if not plan.staged:
            return Problem(Kind.SHADOW, f"{where}: an update received beside serving must be "
                           "staged (push it with staged=True; WeightSync.update(beside=True) does)")
        try:
            nbytes = sum(self._kept_bytes(t) for t in plan.tensors)
        except (KeyError, ValueError) as e:
            return Problem(Kind.PLAN, f"{where}: {clip(str(e))}")
        problem = u.beside.shadow.reserve(nbytes)
        return problem.at(where) if problem else None

    def _kept_bytes(self, t: TensorSpec) -> int:
        """Room the shadow keeps for tensor `t`: the blocks this worker reads of it (shard to
        shard: what is sent to it), else all of it."""
        read = (self.reads or {}).get(t.name)
        if read is None or read.shape != t.shape or read.dtype != t.dtype:
            return align_up(tensor_nbytes(t.dtype, t.shape))
        itemsize = DTYPES[t.dtype].itemsize
        return sum(align_up(b.numel() * itemsize) for b in read.blocks)

    def _pump(self, u: Update, want: Callable[[], bool], what: str) -> None:
        """Handle the sender's messages until `want()` holds, within one deadline: a stream's
        headers (answered), `Go`s, `Digest`s. Anything else ends the update (`UpdateFailed`)."""
        wait = Wait(f"{what} of update {u.version}", self.verdict_s)
        while not want():
            msg = self.inbox.next(u, wait)
            if isinstance(msg, BucketHeader) and u.last < 0:
                self._announced(msg, u)
            elif isinstance(msg, Go) and 0 <= u.refused <= msg.seq:
                # Before agreement: a Go covering a refused bucket agrees to nothing.
                u.in_step = False
                raise UpdateFailed(f"sender sent Go for bucket {msg.seq}, refused: {u.failed}")
            elif isinstance(msg, Go) and u.agreed < msg.seq <= u.accepted:
                u.agreed = msg.seq
                if not u.staged:
                    u.exposed = True  # in place: from now on some worker may load this update
            elif (isinstance(msg, Digest) and self.plane.digest_per_bucket
                  and u.seq <= msg.seq <= u.agreed and msg.seq not in u.digests):
                u.digests[msg.seq] = msg.checksum
            else:
                raise self.inbox.violation(u, f"expected {what}, got {clip(repr(msg), 200)}")

    def _announced(self, header: BucketHeader, u: Update) -> None:
        """A stream's next header: answered `Ready`, or refused (`Error`, once). After a failure
        it is left unanswered: never joined."""
        if u.failed is not None:
            if u.refused < 0:
                u.refused = u.accepted + 1
            return
        problem = u.accept(header) or self.plane.mapping_problem([header], self.rank)
        if problem:
            self.inbox.fail(u, problem, header.seq)
        else:
            self.inbox.send(Ready(PROTOCOL_VERSION, self.rank, header.seq, u.version))

    def _start(self, seq: int, u: Update) -> None:
        """Post bucket `seq`'s collective once its header is accepted and a `Go` covers it."""
        self._pump(u, lambda: u.agreed >= seq, f"Go for bucket {seq}")
        header = u.headers[seq]
        if header.length and u.mine(header):
            u.posted[seq] = self.plane.post(header, seq)

    def _buckets(self, loader: WeightLoader, re: Reassembler, u: Update) -> None:
        """Every bucket, then the `Seal`, verified; raises on any failure.

        Bucket k+1's collective is posted before bucket k is checked and loaded; on CUDA every
        step is only queued (see `dataplane`): the host never waits between buckets.
        """
        self.plane.begin()
        self._start(0, u)
        while True:
            seq = u.seq
            is_last = u.headers[seq].is_last
            if not is_last:
                self._pump(u, lambda s=seq: u.accepted > s, f"BucketHeader for bucket {seq + 1}")
                self._start(seq + 1, u)
            with self.plane.loading():
                owed = self._arrived(seq, u)
                u.mark(f"bucket{seq}")
                self._load(seq, loader, re, u)
                if owed:
                    self._digest(seq, u)
                u.mark(f"kept{seq}")
                self.plane.loaded(seq)
            self._extend()
            if is_last:
                break
            del u.headers[seq]
            u.seq = seq + 1
        sums = self.plane.reading(u.sums) if u.failed is None else None  # behind the loads
        self.plane.settle_reads(self.cfg.timeout_s)  # the sender's memory is its own again
        u.mark("read")
        seal = self._round.seal(u)
        u.mark("sealed")
        self._verify(seal, sums, u)
        u.mark("checked")
        if u.failed is None and u.began:
            try:
                with self.plane.loading():
                    loader.finish()
                self.plane.settle(self.cfg.timeout_s)
                u.mark("finished")
                u.failed = u.coverage_problem(loader)
            except Exception as e:  # noqa: BLE001 - vLLM's post-processing: report it
                u.failed = Problem(Kind.LOAD, f"rank {self.rank} failed finishing the load: "
                                   f"{clip(repr(e))}")
                log.exception("finishing the load failed")
        if u.failed is not None:
            self.inbox.fail(u, u.failed)
            raise u.failed.error()

    def _arrived(self, seq: int, u: Update) -> bool:
        """Wait for bucket `seq`'s bytes and check what can be checked now: where the plane
        checks each bucket, its canary and the sender's `Digest`, before any load. True where
        the bucket's loads owe its checksum (read in place): `_digest` once they ran."""
        header = u.headers[seq]
        if seq not in u.posted:
            u.sums.append(None)
            return False
        work, canary = u.posted.pop(seq)
        try:
            got = self.plane.arrived(seq, header.length, work)
        except RuntimeError as e:
            u.in_step = False
            self._broken = (f"collective of bucket {seq} from sender {header.src} failed: "
                            f"{clip(str(e))}")
            raise RuntimeError(self._broken) from e
        u.nbytes += header.length
        u.sums.append(got)
        if not self.plane.digest_per_bucket:
            return False
        if self.plane.owed(got):  # loaded while the sender sums it
            return True
        self._digest(seq, u, self.plane.overran(seq, header.length, canary))
        return False

    def _digest(self, seq: int, u: Update, overran: bool = False) -> None:
        """Take the sender's `Digest` for bucket `seq` (waited for) and compare its checksum;
        one the bucket's loads owed (`ReceivePlane.owed`) is read now, in place of the debt."""
        sender = f" from sender {u.headers[seq].src}" if u.senders > 1 else ""  # the one to blame
        self._pump(u, lambda: seq in u.digests, f"Digest for bucket {seq}{sender}")
        theirs, got = u.digests.pop(seq), u.sums[seq]
        if overran:
            self.inbox.fail(u, Problem(Kind.OVERRUN, f"rank {self.rank}: bucket {seq} broadcast "
                                       f"more bytes than its header's length "
                                       f"{u.headers[seq].length}; not loaded"))
            return
        loaded = self.plane.owed(got)
        if loaded and u.failed is not None:  # its loads did not run: nothing to compare
            return
        if loaded:
            got = u.sums[seq] = self.plane.values([got])[0]
        if problem := digest_problem(self.rank, seq, got, theirs, self.require_checksums,
                                     loaded):
            self.inbox.fail(u, problem)

    def _load(self, seq: int, loader: WeightLoader, re: Reassembler, u: Update) -> None:
        """Hand bucket `seq`'s tensors to the loader (or keep clones of them when staged)."""
        if u.failed is not None:
            return
        header = u.headers[seq]
        try:
            if not u.began and not u.staged:  # rows may go to the loader while unpacking
                loader.begin()
                u.began = True
            by_rows = re.loaded_by_rows
            named = re.unpack(header, self.plane.bucket(seq)) if u.mine(header) else []
            u.ntensors += len(named) + re.loaded_by_rows - by_rows
            if u.staged:
                keep = u.beside.shadow.keep if u.beside is not None else clone_tapped
                u.staged_tensors += [(n, t if isinstance(t, Blocks) else keep(t))
                                     for n, t in named]  # blocks: kept as they arrived
                if u.beside is not None:
                    u.staged_tensors += u.beside.shadow.take_completed()
            elif named or header.is_last:  # queued now: run while the next buckets are prepared
                loader.load(named)
            if header.is_last:
                re.finish()
        except Exception as e:  # the loader is user/vLLM code: report, don't crash
            self.inbox.fail(u, Problem(Kind.LOAD, f"rank {self.rank} failed loading bucket {seq}: "
                                       f"{clip(repr(e))}"))
            log.exception("loading bucket %d failed", seq)

    def _verify(self, seal: Seal, sums: Callable[[], list[int | None]] | None,
                u: Update) -> None:
        """Compare the sender's `Seal` with what arrived (`sums`: the update's checksums as
        `ReceivePlane.reading` queued them, None only once the update failed): bucket count and
        every checksum."""
        if u.failed is None:
            assert sums is not None, "the checksums were not queued for a live update"
            u.failed = seal_problem(self.rank, u.version, seal, sums(), self.require_checksums)

    def _failed(self, e: BaseException, u: Update, loader: WeightLoader) -> WorkerSummary:
        """End a failed update the same way on every path; returns the summary.

        The group stays usable when every collective this receiver posted completed; otherwise
        (a collective that may never complete, or one the sender posted that this receiver
        refused to join) it is given up: aborted on NCCL, so nothing stays pending.
        """
        clean = isinstance(e, UpdateFailed)
        # Tell a sender that may still be waiting (`tell` sends nothing before a plan came).
        if not clean and not u.told:
            self.inbox.tell(u, u.seq, f"rank {self.rank}: {clip(str(e))}")
        if not u.in_step:
            self._broken = self._broken or f"update {u.version} died mid-way: {clip(str(e))}"
            self.plane.abort(self._broken)  # NCCL: no collective may stay pending
        if self.cfg.num_senders > 1 and u.agreed >= 0:  # any sender's group may be out of step
            self._broken = self._broken or (f"update {u.version} failed with several senders: "
                                            f"{clip(str(e), 300)}")
        why = self.plane.drain(u.posted, clean, self.cfg.timeout_s)
        if why:
            self._broken = self._broken or f"update {u.version}: {why}"
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
        error = (str(e) if u.failed is None or u.failed.text in str(e)
                 else f"{u.failed.text}; then: {e}")
        return self._summary(u, False, clip(error))

    def _summary(self, u: Update, ok: bool, error: str = "", **kw: Any) -> WorkerSummary:
        """This update's summary (every update ends here: one event line, Prometheus series)."""
        extra: dict[str, Any] = {}
        if u.adapter is not None:
            extra["adapter"] = u.adapter.name
        if self.inbox.dropped:
            extra["dropped"] = self.inbox.said()
        if u.marks:
            extra["steps_ms"] = u.steps_ms()
        if u.accepted >= 0:  # its headers checked, or the last accepted plan's layout again
            extra["plan"] = "repeat" if u.repeated else "kept" if u.kept else "checked"
        if self.plane.read_in_place:  # buckets read where they lie in the sender's memory
            extra["read_in_place"] = self.plane.read_in_place
        out = WorkerSummary(ok, self.rank, self.state.version, self.state.consistent,
                            buckets=u.seq + 1 if u.version >= 0 else 0, bytes=u.nbytes,
                            tensors=u.ntensors if ok else 0, error=error, extra=extra, **kw)
        observe_update(self, out)
        return out

    def close(self) -> None:
        self.plane.close()
        self.channel.close()
