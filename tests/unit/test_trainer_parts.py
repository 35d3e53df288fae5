"""The trainer's parts on their own: the control rounds over real ZeroMQ sockets (absolute
deadlines, the version rule, refusals), the bucket lane (zero copy, a broadcast that raises),
the cast rule, and the one set of defaults.

No test sleeps and then asserts: deadlines only bound waits."""

from __future__ import annotations

import contextlib
import inspect
import threading
import time

import pytest
import torch

from vllm_nccl_sync.outcomes import Kind, PeerFailed, PushError, UpdateRefused
from vllm_nccl_sync.planes.base import Transport
from vllm_nccl_sync.trainer.lane import BucketLane
from vllm_nccl_sync.trainer.rounds import Rounds
from vllm_nccl_sync.trainer.send import Sender, send
from vllm_nccl_sync.trainer.sync import WeightSync, free_port
from vllm_nccl_sync.trainer.tensors import Caster, engine_dtype, faithful
from vllm_nccl_sync.wire.channel import ReceiverChannel, SenderChannel
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.deadline import Deadline
from vllm_nccl_sync.wire.integrity import checksum
from vllm_nccl_sync.wire.packing import plan_buckets
from vllm_nccl_sync.wire.protocol import PROTOCOL_VERSION as P
from vllm_nccl_sync.wire.protocol import (
    Abort,
    Ack,
    BucketHeader,
    Error,
    Go,
    Hello,
    Plan,
    Ready,
    Source,
)

# ---------------------------------------------------------------- rounds


def hello(rank: int, dtype: str = "") -> Hello:
    return Hello(P, rank, 0, 0, 1, 1024, "gloo", True, dtype)


@pytest.fixture
def joined():
    """A trainer's channel and receivers 1 and 2 joined to it (each knows the trainer's epoch)."""
    port = free_port()
    trainer = SenderChannel("127.0.0.1", port)
    rxs = [ReceiverChannel("127.0.0.1", port, r) for r in (1, 2)]
    deadline = time.monotonic() + 30
    for rx in rxs:
        rx.send(hello(rx.rank))
    seen: set[int] = set()
    while seen != {1, 2}:
        seen.add(trainer.recv(deadline)[0])
    for rx in rxs:
        trainer.send(rx.rank, Go(P, 0, 0))
        assert rx.recv(30) == Go(P, 0, 0)
    yield trainer, rxs
    for rx in rxs:
        rx.close()
    trainer.close()


def test_stale_messages_never_extend_a_gather(joined):
    """Rank 1 keeps sending messages of other updates; the wait for update 5's Ready still ends
    at its deadline, naming rank 1 as missing (an Error of another update fails nothing)."""
    trainer, (rx1, rx2) = joined
    stop = threading.Event()

    def stale() -> None:
        end = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < end:
            rx1.send(Ready(P, 1, 0, 4))
            rx1.send(Error(P, 1, 0, "an old failure", "", 3))
            stop.wait(0.02)

    rx2.send(Ready(P, 2, 0, 5))
    spam = threading.Thread(target=stale, daemon=True)
    spam.start()
    rounds = Rounds(trainer, [1, 2], timeout_s=1.0)
    rounds.begin(5)
    t0 = time.monotonic()
    try:
        with pytest.raises(PushError) as e:
            rounds.gather(Ready, seq=0)
    finally:
        stop.set()
        spam.join()
    assert time.monotonic() - t0 < 20  # the 60 s of stale traffic did not hold it open
    assert e.value.missing == [1] and e.value.errors == {}, e.value
    assert "no Ready from ranks [1] within 1.0 s" in str(e.value)


def test_a_deadline_counts_down_from_when_it_was_set():
    deadline = Deadline(0.2)
    assert 0.0 < deadline.left() <= 0.2 and not deadline.passed()
    time.sleep(0.25)
    assert deadline.left() == 0.0 and deadline.passed()


def test_an_error_naming_no_update_fails_none(joined):
    """An Error of version -1 (its sender failed before it knew of any update) belongs to no
    update: it is skipped, and the open update goes on."""
    trainer, (rx1, rx2) = joined
    rx1.send(Error(P, 1, -1, "rank 1 timed out waiting for a plan", "", -1))
    rx1.send(Ready(P, 1, 0, 5))
    rx2.send(Ready(P, 2, 0, 5))
    rounds = Rounds(trainer, [1, 2], timeout_s=20.0)
    rounds.begin(5)
    got = rounds.gather(Ready, seq=0)
    assert sorted(got) == [1, 2] and rounds.errors == {}, (got, rounds.errors)


def test_a_refused_plan_is_aborted_everywhere_and_reported_once(joined):
    trainer, (rx1, rx2) = joined
    rounds = Rounds(trainer, [1, 2], timeout_s=20.0)
    rounds.begin(7)
    plan = Plan(P, 7, [])

    def answer() -> None:
        assert isinstance(rx1.recv(20), Plan) and isinstance(rx2.recv(20), Plan)
        rx1.send(Error(P, 1, -1, "rank 1 refused update 7: tensor 'x': shape [3] != [4]", "", 7))
        rx2.send(Ready(P, 2, 0, 7))

    peer = threading.Thread(target=answer, daemon=True)
    peer.start()
    with pytest.raises(UpdateRefused) as e:
        rounds.open(plan, 0)
    peer.join()
    assert str(e.value) == ("update 7 refused at the plan: rank 1 refused update 7: tensor 'x': "
                            "shape [3] != [4]")
    assert e.value.errors == {1: "rank 1 refused update 7: tensor 'x': shape [3] != [4]"}
    for rx in (rx1, rx2):  # no Go: every receiver hears the Abort of the plan
        got = rx.recv(20)
        assert isinstance(got, Abort) and (got.version, got.seq) == (7, -1), got


# ---------------------------------------------------------------- lane


class _Done:
    def wait(self) -> bool:
        return True


class FakePlane:
    """A data plane that records what it is asked to broadcast; broadcast number `fail_at`
    raises as gloo does when a receiver's connection is already gone."""

    device = torch.device("cpu")
    digest_per_bucket = True
    shares_buffers = False
    backend = "stand-in"
    export, mapped, keep_mapped = Transport.export, Transport.mapped, Transport.keep_mapped  # none
    hand_over, side_socket = Transport.hand_over, Transport.side_socket

    def __init__(self, fail_at: int = -1) -> None:
        self.posted: list[torch.Tensor] = []
        self.fail_at = fail_at

    def broadcast(self, tensor: torch.Tensor, *, to=None):
        self.posted.append(tensor)
        if len(self.posted) == self.fail_at:
            raise RuntimeError("Connection reset by peer")
        return _Done()

    def extend(self, seconds: float) -> None:
        pass


def test_a_bucket_whose_only_moving_slot_is_one_tensor_is_sent_from_its_memory():
    """A zero-byte tensor beside it moves nothing, so it does not force a pack copy; two moving
    tensors are packed into the lane's buffer."""
    w, v = torch.randn(1000), torch.randn(10)
    lane = BucketLane(FakePlane(), 16 * 1024, check=True, timeout_s=10, digest=lambda d, to: None)
    [b] = list(plan_buckets([("empty", torch.empty(0)), ("w", w)], 16 * 1024))
    assert [s.nbytes for s in b.slots] == [0, 4000]
    assert lane.wire(b.slots, b.sources).data_ptr() == w.data_ptr()
    [b2] = list(plan_buckets([("w", w), ("v", v)], 16 * 1024))
    wire = lane.wire(b2.slots, b2.sources)
    assert wire.data_ptr() == lane.buffers[0].data_ptr() and wire.numel() == b2.length


def test_a_broadcast_that_raises_is_a_lost_peer_and_every_agreed_bucket_is_still_posted():
    plane = FakePlane(fail_at=2)
    digests = []
    lane = BucketLane(plane, 16 * 1024, check=True, timeout_s=10, digest=lambda d, to: digests.append(d))
    buckets = list(plan_buckets([(f"t{i}", torch.randn(3000)) for i in range(3)], 16 * 1024,
                                alone=8 * 1024))
    assert len(buckets) == 3
    for seq, b in enumerate(buckets):
        h = b.header(1, seq, seq == 2, P)
        lane.post(h, lambda b=b: lane.wire(b.slots, b.sources))  # never raises
    assert len(plane.posted) == 3 and lane.posted == 3 and lane.failure is None
    [lost] = lane.lost
    assert isinstance(lost, PeerFailed) and "broadcast of bucket 1 failed" in str(lost)
    assert [d.seq for d in digests] == [0, 1, 2]  # the plane wants a Digest per bucket
    problem, left = lane.lost_problem(0)
    assert problem.kind is Kind.LOST and "Connection reset by peer" in problem.text and left == []
    assert set(lane.drain()) == {0, 1, 2}


def test_a_state_dict_of_the_last_ones_names_dtypes_and_shapes_keeps_its_cut():
    """The second state dict of the same layout gets the same slots (not cut again), each slot's
    source its own tensor, and goes on the wire as those tensors' bytes; another shape is cut
    afresh."""
    lane = BucketLane(FakePlane(), 1024, check=True, timeout_s=10, digest=lambda d, to: None)
    sd = {"a": torch.randn(4, 8), "big": torch.randn(600), "b": torch.randn(3)}
    first = lane.cut(list(sd.items()), 512)
    assert [[s.name for s in b.slots] for b in first] == [["a"], ["big"], ["big"], ["big"], ["b"]]
    sd2 = {n: t + 1 for n, t in sd.items()}
    again = lane.cut(list(sd2.items()), 512)
    assert [b.slots for b in again] == [b.slots for b in first]
    assert all(x.slots is y.slots for x, y in zip(again, first))  # kept, not cut again
    assert all(src is sd2[s.name] for b in again for s, src in zip(b.slots, b.sources))
    fresh = list(plan_buckets(list(sd2.items()), 1024, 512))
    for b, f in zip(again, fresh):
        assert torch.equal(lane.wire(b.slots, b.sources).clone(),
                           lane.wire(f.slots, f.sources).clone())
    other = lane.cut([("a", torch.randn(8, 4)), ("b", torch.randn(3))], 512)
    assert other[0].slots[0].shape == [8, 4] and len(other) == 1


def test_a_bucket_made_ahead_of_its_post_is_summed_then_and_its_digest_is_of_its_bytes():
    """The checksum taken while receivers check the plan is the one its `Digest` carries, and
    it is of the bytes posted; an update that never posted it leaves nothing to the next."""
    digests = []
    lane = BucketLane(FakePlane(), 16 * 1024, check=True, timeout_s=10,
                      digest=lambda d, to: digests.append(d))
    sd = {"a": torch.randn(4, 8), "b": torch.randn(3)}
    [b] = lane.cut(list(sd.items()), 1 << 20)
    lane.begin()
    wire = lane.wire(b.slots, b.sources)
    lane.ahead(0, wire)
    lane.post(b.header(1, 0, True, P), lambda: wire)
    assert digests[-1].checksum == checksum(wire.clone()) != 0
    lane.drain()
    lane.begin()
    lane.ahead(0, torch.ones(8, dtype=torch.uint8))  # made, then the update failed
    lane.begin()
    sd["a"] += 1
    [b] = lane.cut(list(sd.items()), 1 << 20)
    lane.post(b.header(2, 0, True, P), lambda: lane.wire(b.slots, b.sources))
    assert digests[-1].checksum == checksum(lane.buffers[0][: b.length].clone())


class OpeningRounds:
    """A stand-in for the sender's rounds that records, when an update opens, which message
    opens it and whether its first bucket was already made (summed ahead), then runs
    `meanwhile` as `Rounds.open` does while the receivers check it."""

    def __init__(self, lane: BucketLane) -> None:
        self.lane = lane
        self.opened: list[tuple[str, bool, bool]] = []

    def begin(self, version: int) -> None:
        pass

    def open(self, opening, last: int, ranks=None, meanwhile=None) -> None:
        before = 0 in self.lane._early
        meanwhile()
        self.agreed = last
        self.opened.append((type(opening).__name__, before, 0 in self.lane._early))


def test_a_repeats_first_bucket_is_made_before_it_is_sent_a_plans_while_it_is_checked():
    """A `Plan` goes out first and its first bucket is made while the receivers check it; a
    `Repeat` of its layout (checked in no time) goes out once its first bucket is made; either
    way the bucket posted is the one summed, and its `Digest` carries that sum."""
    from vllm_nccl_sync.trainer.push import OneSender

    digests = []
    lane = BucketLane(FakePlane(), 16 * 1024, check=True, timeout_s=10,
                      digest=lambda d, to: digests.append(d))
    rounds = OpeningRounds(lane)
    cfg = SyncConfig(control_port=1, group_port=2, world_size=2, bucket_bytes=16 * 1024)
    sd = {"a": torch.randn(4, 8), "b": torch.randn(3)}
    agreed = None
    for version in (1, 2):
        lane.begin()
        sd["a"] += 1
        one = OneSender(rounds, lane, cfg, sd, version, Caster(None), force=False, full=False,
                        staged=False, adapter=None, window=1, agreed=agreed, layout_id=7)
        [(header, make)] = list(one.agree())
        lane.post(header, make)
        assert digests[-1].checksum == checksum(lane.buffers[0][: header.length].clone())
        assert torch.equal(lane.buffers[0][:16].view(torch.float32), sd["a"].flatten()[:4])
        lane.drain()
        agreed = one.layout
    assert rounds.opened == [("Plan", False, True), ("Repeat", True, True)]


class ExportingPlane(FakePlane):
    """A stand-in for a plane whose receivers map this sender's memory: every storage it is
    shown is a segment of its own (counted)."""

    shares_buffers = True
    digest_per_bucket = False

    def __init__(self) -> None:
        super().__init__()
        self.segments: dict[int, int] = {}
        self.exported = 0

    def shared_buffers(self) -> list[torch.Tensor]:
        return [torch.empty(1 << 16, dtype=torch.uint8) for _ in range(2)]

    def export(self, t: torch.Tensor) -> Source:
        self.exported += 1
        seg = self.segments.setdefault(t.untyped_storage().data_ptr(), len(self.segments))
        return Source(seg, t.storage_offset() * t.element_size())


def _laid_out(lane: BucketLane, sd: dict[str, torch.Tensor]) -> tuple[list, dict[int, int]]:
    """Lay `sd` out and post its buckets (read in place: on the host their checksums are
    computed as they are posted); where each bucket's slots lie, and the checksums."""
    lane.begin()
    buckets = list(lane.layout(list(sd.items()), 1 << 20))
    places = []
    for seq, b in enumerate(buckets):
        places.append(lane.at(b, seq))
        lane.post(b.header(1, seq, seq == len(buckets) - 1, P, at=places[-1]), lambda: None)
    return places, dict(lane.sums)


def test_a_state_dict_where_the_last_one_lay_reuses_its_layout_and_is_summed_again():
    """The second push of the same storages exports nothing again and names the same places;
    its checksums are of the bytes as they are now. A tensor moved to new memory, or a state
    dict of other names, is laid out afresh."""
    plane = ExportingPlane()
    lane = BucketLane(plane, 16 * 1024, check=True, timeout_s=10, digest=lambda d, to: None)
    sd = {f"t{i}": torch.randn(1000) for i in range(6)}
    places, sums = _laid_out(lane, sd)
    assert len(places) > 1 and all(p is not None for p in places) and plane.exported == 12
    again = {n: t.view(-1) for n, t in sd.items()}  # what state_dict() hands out: new objects
    assert _laid_out(lane, again) == (places, sums) and plane.exported == 12
    sd["t3"].add_(1.0)  # new values, same memory
    places3, sums3 = _laid_out(lane, sd)
    assert places3 == places and plane.exported == 12 and sums3 != sums
    sd["t3"] = sd["t3"].clone()  # new memory: a new segment
    places4, sums4 = _laid_out(lane, sd)
    assert plane.exported > 12 and places4 != places and sums4 == sums3
    fewer = {n: t for n, t in sd.items() if n != "t0"}
    assert sum(map(len, _laid_out(lane, fewer)[0])) == 5


# ---------------------------------------------------------------- the cast rule


def test_the_cast_rule():
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert faithful(bf16, f32) and faithful(f16, f32) and faithful(f32, bf16)
    assert faithful(f16, bf16) and faithful(f16, f16)
    assert not faithful(f32, f16) and not faithful(bf16, f16)
    auto = Caster(None, "float32")
    assert auto("w", torch.ones(2, dtype=bf16)).dtype == f32
    assert auto("n", torch.ones(2, dtype=torch.int64)).dtype == torch.int64  # never cast
    e4m3 = torch.ones(2).to(torch.float8_e4m3fn)
    assert auto("q", e4m3).dtype == torch.float8_e4m3fn  # the engine's plan check judges it
    assert auto.cast == {"bfloat16": "float32"}
    with pytest.raises(PushError, match=r"'w' is float32 and the engine holds float16: a cast "
                                        r"into float16 can overflow; .*push\(dtype=torch"):
        Caster(None, "float16")("w", torch.ones(2))
    assert Caster(f16, "float32")("w", torch.ones(2)).dtype == f16  # an explicit dtype wins
    assert Caster(None, "")("w", torch.ones(2, dtype=bf16)).dtype == bf16  # unknown: as is
    assert engine_dtype({1: hello(1, "bfloat16"), 2: hello(2, "bfloat16"), 3: hello(3)}) == \
        "bfloat16"
    with pytest.raises(PushError, match=r"ranks \[1\] hold bfloat16; ranks \[2\] hold float32"):
        engine_dtype({1: hello(1, "bfloat16"), 2: hello(2, "float32")})


# ---------------------------------------------------------------- the send template


class _Plane:
    def __init__(self) -> None:
        self.given_up: list[str] = []

    @contextlib.contextmanager
    def armed(self, seconds: float, what: str):
        yield

    def abort(self, reason: str) -> None:
        self.given_up.append(reason)


class _Lane:
    """What `send` uses of a `BucketLane`: counts, and checksums of what was posted."""

    def __init__(self) -> None:
        self.transport = _Plane()
        self.begin()

    def begin(self) -> None:
        self.posted = self.bytes = self.tensors = 0

    def post(self, header: BucketHeader, wire) -> None:
        self.bytes += wire().numel()
        self.posted += 1
        self.tensors += 1

    def drain(self) -> dict[int, int]:
        return {k: 100 + k for k in range(self.posted)}


STEPS = ["agree", "buckets", "checked", "seal", "commit1", "verified", "commit2"]


class _Scripted(Sender):
    """A sender of three 4-byte buckets that fails at step `fail` with `error`; it leads (one
    sender, the coordinator: its own verdict) or follows (a peer sender: another's verdict)."""

    def __init__(self, side: str, fail: str = "", error: Exception | None = None) -> None:
        self.lane, self.verdict, self.side, self.armed_s = _Lane(), self, side, 1.0
        self.fail, self.error = fail, error or RuntimeError(f"boom in {fail}")
        self.calls: list[tuple] = []

    def _step(self, name: str, *args) -> None:
        self.calls.append((name, *args))
        if name == self.fail:
            raise self.error

    def agree(self):
        self._step("agree")
        return self._buckets()

    def _buckets(self):
        for seq in range(3):
            if seq == 2:
                self._step("buckets")
            yield BucketHeader(P, 3, seq, 4, seq == 2, []), lambda: torch.zeros(4, dtype=torch.uint8)

    def checked(self, sums: dict[int, int]) -> int:
        self._step("checked", dict(sums))
        return self.lane.posted

    def seal(self, version: int, buckets: int, sums) -> None:
        self._step("seal", version, buckets, dict(sums))

    def commit(self, buckets: int, phase: int) -> list[Ack]:
        self._step(f"commit{phase}", buckets)
        return [Ack(P, 1, 3, buckets, 12, 3, 0.0, phase)]

    def abort(self, seq: int, reason: str) -> None:
        self.calls.append(("abort", seq, reason))

    def stop(self) -> tuple[int, str]:
        return self.lane.posted, f" at bucket {self.lane.posted}"

    def out_of_step(self, e: BaseException) -> bool:
        return self.lane.posted > 0

    def verified(self) -> None:
        self._step("verified")


def _push(s: _Scripted, staged: bool = True):
    return send(s, 3, Caster(None), staged=staged, verified=s.verified,
                progress=lambda *a: s.calls.append(("progress", *a[:2])))


def test_the_send_template_runs_every_step_in_order_and_builds_the_result_once():
    s = _Scripted("the trainer")
    got = _push(s)
    names = [c[0] for c in s.calls]
    assert names == ["agree", "progress", "progress", "buckets", "progress", "checked", "seal",
                     "commit1", "verified", "commit2"], names
    assert ("seal", 3, 3, {0: 100, 1: 101, 2: 102}) in s.calls
    assert (got.version, got.buckets, got.bytes, got.tensors) == (3, 3, 12, 3)
    assert [a.phase for a in got.acks] == [1] and got.per_sender == {} and got.cast == {}
    assert s.lane.transport.given_up == []
    s = _Scripted("the trainer")
    _push(s, staged=False)  # one phase: one Commit, nothing verified first
    assert [c[0] for c in s.calls][-2:] == ["seal", "commit1"], s.calls


@pytest.mark.parametrize("step", STEPS)
def test_a_failure_at_each_step_is_answered_and_translated_once_the_same_for_every_sender(step):
    """Whichever sender (one, the coordinator, a peer) and step: `Abort` told once, the group
    given up once where a collective may be pending, one `PushError` naming the update, where it
    stopped and the sender, caused by the failure."""
    texts = {}
    for side in ("the trainer", "the coordinator", "sender 1"):
        s = _Scripted(side, step)
        with pytest.raises(PushError) as e:
            _push(s)
        posted = s.lane.posted
        assert type(e.value) is PushError and e.value.__cause__ is s.error
        assert [c for c in s.calls if c[0] == "abort"] == [("abort", posted, f"boom in {step}")]
        assert s.lane.transport.given_up == ([f"update 3 failed: boom in {step}"] if posted
                                             else [])
        texts[side] = str(e.value).replace(side, "SIDE")
        assert str(e.value) == f"update 3 failed at bucket {posted} on {side}: " \
                               f"RuntimeError('boom in {step}')"
    assert len(set(texts.values())) == 1, texts


def test_the_template_raises_a_push_error_as_it_is_and_tells_no_abort_of_a_refusal():
    failed = PushError("update 3 failed at bucket 2: rank 1: bad checksum", {1: "bad"}, [2])
    s = _Scripted("the trainer", "checked", failed)
    with pytest.raises(PushError) as e:
        _push(s)
    assert e.value is failed and [c[0] for c in s.calls].count("abort") == 1
    refused = UpdateRefused("update 3 refused at the plan: rank 1: no such tensor")
    s = _Scripted("the trainer", "agree", refused)
    with pytest.raises(UpdateRefused) as e:
        _push(s)
    assert e.value is refused and "abort" not in [c[0] for c in s.calls]
    assert s.lane.transport.given_up == []  # nothing moved: the group stays
    s = _Scripted("the coordinator", "commit1", PeerFailed("rank 4 went away", 4))
    with pytest.raises(PushError) as e:
        _push(s)
    assert e.value.missing == [4] and "rank 4 left the data plane" in str(e.value)


# ---------------------------------------------------------------- one set of defaults


def test_front_doors_take_syncconfig_defaults():
    from vllm_nccl_sync.integrations.verl import VllmNcclSyncCheckpointEngine

    default = SyncConfig.defaults().__getitem__
    assert default("timeout_s") == 120.0
    sig = inspect.signature(WeightSync)
    verl = inspect.signature(VllmNcclSyncCheckpointEngine)
    for name in ("timeout_s", "backend", "bucket_bytes", "host", "secret"):
        assert sig.parameters[name].default == default(name), name
    assert verl.parameters["timeout_s"].default == default("timeout_s")
    assert sig.parameters["shard"].default is verl.parameters["shard"].default is default("shard")
    assert verl.parameters["bucket_size"].default == default("bucket_bytes")
    cfg = SyncConfig(control_port=1, group_port=2, world_size=2)
    assert cfg.timeout_s == default("timeout_s") and cfg.bucket_bytes == default("bucket_bytes")
