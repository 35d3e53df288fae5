"""The receiver's rules against a peer that breaks them, each answered within its bounds and named.

Real ZeroMQ sockets and a real 2-rank gloo group (CPU): the test plays rank 0 by hand (a real
`SenderChannel` and transport) against a real `Receiver` receiving in a thread.

a) Every wait ends at its absolute deadline: a peer trickling frames of another update (before
   the plan, while the receiver waits for a `Go`, or for the `Commit`) does not keep it waiting.
b) A plan is refused as a whole, whichever check refused it (the headers, the data plane): a
   `Go` after the refusal, whatever bucket was refused, means the sender posts a collective
   nobody here joins; the group is given up. An `Abort` keeps it.
c) What was received and dropped before the plan is named in the result; a failure before any
   plan is told to nobody (nobody asked).
d) Each tensor is named once per update (plan list, headers, stream headers); the commit round's
   order (`Commit` after this receiver's `Ack`); a plan that does not decode (e.g. a header
   nested in it speaks another protocol) is refused as the update it names.
e) What a peer is told names the problem, never a checksum the receiver computed of the peer's
   bytes (the engine's own log has both).
f) A `Repeat` opens an update as the last accepted plan did, with its own version; one that
   names another layout, or a version the receiver may not take, is refused, nothing loaded.

No test waits for time to pass: each observes what happened, and every deadline is a generous
upper bound whose expiry fails the test.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import msgspec
import pytest
import torch

from tests.conftest import free_port
from vllm_nccl_sync.engine.dataplane import seal_problem
from vllm_nccl_sync.engine.loaders import ModuleLoader
from vllm_nccl_sync.engine.receiver import Receiver
from vllm_nccl_sync.engine.state import ReceiverState
from vllm_nccl_sync.outcomes import Kind, Problem
from vllm_nccl_sync.planes.registry import open_transport
from vllm_nccl_sync.wire.channel import SenderChannel
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.integrity import checksum
from vllm_nccl_sync.wire.packing import pack, plan_buckets
from vllm_nccl_sync.wire.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Commit,
    Digest,
    Error,
    Go,
    Hello,
    Plan,
    Ready,
    Repeat,
    Seal,
    Source,
    TensorSpec,
    encode,
)

P = PROTOCOL_VERSION
T = 2.0
"""The config's `timeout_s` (every wait of the transfer)."""
SLACK = max(1.0, 0.1 * T)
"""What a receiver waits beyond `timeout_s` for the sender's verdicts (Go, Seal, Commit, Abort):
the trainer names a dead peer first."""
BOUND = 2 * T + 5
"""Upper bound of a receive that must end by a deadline (generous: a loaded machine)."""
TRICKLE_S = 0.2
"""A stale frame every this often: far more than a deadline's worth of them."""
CAP = 1600
"""Two buckets for `weights`: `a` (1200 bytes), then `b` (800)."""
SECRET = "7a" * 32


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(300, generator=g), "b": torch.randn(200, generator=g)}


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for n, t in weights(0).items():
            self.register_parameter(n, torch.nn.Parameter(t))


class Pair:
    """Rank 0 by hand against a real `Receiver` (rank 1) whose `receive` runs in a thread."""

    def __init__(self, state: ReceiverState | None = None) -> None:
        """A fresh group; `state`: what a re-joining worker carries over."""
        self.cfg = SyncConfig(control_port=free_port(), group_port=free_port(), world_size=2,
                              bucket_bytes=CAP, timeout_s=T, secret=SECRET)
        self.ch = SenderChannel(self.cfg.host, self.cfg.control_port, self.cfg.secret_bytes)
        box: dict = {}
        th = threading.Thread(target=lambda: box.setdefault("tx", open_transport(self.cfg, 0)))
        th.start()
        self.rx = Receiver(self.cfg, 1, dtype="float32", state=state)
        th.join(60)
        self.tx = box["tx"]
        self.hello = self.recv()
        self.model = Model()
        self.pool = ThreadPoolExecutor(1)
        self.buf = torch.zeros(CAP, dtype=torch.uint8)

    def receive(self, timeout_s: float = 3 * T, loader=None) -> Future:
        """`rx.receive` in the background; its future's result is (summary, seconds)."""
        loader = loader or ModuleLoader(self.model)

        def run():
            t0 = time.monotonic()
            return self.rx.receive(loader, timeout_s), time.monotonic() - t0

        return self.pool.submit(run)

    def recv(self, timeout_s: float = 30.0):
        rank, msg = self.ch.recv(time.monotonic() + timeout_s)
        assert rank == 1, (rank, msg)
        return msg

    def expect(self, kind: type, version: int):
        """The receiver's next message, which must be a `kind` of update `version`."""
        msg = self.recv()
        assert isinstance(msg, kind) and msg.version == version, msg
        return msg

    def buckets(self, version: int, named: dict, staged: bool = False):
        out = list(plan_buckets(named.items(), CAP))
        return out, [b.header(version, k, k == len(out) - 1, P, staged=staged)
                     for k, b in enumerate(out)]

    def bucket(self, version: int, seq: int, bucket) -> int:
        """Broadcast one bucket's bytes, then its `Digest`; returns its checksum."""
        wire = pack(bucket, self.buf)
        digest = checksum(wire)
        self.tx.broadcast(wire).wait()
        self.ch.send(1, Digest(P, version, seq, digest))
        return digest

    def through_seal(self, version: int, named: dict, layout: int = 0,
                     repeat: bool = False) -> None:
        """A correct in-place update up to the receiver's `Ack`, opened by its plan (its layout
        given id `layout`), or by a `Repeat` of layout `layout`."""
        buckets, headers = self.buckets(version, named)
        self.ch.send(1, Repeat(P, version, layout) if repeat else
                     Plan(P, version, [], buckets=headers, layout=layout))
        self.expect(Ready, version)
        self.ch.send(1, Go(P, version, len(headers) - 1))
        sums = [self.bucket(version, k, b) for k, b in enumerate(buckets)]
        self.ch.send(1, Seal(P, version, len(sums), sums))

    def good_update(self, version: int, seed: int, layout: int = 0, repeat: bool = False) -> dict:
        done = self.receive()
        self.through_seal(version, weights(seed), layout, repeat)
        self.expect(Ack, version)
        self.ch.send(1, Commit(P, version, 1))
        summary, _ = done.result(BOUND)
        assert summary["ok"] and summary["version"] == version, summary
        return summary

    def trickle(self, done: Future, version: int) -> int:
        """Frames of update `version` (not the receiver's) until `receive` returned, at most a
        minute of them; returns how many were sent."""
        n, end = 0, time.monotonic() + 60
        while not done.done() and time.monotonic() < end:
            self.ch.send(1, Digest(P, version, 0, 12345))
            n += 1
            wait([done], timeout=TRICKLE_S)
        return n

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.rx.close()
        self.tx.close()
        self.ch.close()


@pytest.fixture
def pair():
    p = Pair()
    try:
        yield p
    finally:
        p.close()


def test_hello_names_the_engine_dtype(pair):
    assert isinstance(pair.hello, Hello) and pair.hello.dtype == "float32"


# ---------------------------------------------------------------- a) absolute deadlines


@pytest.mark.parametrize("phase", ["opening", "go", "commit"])
def test_a_trickle_of_stale_frames_ends_at_the_deadline(pair, phase):
    """Frames of another update every 0.2 s, wherever the receiver waits: `receive` still ends
    by its deadline, and its error names the deadline and what it dropped meanwhile."""
    version, stale = 5, 4
    done = pair.receive(timeout_s=T)
    waited_for = {"opening": "the Plan of an update", "go": f"Go for bucket 0 of update {version}",
                  "commit": f"Commit(1) of update {version}"}[phase]
    if phase == "go":
        _, headers = pair.buckets(version, weights(1))
        pair.ch.send(1, Plan(P, version, [], buckets=headers))
        pair.expect(Ready, version)
    elif phase == "commit":
        pair.through_seal(version, weights(1))
        pair.expect(Ack, version)
    sent = pair.trickle(done, stale)
    summary, seconds = done.result(BOUND)
    assert seconds < BOUND, (seconds, sent)  # the trickle alone would have gone on for a minute
    assert not summary["ok"], summary
    m = re.search(rf"waited (\d+\.\d) s for {re.escape(waited_for)}", summary["error"])
    assert m, summary["error"]
    assert T <= float(m.group(1)) <= T + SLACK, summary["error"]  # the deadline it kept
    assert re.search(rf"received and dropped meanwhile: \d+ Digest of update {stale}",
                     summary["error"]), summary["error"]
    assert "Digest of update 4" in summary["dropped"], summary
    # The sender hears it too, unless no plan came: nobody asked (below, the next update's first
    # message to the sender is then its Ready, not a stale Error).
    if phase != "opening":
        err = pair.expect(Error, version)
        assert waited_for in err.message, err
    if phase != "commit":
        pair.good_update(version + 1, 2)  # the receiver and its group go on working


# ---------------------------------------------------------------- b) a plan refused as a whole


@pytest.mark.parametrize("refused", [0, 1])
def test_a_go_after_a_refused_plan_gives_the_group_up(pair, refused):
    """Plan [bucket 0, bucket 1] with a sequence gap at bucket `refused`: the receiver refuses
    the plan; a Go anyway (for bucket 0, which it checked fine when `refused` is 1) means the
    sender posts a collective it never joins: the group is given up, whatever was refused."""
    version = 3
    _, headers = pair.buckets(version, weights(1))
    assert len(headers) == 2
    headers[refused] = msgspec.structs.replace(headers[refused], seq=refused + 5)
    done = pair.receive()
    pair.ch.send(1, Plan(P, version, [], buckets=headers))
    err = pair.expect(Error, version)
    assert "bucket sequence gap" in err.message, err
    pair.ch.send(1, Go(P, version, 0))
    pair.ch.send(1, Abort(P, version, 1, "the hand trainer gives up"))
    summary, _ = done.result(BOUND)
    assert not summary["ok"], summary
    assert "sender sent Go for bucket 0, refused" in summary["error"], summary
    assert "bucket sequence gap" in summary["error"], summary
    assert pair.rx.broken, "the group was kept although the sender posted a collective"
    again, _ = pair.receive(timeout_s=0.5).result(BOUND)
    assert not again["ok"] and "transfer group is broken" in again["error"], again


def test_an_abort_after_a_refused_plan_keeps_the_group(pair):
    """The same refusal answered as the protocol says (Abort): the group stays usable."""
    version = 3
    _, headers = pair.buckets(version, weights(1))
    headers[1] = msgspec.structs.replace(headers[1], seq=6)
    done = pair.receive()
    pair.ch.send(1, Plan(P, version, [], buckets=headers))
    pair.expect(Error, version)
    pair.ch.send(1, Abort(P, version, -1, "a receiver refused"))
    summary, _ = done.result(BOUND)
    assert not summary["ok"] and "a receiver refused" in summary["error"], summary
    assert not pair.rx.broken
    pair.good_update(version, 2)


def test_a_go_after_a_plan_refused_by_the_data_plane_gives_the_group_up(pair):
    """Every header passes the update's checks, but bucket 0 is to be read where it lies in the
    sender's memory (`at`), which gloo maps none of: the plan is refused as a whole. A Go
    anyway is no agreement (the sender posts collectives nobody here joins): nothing joined, the
    update failed, the group given up; re-joined, the next update goes through."""
    version = 3
    _, headers = pair.buckets(version, weights(1))
    headers[0] = msgspec.structs.replace(headers[0], at=[Source(0, 0) for _ in headers[0].slots])
    done = pair.receive()
    pair.ch.send(1, Plan(P, version, [], buckets=headers))
    err = pair.expect(Error, version)
    assert "rank 1 refused bucket 0: the gloo plane maps no sender memory" in err.message, err
    pair.ch.send(1, Go(P, version, len(headers) - 1))
    pair.ch.send(1, Abort(P, version, len(headers), "the hand trainer gives up"))
    summary, _ = done.result(BOUND)
    assert not summary["ok"], summary
    assert re.search(r"sender sent Go for bucket \d+, refused: rank 1 refused bucket 0",
                     summary["error"]), summary
    assert pair.rx.transport.collectives == 0  # nothing was joined
    assert pair.rx.broken, "the group was kept although the sender posted collectives"
    assert summary["consistent"], summary  # nothing of the update was taken as agreed
    again = Pair(state=pair.rx.state)  # re-joined: a fresh group, what the worker holds kept
    try:
        again.good_update(version, 2)
        assert all(torch.equal(p, weights(2)[n]) for n, p in again.model.named_parameters())
    finally:
        again.close()


# ---------------------------------------------------------------- c) what arrived is said


JUNK = [encode(Go(P - 1, 1, 0)), b"\x00 not msgpack at all"]


def test_junk_before_the_plan_is_named_in_the_result(pair):
    """Frames that do not decode, then nothing: the result says what they were."""
    done = pair.receive(timeout_s=1.0)
    for frame in JUNK:
        pair.ch._send_payload(1, frame)
    summary, seconds = done.result(BOUND)
    assert not summary["ok"] and seconds < BOUND, summary
    error = summary["error"]
    assert f"protocol version {P - 1} received, this side speaks {P}" in error, error
    assert re.search(r"received and dropped meanwhile: .*undecodable frame", error), error
    pair.good_update(2, 1)  # no Plan came: the sender hears nothing (its next answer: Ready)


def test_junk_before_a_good_update_is_named_and_harmless(pair):
    done = pair.receive()
    for frame in JUNK:
        pair.ch._send_payload(1, frame)
    pair.through_seal(2, weights(1))
    pair.expect(Ack, 2)
    pair.ch.send(1, Commit(P, 2, 1))
    summary, _ = done.result(BOUND)
    assert summary["ok"] and summary["version"] == 2, summary
    assert f"protocol version {P - 1} received" in summary["dropped"], summary


# ---------------------------------------------------------------- d) lenient acceptances


def _refused(pair, version: int, plan: Plan) -> tuple[dict, str]:
    """Send `plan`, take the receiver's Error, abort as a sender would; (summary, error)."""
    done = pair.receive()
    pair.ch.send(1, plan)
    err = pair.expect(Error, version)
    pair.ch.send(1, Abort(P, version, -1, "refused"))
    summary, _ = done.result(BOUND)
    assert not summary["ok"] and not pair.rx.broken, summary
    assert all(torch.equal(p, weights(0)[n]) for n, p in pair.model.named_parameters())
    return summary, err.message


def test_a_tensor_named_twice_in_the_plan_is_refused(pair):
    specs = [TensorSpec("a", "float32", [300]), TensorSpec("b", "float32", [200]),
             TensorSpec("a", "float32", [300])]
    _, headers = pair.buckets(1, weights(1))
    summary, told = _refused(pair, 1, Plan(P, 1, specs, buckets=headers))
    assert "tensor 'a' is named twice in the plan" in summary["error"], summary
    assert "tensor 'a' is named twice" in told


def test_a_tensor_in_two_headers_of_a_plan_is_refused(pair):
    _, (h0,) = pair.buckets(1, {"a": weights(1)["a"]})
    h1 = msgspec.structs.replace(h0, seq=1)
    summary, _ = _refused(pair, 1, Plan(P, 1, [], buckets=[
        msgspec.structs.replace(h0, is_last=False), h1]))
    assert re.search(r"rejected bucket 1: tensor 'a' is named twice in update 1", summary["error"])


def test_a_staged_stream_naming_a_tensor_again_is_refused(pair):
    """A staged stream announcing tensor `a` in bucket 0, then again in bucket 1 (and it would
    go on): the second header is refused naming `a`; nothing was loaded, the group is fine."""
    version = 4
    (b0,), (h0,) = pair.buckets(version, {"a": weights(1)["a"]}, staged=True)
    done = pair.receive()
    pair.ch.send(1, Plan(P, version, [], buckets=[msgspec.structs.replace(h0, is_last=False)],
                         staged=True))
    pair.expect(Ready, version)
    pair.ch.send(1, Go(P, version, 0))
    pair.bucket(version, 0, b0)
    pair.ch.send(1, msgspec.structs.replace(h0, seq=1, is_last=False))
    err = pair.expect(Error, version)
    assert "tensor 'a' is named twice" in err.message, err
    pair.ch.send(1, Abort(P, version, 1, "a receiver refused bucket 1"))
    summary, _ = done.result(BOUND)
    assert not summary["ok"] and "tensor 'a' is named twice" in summary["error"], summary
    assert summary["consistent"] and summary["version"] == -1, summary  # staged: nothing loaded
    assert all(torch.equal(p, weights(0)[n]) for n, p in pair.model.named_parameters())
    assert not pair.rx.broken
    pair.good_update(version, 2)


def test_a_commit_before_the_ack_is_refused(pair):
    """Seal and Commit back to back, without waiting for the receiver's Ack: the receiver does
    not take the Commit (it cannot have been sent for its Ack) and says so."""
    rx = pair.rx

    class WaitsForTheCommit(ModuleLoader):
        def finish(self):  # in place, right before the Ack: until the Commit is queued here
            assert rx.channel._sock.poll(30_000), "the Commit never arrived"

    done = pair.receive(loader=WaitsForTheCommit(pair.model))
    pair.through_seal(2, weights(1))
    pair.ch.send(1, Commit(P, 2, 1))
    err = pair.expect(Error, 2)
    summary, _ = done.result(BOUND)
    assert not summary["ok"] and summary["version"] == -1, summary
    for text in (summary["error"], err.message):
        assert re.search(r"the sender sent Commit\(.*\) before this receiver's Ack\(1\)", text)
    pair.good_update(3, 2)  # in order, the same update goes through


@pytest.mark.parametrize("case", ["nested protocol", "past a bound"])
def test_a_plan_that_does_not_decode_is_refused_as_its_update(pair, case):
    """A frame that claims to be the Plan of update 1 but does not decode (a bucket header of
    another protocol nested in it, a value past its bound): never taken as a plan. The sender
    hears at once that update 1 is refused and why (an Error of that update, not a silence
    until its timeout); the refusal waits for the Abort, and the group is kept."""
    version = 1
    _, headers = pair.buckets(version, weights(1))
    raw = msgspec.to_builtins(Plan(P, version, [], buckets=headers))
    if case == "nested protocol":
        raw["buckets"][1]["protocol"] = P - 1
        why = rf"bucket 1 of the plan speaks protocol {P - 1}"
    else:
        raw["buckets"][0]["length"] = -1
        why = r"Expected `int` >= 0 - at `\$\.buckets\[0\]\.length`"
    done = pair.receive()
    pair.ch._send_payload(1, msgspec.msgpack.encode(raw))
    err = pair.expect(Error, version)
    assert re.search(rf"rank 1 refused update {version}: .*{why}", err.message), err
    pair.ch.send(1, Abort(P, version, -1, "a receiver refused"))
    summary, _ = done.result(BOUND)
    assert not summary["ok"] and re.search(why, summary["error"]), summary
    assert not pair.rx.broken
    assert all(torch.equal(p, weights(0)[n]) for n, p in pair.model.named_parameters())
    pair.good_update(version + 1, 2)


def test_each_bucket_goes_to_the_loader_once_it_arrived_checked(pair):
    """One loader call per bucket, holding that bucket's tensors, each made before the `Seal`
    is sent: a bucket's copies are queued while the next ones are received, none held back to
    be loaded with later buckets in one call."""
    calls: list[list[str]] = []
    both = threading.Event()

    class Records(ModuleLoader):
        def load(self, named_tensors):
            calls.append([n for n, _ in named_tensors])
            if len(calls) == 2:
                both.set()
            return super().load(named_tensors)

    done = pair.receive(loader=Records(pair.model))
    named = weights(3)
    buckets, headers = pair.buckets(2, named)
    assert len(headers) == 2
    pair.ch.send(1, Plan(P, 2, [], buckets=headers))
    pair.expect(Ready, 2)
    pair.ch.send(1, Go(P, 2, len(headers) - 1))
    sums = [pair.bucket(2, k, b) for k, b in enumerate(buckets)]
    assert both.wait(30), f"loader calls before the Seal: {calls}"  # no Seal sent yet
    pair.ch.send(1, Seal(P, 2, len(sums), sums))
    pair.expect(Ack, 2)
    pair.ch.send(1, Commit(P, 2, 1))
    summary, _ = done.result(BOUND)
    assert summary["ok"], summary
    assert calls == [["a"], ["b"]]
    assert all(torch.equal(p, named[n]) for n, p in pair.model.named_parameters())


def test_a_summary_says_where_the_receiver_spent_the_update(pair):
    """`steps_ms`: every step of a real update over gloo, in the order reached, buckets summed
    into one entry per kind however many there were."""
    summary = pair.good_update(1, seed=1)
    steps = summary["steps_ms"]
    assert list(steps) == ["plan", "ready", "bucket", "kept", "read", "sealed", "checked",
                           "finished", "acked", "committed"], steps
    assert steps["plan"] == 0 and all(v >= 0 for v in steps.values()), steps
    assert summary["buckets"] >= 1 and summary["seconds"] > 0

# ---------------------------------------------------------------- e) what a peer is told


def test_a_garbled_bucket_is_refused_by_name_without_the_receivers_checksum(pair, caplog):
    """Bucket 0 arrives garbled: the sender hears which bucket and that its checksum does not
    match, never the checksum the receiver computed of the bytes (no oracle for a forger); the
    engine's own log has both checksums. Nothing of the update is loaded; the group is kept."""
    caplog.set_level(logging.WARNING, logger="vllm_nccl_sync")
    version = 2
    buckets, headers = pair.buckets(version, weights(1))
    done = pair.receive()
    pair.ch.send(1, Plan(P, version, [], buckets=headers))
    pair.expect(Ready, version)
    pair.ch.send(1, Go(P, version, len(headers) - 1))
    wire = pack(buckets[0], pair.buf)
    theirs = checksum(wire)
    wire[0] ^= 0xFF
    mine = checksum(wire)
    assert mine != theirs
    pair.tx.broadcast(wire).wait()
    pair.ch.send(1, Digest(P, version, 0, theirs))
    err = pair.expect(Error, version)
    assert ("rank 1: bucket 0 arrived corrupted or short: its checksum does not match the "
            "sender's; not loaded") in err.message, err
    assert not re.search(r"0x[0-9a-f]+", err.message) and str(mine) not in err.message, err
    pair.bucket(version, 1, buckets[1])  # the Go covered it: joined, not loaded
    pair.ch.send(1, Abort(P, version, len(headers), "a receiver refused bucket 0"))
    summary, _ = done.result(BOUND)
    assert not summary["ok"] and "bucket 0 arrived corrupted" in summary["error"], summary
    assert not pair.rx.broken
    assert all(torch.equal(p, weights(0)[n]) for n, p in pair.model.named_parameters())
    logged = [r.getMessage() for r in caplog.records]
    assert any(f"{mine:#x}" in m and f"{theirs:#x}" in m for m in logged), logged


def test_a_seal_that_disagrees_names_the_bucket_without_the_receivers_checksum(caplog):
    """The same rule where checksums come in the Seal (NCCL, ipc): the refusal names the bucket
    and the mismatch; the receiver's checksum goes to its own log only."""
    caplog.set_level(logging.WARNING, logger="vllm_nccl_sync")
    mine, theirs = 0xABCDEF12345, 0x1234567
    problem = seal_problem(1, 4, Seal(P, 4, 2, [7, theirs]), [7, mine], True)
    assert problem == Problem(Kind.SEAL, "rank 1: bucket 1 arrived corrupted: its checksum does "
                              "not match the sender's"), problem
    logged = [r.getMessage() for r in caplog.records]
    assert any(f"{mine:#x}" in m and f"{theirs:#x}" in m for m in logged), logged


@pytest.mark.parametrize(("bad", "error"), [(("missing.weight", torch.ones(2)), KeyError),
                                            (("b", torch.ones(3)), ValueError)])
def test_the_module_loader_checks_a_whole_batch_before_copying_any_of_it(bad, error):
    """One call copies a batch (casting and strided targets included); a tensor it cannot take
    leaves every target of the batch as it was."""
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16))
    m.register_buffer("b", torch.zeros(4))
    loader = ModuleLoader(m)
    with pytest.raises(error):
        loader.load([("a", torch.ones(2, 3)), bad])
    assert not m.a.any() and not m.b.any() and loader.loaded == set()
    assert loader.load([("a", torch.full((2, 3), 1.5)), ("b", torch.arange(4.0))]) == {"a", "b"}
    assert torch.equal(m.a, torch.full((2, 3), 1.5, dtype=torch.bfloat16))
    assert torch.equal(m.b, torch.arange(4.0)) and m.a.requires_grad


# ---------------------------------------------------------------- f) layouts agreed once


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_repeat_of_the_last_accepted_layout_opens_its_update_as_that_plan(pair):
    """The plan gives its layout id 7; a `Repeat` of 7 is that plan with its own version: the
    same headers answered and joined, the new bytes loaded, every checksum checked."""
    first = pair.good_update(1, seed=1, layout=7)
    assert first["plan"] == "checked"
    again = pair.good_update(2, seed=2, layout=7, repeat=True)
    assert again["plan"] == "repeat" and again["buckets"] == first["buckets"]
    assert all(torch.equal(p, weights(2)[n]) for n, p in _params(pair.model).items())
    third = pair.good_update(3, seed=3, layout=7, repeat=True)  # and again, from version 3
    assert third["plan"] == "repeat" and third["version"] == 3


@pytest.mark.parametrize(("case", "version", "layout", "says"), [
    ("unknown id", 2, 8, "it repeats layout 8, and this receiver holds layout 7"),
    ("an old version", 1, 7, "it holds version 1"),
    ("after a re-join", 2, 7, "it repeats layout 7, and this receiver holds no layout"),
])
def test_a_repeat_the_receiver_cannot_take_is_refused_with_nothing_loaded(case, version, layout,
                                                                          says):
    """A `Repeat` of another layout than the last accepted plan's (a stale id after joining
    again included) or of a version the receiver may not take: refused before any collective,
    named, nothing loaded (the model bit for bit as it was), the group kept."""
    pair = Pair()
    try:
        pair.good_update(1, seed=1, layout=7)
        if case == "after a re-join":
            state = pair.rx.state
            pair.close()
            pair = Pair(state=state)  # a new group: what the old one agreed is gone
        before = _params(pair.model)
        done = pair.receive()
        pair.ch.send(1, Repeat(P, version, layout))
        err = pair.expect(Error, version)
        assert says in err.message, err
        pair.ch.send(1, Abort(P, version, -1, "a receiver refused"))
        summary, _ = done.result(BOUND)
        assert not summary["ok"] and says in summary["error"], summary
        assert "plan" not in summary, summary
        after = _params(pair.model)
        assert all(torch.equal(after[n], t) for n, t in before.items())
        assert not pair.rx.broken
        # A full plan again (the same layout, another id: where it was kept, under the new id).
        assert pair.good_update(5, seed=5, layout=9)["plan"] in ("checked", "kept")
        assert pair.good_update(6, seed=6, layout=9, repeat=True)["plan"] == "repeat"
    finally:
        pair.close()
