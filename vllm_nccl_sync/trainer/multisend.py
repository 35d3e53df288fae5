"""Several senders in one update: the coordinator's side (`Coordinator`) and the others'
(`PeerSender`, each update a `PeerUpdate`), each a supplier of the send template (`send`). One
sender never comes here (`push.OneSender`).

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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from vllm_nccl_sync.outcomes import Kind, Problem, PushError, clip
from vllm_nccl_sync.planes.base import Transport
from vllm_nccl_sync.planes.registry import open_transport
from vllm_nccl_sync.trainer.lane import BucketLane
from vllm_nccl_sync.trainer.owners import OwnershipError, plan_headers, plan_owners
from vllm_nccl_sync.trainer.rounds import Rounds
from vllm_nccl_sync.trainer.send import Buckets, Lead, Sender, send
from vllm_nccl_sync.trainer.shards import held, local_buckets, shard_plan, specs_of
from vllm_nccl_sync.trainer.tensors import Caster, PushResult, faithful, without_aliases
from vllm_nccl_sync.wire.channel import ReceiverChannel
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.deadline import Deadline
from vllm_nccl_sync.wire.packing import DTYPES, alone_bytes, dtype_name, inside
from vllm_nccl_sync.wire.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Block,
    BucketHeader,
    Commit,
    Digest,
    Error,
    Go,
    Message,
    Offer,
    Plan,
    ReadSet,
    Ready,
    SenderHello,
    Sent,
    Slot,
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


def _owned(lane: BucketLane, headers: list[BucketHeader], by_name: dict[str, torch.Tensor],
           parts: Mapping[str, Block]) -> Buckets:
    """Every bucket of `headers`, from the tensors `by_name` this sender holds (of those in
    `parts`, only that block)."""
    for h, sources in local_buckets(headers, by_name, parts):
        yield h, lambda h=h, sources=sources: lane.wire(h.slots, sources)


def _held(named: Mapping[str, torch.Tensor], shard: bool
          ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, list[int]] | None, dict]:
    """This sender's tensors as it sends them, their full shapes and the blocks it holds of
    sharded ones (shard to shard: `shards.held`); else every tensor whole."""
    if shard:
        return held(named)
    return list(without_aliases(named)), None, {}


def _holds(parts: Mapping[str, Block], s: Slot, shape: list[int]) -> bool:
    """Whether a sender holding its tensor of slot `s` as `shape` (of those in `parts`, that
    block only) holds what `s` carries: the whole tensor, or blocks inside the one it holds."""
    part = parts.get(s.name)
    if part is None:
        return shape == s.shape
    size = [z - a for a, z in zip(part.start, part.stop, strict=True)]
    return shape == size and s.blocks is not None and all(inside(b, part) for b in s.blocks)


class Coordinator(Sender):
    """Sender 0's update when there are several senders, as `send` takes it (see the module
    text): the offers gathered, the plan made and agreed by everyone, its own buckets posted
    while a thread relays the other senders' `Digest`s, their `Sent`s taken before the `Seal`."""

    side = "the coordinator"

    def __init__(self, rounds: Rounds, lane: BucketLane, cfg: SyncConfig,
                 named_tensors: Mapping[str, torch.Tensor], version: int, caster: Caster, *,
                 force: bool = False, full: bool = False, staged: bool = False,
                 balance: bool = False, reads: Mapping[int, ReadSet] | None = None) -> None:
        self.rounds, self.lane, self.cfg = rounds, lane, cfg
        self.reads = reads
        """Every receiver's read set: shard to shard (`shards.shard_plan`)."""
        self.parts: dict[str, Block] = {}
        self.verdict = Lead(rounds)
        self.armed_s = cfg.timeout_s
        self.version, self.caster = version, caster
        self.force, self.full, self.staged, self.balance = force, full, staged, balance
        self._source: Mapping[str, torch.Tensor] | None = named_tensors
        self.headers: list[BucketHeader] = []
        self.done: dict[int, Sent] = {}
        """Each other sender's `Sent`."""

    def _plan(self, items: list[tuple[str, torch.Tensor]],
              shapes: Mapping[str, list[int]] | None) -> Plan:
        """The update's plan, from every sender's `Offer` (and this one's `items`, of full
        `shapes` where it holds blocks)."""
        rounds, version = self.rounds, self.version
        mine = specs_of(items, shapes) if shapes is not None else _specs(items)
        offers = {0: (mine, not self.balance, self.parts)}
        for r, o in rounds.gather(Offer, ranks=rounds.peers, who="senders",
                                  what="failed before its plan").items():
            offers[r] = ([_wire_spec(self.caster, t) for t in o.tensors], o.owned, o.parts)
        try:
            self.headers = self._headers(offers)
        except OwnershipError as e:
            raise PushError(f"update {version} refused: {e}") from None
        tensors = list({t.name: t for specs, _, _ in offers.values() for t in specs}.values())
        plan = Plan(PROTOCOL_VERSION, version, tensors, self.full, self.force, None,
                    self.headers, self.staged)
        if len(encode(plan)) > MAX_FRAME_BYTES:
            raise PushError(f"update {version}: its plan ({len(self.headers)} buckets) exceeds "
                            f"one control frame; raise bucket_bytes")
        return plan

    def _headers(self, offers: dict[int, tuple[list[TensorSpec], bool, dict[str, Block]]]
                 ) -> list[BucketHeader]:
        """Every header of the update, from the offers: whole tensors, one owner each, or shard
        to shard where every receiver published its read set."""
        cfg, alone = self.cfg, alone_bytes(self.cfg.bucket_bytes, self.cfg.backend)
        if self.reads is not None:
            return shard_plan({r: (s, p) for r, (s, _, p) in offers.items()}, self.reads,
                              cfg.bucket_bytes, alone, self.version, PROTOCOL_VERSION,
                              self.force, self.staged)
        owner = plan_owners({r: (s, o) for r, (s, o, _) in offers.items()})
        order = {r: [t for t in s if owner[t.name] == r] for r, (s, _, _) in offers.items()}
        return plan_headers(order, cfg.bucket_bytes, self.version, PROTOCOL_VERSION,
                            self.force, self.staged, alone)

    def agree(self) -> Buckets:
        """The plan to every receiver and sender, one `Go` (a refusal: `UpdateRefused`)."""
        self.rounds.begin(self.version)
        named, self._source = self._source, None
        items, shapes, self.parts = _held(named, self.reads is not None)
        items = [(n, self.caster(n, t)) for n, t in items]
        plan = self._plan(items, shapes)
        self.rounds.open(plan, len(self.headers) - 1, self.rounds.everyone)
        return _owned(self.lane, [h for h in self.headers if h.src == 0], dict(items),
                      self.parts)

    def _relay(self, rank: int, msg: Message) -> bool:
        """Another sender's `Digest` goes on to the receivers unchanged (each checks it before
        loading the bucket); its `Sent` is kept."""
        if rank in self.rounds.peers and isinstance(msg, Digest):
            header = self.headers[msg.seq] if msg.seq < len(self.headers) else None
            self.rounds.tell(msg, header.to if header is not None else None)
            return True
        if rank in self.rounds.peers and isinstance(msg, Sent):
            self.done[rank] = msg
            return True
        return False

    @contextmanager
    def beside(self) -> Iterator[None]:
        """While this sender's collectives run (a gloo send completes only once every receiver
        took it, and they take bucket k only after the Digest of every bucket before it), a
        thread relays the other senders' Digests."""
        stop = threading.Event()

        def relay_loop() -> None:
            while not stop.is_set():
                self.rounds.poll(Deadline(_POLL_S), relay=self._relay)
                time.sleep(_POLL_S / 10)  # let the pushing thread have the socket

        relayer = threading.Thread(target=relay_loop, name="nccl-sync-relay", daemon=True)
        relayer.start()
        try:
            yield
        finally:
            stop.set()
            relayer.join()

    def checked(self, sums: dict[int, int]) -> int:
        """Every other sender's `Sent` (or the first `Error`); their checksums added."""
        rounds, cfg, version = self.rounds, self.cfg, self.version
        self.lane.transport.extend(2 * cfg.timeout_s)
        peers = rounds.peers
        try:
            self.done.update(rounds.gather(Sent, ranks=[r for r in peers if r not in self.done],
                                           who="senders", relay=self._relay,
                                           stop_on_error=True))
        except PushError:
            pass  # named below
        if self.lane.failure is not None:  # the tensor source failed
            raise self.lane.failure
        lost, left = self.lane.lost_problem(cfg.num_senders - 1)
        silent = [r for r in peers if r not in self.done and r not in rounds.errors]
        notes = ([f"senders {silent} did not finish their buckets (dead?)"] if silent
                 else []) + ([lost.text] if lost else [])
        if rounds.errors or rounds.unreachable or notes:
            raise rounds.failure("failed", silent + left, "; ".join(notes))
        for r, s in self.done.items():
            sums.update(s.checksums)
            want = {h.seq for h in self.headers if h.src == r}
            if set(s.checksums) != want:
                raise PushError(f"update {version}: sender {r} reported buckets "
                                f"{sorted(s.checksums)[:8]}, its plan has {sorted(want)[:8]}")
        return len(self.headers)

    def stop(self) -> tuple[int, str]:
        return (len(self.headers) if self.rounds.agreed >= 0 else -1), ""

    def out_of_step(self, e: BaseException) -> bool:
        """Past the Go, a failure may have left any sender's group out of step (or its sender
        gone): every rank gives its groups up and joins again."""
        return self.rounds.agreed >= 0

    def per_receiver(self) -> dict[int, int]:
        if all(h.to is None for h in self.headers):
            return {}
        out = dict.fromkeys(self.rounds.receivers, 0)
        for h in self.headers:
            for r in self.rounds.receivers if h.to is None else h.to:
                out[r] += h.length
        return out

    def per_sender(self) -> dict[int, int]:
        out = {0: self.lane.bytes}
        for h in self.headers:
            if h.src:
                out[h.src] = out.get(h.src, 0) + h.length
        return out


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
        self.verdict_s = 2 * cfg.timeout_s + max(1.0, 0.1 * cfg.timeout_s)

    def connect(self) -> dict:
        """Join the coordinator, then host this sender's group until every receiver joined it."""
        cfg = self.cfg
        self.channel.send(SenderHello(PROTOCOL_VERSION, self.rank, cfg.bucket_bytes,
                                      cfg.backend), cfg.timeout_s)
        self.transport = open_transport(cfg.group(self.rank), 0, self.device)
        self.lane = BucketLane(self.transport, cfg.bucket_bytes, offset=cfg.num_senders - 1,
                               check=cfg.bucket_checksums is not False, timeout_s=cfg.timeout_s,
                               digest=lambda d, _: self.channel.send(d, cfg.timeout_s))
        return {}

    def expect(self, kind: type, version: int, what: str, phase: int | None = None):
        """The coordinator's next `kind` of update `version`, within the verdict timeout from now
        (its `Abort` raises `PushError`)."""
        deadline = Deadline(self.verdict_s)
        while True:
            try:
                msg = self.channel.recv(deadline.left(), fail_on_drop=True)
            except (TimeoutError, ConnectionError) as e:
                raise PushError(f"update {version}: the coordinator (sender 0) said nothing "
                                f"within {self.verdict_s:.1f} s while sender {self.rank} "
                                f"waited for {what} (coordinator dead?): {e}") from None
            if not belongs(msg, version):
                continue
            if isinstance(msg, Abort):
                raise PushError(f"update {version} aborted by the coordinator: "
                                f"{clip(msg.reason)}")
            if isinstance(msg, kind) and (phase is None or getattr(msg, "phase", phase) == phase):
                return msg

    def refuse(self, version: int, problem: str) -> None:
        """Tell the coordinator why this sender cannot go on with update `version`."""
        try:
            self.channel.send(Error(PROTOCOL_VERSION, self.rank, -1, clip(problem), " ",
                                    version), min(self.cfg.timeout_s, 5.0))
        except (TimeoutError, OSError):
            pass  # the coordinator's verdict (or its silence) ends the update anyway

    def push(self, named_tensors: Mapping[str, torch.Tensor], version: int, *,
             dtype: torch.dtype | None = None, force: bool = False, full: bool = False,
             staged: bool = False, balance: bool = False) -> PushResult:
        """Offer these tensors for update `version` and send the buckets the plan gives this
        sender; returns once the coordinator committed the update (`PushError` otherwise)."""
        caster = Caster(dtype)
        update = PeerUpdate(self, named_tensors, version, caster, (force, staged, full),
                            balance=balance)
        return send(update, version, caster, staged=staged)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.channel.close()


class PeerUpdate(Sender):
    """Sender `rank` > 0's update, as `send` takes it: its `Offer`, the coordinator's plan checked
    and answered (`Ready`), its buckets once the `Go` came; its verdict follows the coordinator's
    (`Sent`, then its `Commit`s, or its `Abort`)."""

    def __init__(self, peer: PeerSender, named_tensors: Mapping[str, torch.Tensor],
                 version: int, caster: Caster, flags: tuple[bool, bool, bool], *,
                 balance: bool) -> None:
        self.peer, self.lane, self.verdict = peer, peer.lane, self
        self.side = f"sender {peer.rank}"
        self.armed_s = peer.verdict_s
        self.version, self.caster, self.flags, self.balance = version, caster, flags, balance
        self._source: Mapping[str, torch.Tensor] | None = named_tensors
        self.parts: dict[str, Block] = {}
        """The blocks this sender holds of the tensors it holds a block of (shard to shard)."""
        self.ready = False
        """This sender said `Ready`: the coordinator may have sent `Go` to everyone."""

    def agree(self) -> Buckets:
        """Offer, take the plan, check this sender's part of it, `Ready`, then the `Go`."""
        peer, version, timeout_s = self.peer, self.version, self.peer.cfg.timeout_s
        named, self._source = self._source, None
        items, shapes, self.parts = _held(named, peer.cfg.shard)
        items = [(n, self.caster(n, t)) for n, t in items]
        by_name = dict(items)
        specs = specs_of(items, shapes) if shapes is not None else _specs(items)
        peer.channel.send(Offer(PROTOCOL_VERSION, peer.rank, version, specs, not self.balance,
                                self.parts), timeout_s)
        plan = peer.expect(Plan, version, "the Plan")
        mine = [h for h in plan.buckets if h.src == peer.rank]
        problem = self._problem(plan, mine, by_name)
        if problem:
            peer.refuse(version, problem.text)
            peer.expect(Abort, version, "the Abort of a refused plan")  # raises PushError
        last = plan.buckets[-1].seq
        peer.channel.send(Ready(PROTOCOL_VERSION, peer.rank, last, version), timeout_s)
        self.ready = True
        self.lane.transport.extend(peer.verdict_s)  # the verdict's wait counts from here
        go = peer.expect(Go, version, "Go")
        if go.seq < last:
            raise PushError(f"update {version}: Go covers bucket {go.seq}, not all {last + 1}")
        return _owned(self.lane, mine, by_name, self.parts)

    def _problem(self, plan: Plan, mine: list[BucketHeader],
                 by_name: dict[str, torch.Tensor]) -> Problem | None:
        """Why this sender cannot send its part of `plan` (None if it can): a tensor it does not
        hold as the plan gives it (MODEL), or flags other than the coordinator's (PLAN). A tensor
        the plan carries in another dtype is cast to it where the cast is faithful and no `dtype`
        was asked for (the coordinator decides the wire dtype)."""
        rank, caster, bad = self.peer.rank, self.caster, set()
        for s in (s for h in mine for s in h.slots):
            t, want = by_name.get(s.name), DTYPES.get(s.dtype)
            if t is None or not _holds(self.parts, s, list(t.shape)) or want is None:
                bad.add(s.name)
            elif t.dtype != want and caster.dtype is None and faithful(t.dtype, want):
                by_name[s.name] = caster.to(t, want)
            elif t.dtype != want:
                bad.add(s.name)
        if bad:
            return Problem(Kind.MODEL, f"sender {rank} holds no such tensor(s) as the plan gives "
                                       f"it: {sorted(bad)[:5]}")
        if (plan.force, plan.staged, plan.full) != self.flags:
            return Problem(Kind.PLAN, f"sender {rank} pushes force/staged/full={self.flags}, the "
                                      f"coordinator {(plan.force, plan.staged, plan.full)}")
        return None

    def checked(self, sums: dict[int, int]) -> int:
        """A failure here goes to the coordinator; its verdict (`Abort`) says why."""
        lane, peer = self.lane, self.peer
        failure = lane.failure or (lane.lost[0] if lane.lost else None)
        if failure is not None:
            text = f"sender {peer.rank}: {clip(str(failure), 500)}"
            peer.refuse(self.version, text)
            try:
                peer.expect(Abort, self.version, "the verdict")
            except PushError as e:
                raise PushError(f"{e}; {text}") from None
        return lane.posted

    def seal(self, version: int, buckets: int, sums: Mapping[int, int]) -> None:
        """This sender's checksums to the coordinator, which seals the update."""
        self.peer.channel.send(Sent(PROTOCOL_VERSION, self.peer.rank, version, dict(sums)),
                               self.peer.cfg.timeout_s)
        self.lane.transport.extend(self.peer.verdict_s)

    def commit(self, buckets: int, phase: int) -> list[Ack]:
        self.peer.expect(Commit, self.version, "Commit" if phase == 1 else f"Commit({phase})",
                         phase)
        return []

    def abort(self, seq: int, reason: str) -> None:
        """Nothing to tell: the coordinator decides (a failure here reached it as an `Error`)."""

    def stop(self) -> tuple[int, str]:
        return self.lane.posted, ""

    def out_of_step(self, e: BaseException) -> bool:
        """Past its `Ready`, every rank gives its groups up and joins again (see `Coordinator`)."""
        return self.ready
