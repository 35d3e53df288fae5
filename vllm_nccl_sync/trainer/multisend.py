"""Several senders in one update: the coordinator's side (`coordinate`) and the others'
(`PeerSender`). One sender never comes here (`PushClient.push` runs alone).

Sender 0, the coordinator, runs the control plane with the receivers as one sender does (the same
`Rounds` and `BucketLane`); the other senders reach it over the same ROUTER. Per update: each
sender offers its tensors (`Offer`), the coordinator gives each tensor one owner
(`owners.plan_owners`), cuts each owner's tensors into buckets of its own and interleaves them by
bytes (`owners.plan_headers`); the `Plan` goes to the receivers and the senders; every one of them
answers `Ready` (a sender: its headers name tensors it holds, as offered, or cast faithfully to
the plan's dtype); one `Go` covers every bucket. Each sender then posts its buckets back to back
on its own data-plane group ({itself} + every receiver), so the senders' bytes move at the same
time on separate groups and links; on gloo each sends a `Digest` per bucket to the coordinator,
which relays it unchanged to the receivers, and a `Sent` (its checksums) after its last one. The
coordinator seals the update once every sender's `Sent` arrived, runs the commit round, and tells
the senders the verdict (`Commit` or `Abort`), so every trainer rank ends the update the same way.

Failures: a sender that says nothing in time (no `Offer`, no `Ready`, no `Sent`) fails the
update on the coordinator with a `PushError` naming its rank, and every rank gets `Abort`; a
receiver whose collective from a dead sender fails, or whose `Digest` from it never comes, names
that sender by rank, whichever it sees first. Once a sender is lost, the groups are given up:
every rank must join again (a new `PushClient`/`Receiver`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import torch

from vllm_nccl_sync.outcomes import PushError, as_push_error, clip
from vllm_nccl_sync.planes.base import Transport
from vllm_nccl_sync.planes.registry import open_transport
from vllm_nccl_sync.trainer.lane import BucketLane
from vllm_nccl_sync.trainer.owners import OwnershipError, plan_headers, plan_owners
from vllm_nccl_sync.trainer.rounds import Rounds
from vllm_nccl_sync.trainer.tensors import Caster, Progress, PushResult, faithful, without_aliases
from vllm_nccl_sync.wire.channel import ReceiverChannel
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.packing import DTYPES, alone_bytes, dtype_name
from vllm_nccl_sync.wire.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    BucketHeader,
    Commit,
    Digest,
    Error,
    Go,
    Message,
    Offer,
    Plan,
    Ready,
    Seal,
    SenderHello,
    Sent,
    TensorSpec,
    belongs,
    encode,
)

_POLL_S = 0.005
"""How long the coordinator's relay holds the control socket per look while collectives run."""


def _specs(items: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(n, dtype_name(t.dtype), list(t.shape)) for n, t in items]


def _wire_spec(caster: Caster, t: TensorSpec) -> TensorSpec:
    """An offered tensor as it goes on the wire (the coordinator's cast rule for every sender)."""
    held = DTYPES.get(t.dtype)
    if held is None:
        return t
    return TensorSpec(t.name, dtype_name(caster.target(t.name, held)), t.shape)


def _post_all(lane: BucketLane, headers: list[BucketHeader], by_name: dict[str, torch.Tensor],
              progress: Progress | None, t0: float) -> None:
    """Post every header of `headers` on `lane`, from the tensors `by_name`."""
    for h in headers:
        lane.post(h, lambda h=h: lane.wire(h.slots, [by_name[s.name] for s in h.slots]))
        if progress:
            progress(lane.posted, lane.bytes, time.perf_counter() - t0)


def coordinate(rounds: Rounds, lane: BucketLane, cfg: SyncConfig,
               named_tensors: Mapping[str, torch.Tensor], version: int, caster: Caster, *,
               force: bool = False, full: bool = False, staged: bool = False,
               balance: bool = False, progress: Progress | None = None) -> PushResult:
    """`PushClient.push` of sender 0 when there are several senders (see the module text)."""
    lane.begin()
    rounds.begin(version)
    transport = lane.transport
    items = [(n, caster(n, t)) for n, t in without_aliases(named_tensors)]
    peers = rounds.peers
    try:
        offers = {0: (_specs(items), not balance)}
        for r, o in rounds.gather(Offer, ranks=peers, who="senders",
                                  what="failed before its plan").items():
            offers[r] = ([_wire_spec(caster, t) for t in o.tensors], o.owned)
        try:
            owner = plan_owners(offers)
        except OwnershipError as e:
            raise PushError(f"update {version} refused: {e}") from None
        order = {r: [t for t in specs if owner[t.name] == r] for r, (specs, _) in offers.items()}
        tensors = list({t.name: t for specs, _ in offers.values() for t in specs}.values())
        headers = plan_headers(order, cfg.bucket_bytes, version, PROTOCOL_VERSION, force, staged,
                               alone_bytes(cfg.bucket_bytes, cfg.backend))
        plan = Plan(PROTOCOL_VERSION, version, tensors, full, force, None, headers, staged)
        if len(encode(plan)) > MAX_FRAME_BYTES:
            raise PushError(f"update {version}: its plan ({len(headers)} buckets) exceeds one "
                            f"control frame; raise bucket_bytes")
    except PushError as e:
        rounds.abort(-1, str(e))
        raise
    total = len(headers)
    rounds.open(plan, total - 1, rounds.everyone)  # a refusal: Abort to all, UpdateRefused
    done: dict[int, Sent] = {}

    def relay(rank: int, msg: Message) -> bool:
        """Another sender's `Digest` goes on to the receivers unchanged (each checks it before
        loading the bucket); its `Sent` is kept."""
        if rank in peers and isinstance(msg, Digest):
            rounds.tell(msg)
            return True
        if rank in peers and isinstance(msg, Sent):
            done[rank] = msg
            return True
        return False

    # While this sender's collectives run (a gloo send completes only once every receiver took
    # it, and they take bucket k only after the Digest of every bucket before it), a thread
    # relays the other senders' Digests.
    stop = threading.Event()

    def relay_loop() -> None:
        while not stop.is_set():
            rounds.poll(time.monotonic() + _POLL_S, relay=relay)
            time.sleep(_POLL_S / 10)  # let the pushing thread have the socket

    relayer = threading.Thread(target=relay_loop, name="nccl-sync-relay", daemon=True)
    t0 = time.perf_counter()
    try:
        with transport.armed(cfg.timeout_s, f"update {version}"):
            relayer.start()
            try:
                _post_all(lane, [h for h in headers if h.src == 0], dict(items), progress, t0)
                sums = lane.drain()
            finally:
                stop.set()
                relayer.join()
            transport.extend(2 * cfg.timeout_s)
            try:  # every other sender's Sent (or the first Error)
                done.update(rounds.gather(Sent, ranks=[r for r in peers if r not in done],
                                          who="senders", relay=relay, stop_on_error=True))
            except PushError:
                pass  # named below
            if lane.failure is not None:  # the tensor source failed
                raise lane.failure
            lost, left = lane.lost_problem(cfg.num_senders - 1)
            silent = [r for r in peers if r not in done and r not in rounds.errors]
            notes = ([f"senders {silent} did not finish their buckets (dead?)"] if silent
                     else []) + ([lost] if lost else [])
            if rounds.errors or rounds.unreachable or notes:
                raise rounds.failure("failed", silent + left, "; ".join(notes))
            for r, s in done.items():
                sums.update(s.checksums)
                want = {h.seq for h in headers if h.src == r}
                if set(s.checksums) != want:
                    raise PushError(f"update {version}: sender {r} reported buckets "
                                    f"{sorted(s.checksums)[:8]}, its plan has {sorted(want)[:8]}")
            rounds.send_all(Seal(PROTOCOL_VERSION, version, total,
                                 [sums.get(k, 0) for k in range(total)]))
            acks = rounds.commit(total, 1)
            if staged:
                rounds.commit(total, 2)
    except Exception as e:  # a receiver, a sender or the tensor source failed: end every wait
        rounds.abort(total, str(e))
        # Past the Go, a failure may have left any sender's group out of step (or its sender
        # gone): every rank gives its groups up and joins again.
        transport.abort(f"update {version} failed: {clip(str(e), 300)}")
        err = as_push_error(e, f"update {version} failed", "the coordinator")
        if err is e:
            raise
        raise err from e
    per_sender = {0: lane.bytes}
    for h in headers:
        if h.src:
            per_sender[h.src] = per_sender.get(h.src, 0) + h.length
    return PushResult(version, lane.posted, lane.bytes, lane.tensors, time.perf_counter() - t0,
                      list(acks.values()), per_sender, dict(caster.cast))


class PeerSender:
    """Sender `rank` > 0: joins the coordinator's control socket, hosts its own data-plane group,
    and pushes the buckets the coordinator's plan gives it (`PushClient(cfg, rank=...)`)."""

    def __init__(self, cfg: SyncConfig, rank: int, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.rank = rank
        self.device = device
        self.channel = ReceiverChannel(cfg.host, cfg.control_port, rank, cfg.secret_bytes)
        self.transport: Transport | None = None
        self.lane: BucketLane | None = None
        # The coordinator may wait `timeout_s` for the other senders and as long for the
        # receivers before its verdict: wait for it a little longer than both.
        self._verdict_s = 2 * cfg.timeout_s + max(1.0, 0.1 * cfg.timeout_s)

    def connect(self) -> dict:
        """Join the coordinator, then host this sender's group until every receiver joined it."""
        cfg = self.cfg
        self.channel.send(SenderHello(PROTOCOL_VERSION, self.rank, cfg.bucket_bytes,
                                      cfg.backend), cfg.timeout_s)
        self.transport = open_transport(cfg.group(self.rank), 0, self.device)
        self.lane = BucketLane(self.transport, cfg.bucket_bytes,
                               check=cfg.bucket_checksums is not False, timeout_s=cfg.timeout_s,
                               digest=lambda d: self.channel.send(d, cfg.timeout_s))
        return {}

    def _expect(self, kind: type, version: int, what: str, phase: int | None = None):
        """The coordinator's next `kind` of update `version`, within the verdict timeout from now
        (its `Abort` raises `PushError`)."""
        deadline = time.monotonic() + self._verdict_s
        while True:
            try:
                msg = self.channel.recv(max(deadline - time.monotonic(), 0.0), fail_on_drop=True)
            except (TimeoutError, ConnectionError) as e:
                raise PushError(f"update {version}: the coordinator (sender 0) said nothing "
                                f"within {self._verdict_s:.1f} s while sender {self.rank} "
                                f"waited for {what} (coordinator dead?): {e}") from None
            if not belongs(msg, version):
                continue
            if isinstance(msg, Abort):
                raise PushError(f"update {version} aborted by the coordinator: "
                                f"{clip(msg.reason)}")
            if isinstance(msg, kind) and (phase is None or getattr(msg, "phase", phase) == phase):
                return msg

    def _refuse(self, version: int, problem: str) -> None:
        try:
            self.channel.send(Error(PROTOCOL_VERSION, self.rank, -1, clip(problem), " ",
                                    version), min(self.cfg.timeout_s, 5.0))
        except (TimeoutError, OSError):
            pass  # the coordinator's verdict (or its silence) ends the update anyway

    def _problem(self, plan: Plan, mine: list[BucketHeader], by_name: dict[str, torch.Tensor],
                 caster: Caster, flags: tuple[bool, bool, bool]) -> str:
        """Why this sender cannot send its part of `plan` ("" if it can). A tensor the plan
        carries in another dtype is cast to it where the cast is faithful and no `dtype` was
        asked for (the coordinator decides the wire dtype)."""
        bad = set()
        for s in (s for h in mine for s in h.slots):
            t, want = by_name.get(s.name), DTYPES.get(s.dtype)
            if t is None or list(t.shape) != s.shape or want is None:
                bad.add(s.name)
            elif t.dtype != want and caster.dtype is None and faithful(t.dtype, want):
                by_name[s.name] = caster.to(t, want)
            elif t.dtype != want:
                bad.add(s.name)
        if bad:
            return (f"sender {self.rank} holds no such tensor(s) as the plan gives it: "
                    f"{sorted(bad)[:5]}")
        if (plan.force, plan.staged, plan.full) != flags:
            return (f"sender {self.rank} pushes force/staged/full={flags}, the coordinator "
                    f"{(plan.force, plan.staged, plan.full)}")
        return ""

    def push(self, named_tensors: Mapping[str, torch.Tensor], version: int, *,
             dtype: torch.dtype | None = None, force: bool = False, full: bool = False,
             staged: bool = False, balance: bool = False) -> PushResult:
        """Offer these tensors for update `version` and send the buckets the plan gives this
        sender; returns once the coordinator committed the update (`PushError` otherwise)."""
        cfg, lane = self.cfg, self.lane
        caster = Caster(dtype)
        items = [(n, caster(n, t)) for n, t in without_aliases(named_tensors)]
        by_name = dict(items)
        self.channel.send(Offer(PROTOCOL_VERSION, self.rank, version, _specs(items),
                                not balance), cfg.timeout_s)
        plan = self._expect(Plan, version, "the Plan")
        mine = [h for h in plan.buckets if h.src == self.rank]
        problem = self._problem(plan, mine, by_name, caster, (force, staged, full))
        if problem:
            self._refuse(version, problem)
            self._expect(Abort, version, "the Abort of a refused plan")  # raises PushError
        last = plan.buckets[-1].seq
        self.channel.send(Ready(PROTOCOL_VERSION, self.rank, last, version), cfg.timeout_s)
        lane.begin()
        t0 = time.perf_counter()
        try:
            with self.transport.armed(self._verdict_s, f"update {version}"):
                go = self._expect(Go, version, "Go")
                if go.seq < last:
                    raise PushError(f"update {version}: Go covers bucket {go.seq}, not all "
                                    f"{last + 1}")
                t0 = time.perf_counter()
                _post_all(lane, mine, by_name, None, t0)
                sums = lane.drain()
                failure = lane.failure or (lane.lost[0] if lane.lost else None)
                if failure is not None:  # tell the coordinator; its verdict says why
                    text = f"sender {self.rank}: {clip(str(failure), 500)}"
                    self._refuse(version, text)
                    try:
                        self._expect(Abort, version, "the verdict")
                    except PushError as e:
                        raise PushError(f"{e}; {text}") from None
                self.channel.send(Sent(PROTOCOL_VERSION, self.rank, version, sums), cfg.timeout_s)
                self.transport.extend(self._verdict_s)
                self._expect(Commit, version, "Commit", 1)
                if staged:
                    self._expect(Commit, version, "Commit(2)", 2)
        except Exception as e:  # past the Go: every rank gives its groups up (see coordinate)
            self.transport.abort(f"update {version} failed: {clip(str(e), 300)}")
            if isinstance(e, PushError):
                raise
            raise PushError(f"update {version} failed on sender {self.rank}: "
                            f"{clip(repr(e))}") from e
        return PushResult(version, lane.posted, lane.bytes, lane.tensors,
                          time.perf_counter() - t0, [], cast=dict(caster.cast))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.channel.close()
