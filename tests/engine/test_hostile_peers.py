"""Hostile peers (protocol 3): a peer that breaks the protocol is refused with an error naming what
it did, within bounds (no hang), and nothing it sent is ever loaded silently.

Real processes, real ZeroMQ sockets, real gloo groups (CPU):

1-4. The test process plays rank 0 by hand (a real `SenderChannel` and `Transport`) against a
     `Receiver` in a child process, loading into a torch module through a `ModuleLoader`: an
     oversized control frame mid-update, a broadcast shorter and one longer than its header's
     length, a `Digest` without the checksum the receiver requires.
5.   A real `PushClient` and three receiver processes; rank 1 is SIGKILLed mid-update. And a
     plain update to three receivers (gloo relays bytes through a tree), buckets shorter than
     the capacity.
6.   A real vLLM CPU engine with tensor parallelism 2, one of whose workers fails in its last
     step (`tests/fault_ext.py`).

What a receiver holds is checked by content (digests of the module's parameters and the loader's
calls), not only by flags. No test waits for time to pass: state is observed, and every deadline
is an upper bound whose expiry fails the test.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import re
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from tests.conftest import free_port
from tests.procs import run_procs
from vllm_nccl_sync.planes.base import Transport
from vllm_nccl_sync.planes.registry import open_transport
from vllm_nccl_sync.wire.channel import MAX_WIRE_BYTES, SenderChannel
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.integrity import checksum
from vllm_nccl_sync.wire.packing import pack, plan_buckets
from vllm_nccl_sync.wire.protocol import (
    MAX_FRAME_BYTES,
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
    Seal,
)

P = PROTOCOL_VERSION
SECRET = "0123456789abcdef" * 4
TIMEOUT = 15.0
"""Every wait of the transfer (the config's `timeout_s`); also bounds the group's rendezvous, so
it leaves room for processes that start unevenly on a loaded machine."""
DEADLINE = 240.0
"""Upper bound of a whole multi-process scenario (process start-up included)."""
CAP = 2048
SHAPES = {"w": [200], "v": [400]}
"""Bucket 0: `w`, 800 bytes; bucket 1: `v`, 1600 bytes (less than CAP minus the canary)."""


# ---------------------------------------------------------------- shared pieces

def weights(seed: int, shapes: dict[str, list[int]] = SHAPES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                          .tobytes()).hexdigest()


def digests(named: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: digest(t) for n, t in named.items()}


def make_cfg(world_size: int = 2, **kw) -> dict:
    return dict(control_port=free_port(), group_port=free_port(), world_size=world_size,
                bucket_bytes=CAP, timeout_s=TIMEOUT, secret=SECRET, **kw)


def receiver_proc(cfg: dict, rank: int, shapes: dict, updates: int, done=None,
                  require_checksums: bool = True, kill_receive_process: bool = False
                  ) -> list[dict]:
    """A receiver loading into a torch module that starts with `weights(0)`; per update: its
    summary, how long `receive()` took, the loader's calls, the module's digests, its state.
    `kill_receive_process`: its first load SIGKILLs the receive process (`receive_process`)."""
    from vllm_nccl_sync.engine.loaders import ModuleLoader
    from vllm_nccl_sync.engine.receiver import Receiver

    model = torch.nn.Module()
    for n, t in weights(0, shapes).items():
        model.register_parameter(n, torch.nn.Parameter(t))

    class ProbeLoader(ModuleLoader):
        def begin(self):
            calls.append("begin")
            super().begin()

        def load(self, named):
            calls.append(("load", sorted(n for n, _ in named)))
            if kill_receive_process and not killed:
                killed.append(rx.plane.transports[0].child_pid)
                os.kill(killed[0], signal.SIGKILL)
            return super().load(named)

        def finish(self):
            calls.append("finish")

        def abort(self):
            calls.append("abort")

    killed: list[int] = []
    loader = ProbeLoader(model)
    rx = Receiver(SyncConfig(**cfg), rank, require_checksums=require_checksums)
    out = []
    try:
        for _ in range(updates):
            calls: list = []
            t0 = time.monotonic()
            summary = rx.receive(loader, timeout_s=3 * TIMEOUT)  # the trainer starts at once
            out.append({"summary": summary, "seconds": time.monotonic() - t0, "calls": calls,
                        "digests": digests(dict(model.named_parameters())),
                        "state": {"version": rx.state.version,
                                  "consistent": rx.state.consistent},
                        "pid": os.getpid()})
    finally:
        if done is not None:
            done.set()
    rx.close()
    return out


@contextlib.contextmanager
def in_background(calls, allow_killed=frozenset()):
    """`run_procs(calls)` in a thread (the test meanwhile plays the trainer); yields its future."""
    pool = ThreadPoolExecutor(1)
    try:
        yield pool.submit(run_procs, calls, DEADLINE, allow_killed)
    finally:
        pool.shutdown(wait=True)  # bounded: run_procs kills what outlives its deadline


class HandTrainer:
    """The test as rank 0: a real `SenderChannel` and a real gloo `Transport`, driving the
    protocol by hand so that it can break it on purpose."""

    def __init__(self, cfg: dict, procs: Future) -> None:
        self.cfg = SyncConfig(**cfg)
        self.procs = procs
        self.ch = SenderChannel(self.cfg.host, self.cfg.control_port, self.cfg.secret_bytes)
        self.tx: Transport | None = None
        self.buf = torch.zeros(CAP, dtype=torch.uint8)

    def recv(self, timeout_s: float = 3 * TIMEOUT):
        """The next message from rank 1 (fails fast if the receiver process ended)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                rank, msg = self.ch.recv(min(deadline, time.monotonic() + 0.5))
            except TimeoutError:
                if self.procs.done():
                    self.procs.result()  # raises the remote traceback
                    pytest.fail("the receiver process ended while the trainer waited for it")
                if time.monotonic() > deadline:
                    raise
                continue
            assert rank == 1, (rank, msg)
            return msg

    def join(self) -> None:
        assert isinstance(self.recv(DEADLINE / 2), Hello)
        self.tx = open_transport(self.cfg, 0)  # the receiver joins the group right after its Hello

    def plan(self, version: int, buckets: list, staged: bool) -> None:
        """Open an update with every header in the plan; the answer must be one `Ready` for
        them all; then one `Go` covers them."""
        headers = [b.header(version, k, k == len(buckets) - 1, P, staged=staged)
                   for k, b in enumerate(buckets)]
        self.ch.send(1, Plan(P, version, [], buckets=headers, staged=staged))
        got = self.recv()
        assert got == Ready(P, 1, len(buckets) - 1, version), got
        self.ch.send(1, Go(P, version, len(buckets) - 1))

    def bucket(self, version: int, seq: int, digest_: int, wire: torch.Tensor) -> None:
        """Broadcast bucket `seq`, then its `Digest`."""
        self.tx.broadcast(wire).wait()
        self.ch.send(1, Digest(P, version, seq, digest_))

    def error(self, version: int) -> str:
        """The receiver's `Error` for `version` (what a real trainer would hear)."""
        got = self.recv()
        assert isinstance(got, Error) and got.version == version, got
        return got.message

    def good_update(self, version: int, named: dict[str, torch.Tensor]) -> list[Ack]:
        """A correct in-place update, sealed and committed."""
        buckets = list(plan_buckets(named.items(), CAP))
        sums = []
        self.plan(version, buckets, False)
        for k, b in enumerate(buckets):
            wire = pack(b, self.buf)
            sums.append(checksum(wire))
            self.bucket(version, k, sums[-1], wire)
        self.ch.send(1, Seal(P, version, len(buckets), sums))
        ack = self.recv()
        assert isinstance(ack, Ack) and ack.version == version and ack.phase == 1, ack
        self.ch.send(1, Commit(P, version, 1))
        return [ack]

    def close(self) -> None:
        if self.tx is not None:
            self.tx.close()
        self.ch.close()


def unchanged(upd: dict, version: int, consistent: bool) -> None:
    """A refused update: ok False, nothing loaded, the module as it was, version not stamped."""
    s = upd["summary"]
    assert not s["ok"], s
    assert upd["calls"] == [], upd["calls"]  # the loader never saw a byte of it
    assert upd["digests"] == digests(weights(0)), "the module changed"
    assert s["version"] == upd["state"]["version"] == version, s
    assert s["consistent"] == upd["state"]["consistent"] == consistent, s


def loaded(upd: dict, version: int, seed: int) -> None:
    s = upd["summary"]
    assert s["ok"] and s["version"] == version and s["consistent"], s
    assert upd["digests"] == digests(weights(seed))


# ---------------------------------------------------------------- 1. oversized control frame

@pytest.mark.multiproc
@pytest.mark.parametrize("size, staged", [
    (MAX_FRAME_BYTES + 1, False),  # reaches the channel, which drops it: the wait goes on
    (MAX_WIRE_BYTES + 1, True),  # over ZeroMQ's MAXMSGSIZE: libzmq drops the connection for good
], ids=["over-frame-limit-in-place", "over-wire-limit-staged"])
def test_oversized_control_frame_mid_update(size, staged):
    """Where Digest(1) belongs, the trainer sends one frame over the limit: `receive()` ends (ok
    False) within its bounds naming it, never blocked on reporting its Error; bucket 1 is never
    loaded; the module is unchanged (staged) or reported inconsistent (in place)."""
    cfg = make_cfg()
    updates = 2 if size <= MAX_WIRE_BYTES else 1  # a dropped connection stays dropped
    with in_background([(receiver_proc, (cfg, 1, SHAPES, updates))]) as procs:
        tr = HandTrainer(cfg, procs)
        try:
            tr.join()
            w = weights(1)
            b0, b1 = plan_buckets(w.items(), CAP)
            tr.plan(1, [b0, b1], staged)
            wire = pack(b0, tr.buf)
            tr.bucket(1, 0, checksum(wire), wire)
            tr.tx.broadcast(pack(b1, tr.buf)).wait()
            # Where Digest(1) belongs: one frame over the limit (MAC'd, counted: only its size
            # is bad).
            tr.ch._send_payload(1, b"\x00" * size)
            if updates == 2:
                text = tr.error(1)  # the connection lives: the trainer hears why
                assert re.search(r"no control message .* \(1 oversized frame", text), text
                tr.ch.send(1, Abort(P, 1, 1, "the test's trainer gives update 1 up"))
                tr.good_update(2, weights(2))
            results = procs.result(timeout=DEADLINE)[0]
        finally:
            tr.close()
    first = results[0]
    s = first["summary"]
    # Bounded: every wait is at most TIMEOUT, the report of the error at most 5 s more.
    assert first["seconds"] < 2 * TIMEOUT + 10, first["seconds"]
    if size <= MAX_WIRE_BYTES:
        assert re.search(r"no control message from the sender within .*1 oversized frame\(s\) "
                         r"dropped meanwhile, last oversized from", s["error"]), s
    else:
        # Mid-update, a dropped connection ends the wait at once, naming why.
        assert re.search(r"the connection to the trainer was dropped \(a control frame over the "
                         rf"{MAX_WIRE_BYTES}-byte limit", s["error"]), s
    assert not s["ok"] and s["version"] == -1, s
    assert not any(isinstance(c, tuple) and "v" in c[1] for c in first["calls"])  # no Digest(1)
    if staged:  # nothing was loaded anywhere: the model is the old one and says so
        unchanged(first, -1, consistent=True)
    else:  # bucket 0 may have been loaded somewhere: inconsistent (and never a third content)
        assert not s["consistent"] and not first["state"]["consistent"], s
        assert first["digests"]["v"] == digests(weights(0))["v"]
        assert first["digests"]["w"] in (digests(weights(0))["w"], digests(weights(1))["w"])
    if updates == 2:  # the receiver and its group go on working
        loaded(results[1], 2, seed=2)


# ---------------------------------------------------------------- 2-4. broken buckets

def _hostile_bucket(tr: HandTrainer, version: int, staged: bool, case: str) -> None:
    """One single-bucket update of `w` (800 bytes) that breaks the protocol as `case` says."""
    [b] = plan_buckets([("w", weights(version)["w"])], CAP)
    assert b.length == 800
    tr.plan(version, [b], staged)
    wire = pack(b, tr.buf)
    real = checksum(wire)
    if case == "short":  # announce 800, broadcast 64
        tr.bucket(version, 0, real, tr.buf[:64])
    elif case == "long":  # announce 800, broadcast 1600 (< CAP): the first 800 bytes are right
        tr.buf[800:1600].copy_(torch.randint(0, 256, (800,), dtype=torch.uint8))
        tr.bucket(version, 0, real, tr.buf[:1600])
    elif case == "no-checksum":
        tr.bucket(version, 0, 0, wire)
    else:
        raise ValueError(case)
    tr.ch.send(1, Seal(P, version, 1, [real]))  # a seal that would vouch for the right bytes


@pytest.mark.multiproc
@pytest.mark.parametrize("case, match", [
    ("short", r"rank 1: bucket 0 arrived corrupted or short: its checksum does not match the "
              r"sender's; not loaded"),
    ("long", r"rank 1: bucket 0 broadcast more bytes than its header's length 800; not loaded"),
    ("no-checksum", r"rank 1: Digest for bucket 0 carries no checksum, and this receiver "
                    r"requires one .*; not loaded"),
])
def test_broken_bucket_is_refused_and_never_loaded(case, match):
    """Staged, then in place, the same broken bucket; then a good update over the same group
    (the receiver process survived, and the group is still in step)."""
    cfg = make_cfg()
    with in_background([(receiver_proc, (cfg, 1, SHAPES, 3))]) as procs:
        tr = HandTrainer(cfg, procs)
        try:
            tr.join()
            heard = []
            for version, staged in ((1, True), (2, False)):
                _hostile_bucket(tr, version, staged, case)
                heard.append(tr.error(version))
                tr.ch.send(1, Abort(P, version, 1, "the test's trainer gives the update up"))
            tr.good_update(3, weights(3))
            results = procs.result(timeout=DEADLINE)[0]
        finally:
            tr.close()
    for text in heard:  # the trainer hears the reason too, never a checksum of the receiver's
        assert re.search(match, text) and not re.search(r"0x[0-9a-f]+", text), text
    staged_upd, in_place, good = results
    for upd in (staged_upd, in_place):
        assert re.search(match, upd["summary"]["error"]), upd["summary"]
        assert upd["seconds"] < 2 * TIMEOUT, upd["seconds"]
    unchanged(staged_upd, -1, consistent=True)  # staged: no worker loads before the commit
    unchanged(in_place, -1, consistent=False)  # in place: another worker might have loaded
    loaded(good, 3, seed=3)


# ---------------------------------------------------------------- 5. a dead rank below live ones

SHAPES5 = {f"p{i}": [512] for i in range(4)}
"""Four full buckets of CAP bytes (no room for a canary: see `test_three_receivers...` for
buckets shorter than the capacity)."""


def push_proc(cfg: dict, shapes: dict, staged: bool, done: list) -> dict:
    """The real trainer: one push; reports how it failed. Keeps its sockets open until the live
    receivers are done (closing at once could drop a queued Abort: LINGER is 0)."""
    from vllm_nccl_sync import PushClient
    from vllm_nccl_sync.trainer.push import PushError

    client = PushClient(SyncConfig(**cfg))
    client.connect()
    t0 = time.monotonic()
    try:
        res = client.push(weights(1, shapes), version=1, staged=staged)
        out = {"raised": None, "acks": sorted(a.rank for a in res.acks)}
    except Exception as e:  # noqa: BLE001 - reported to the test
        out = {"raised": f"{type(e).__module__}.{type(e).__name__}",
               "push_error": isinstance(e, PushError), "message": str(e),
               "missing": getattr(e, "missing", None), "errors": getattr(e, "errors", None)}
    out["seconds"] = time.monotonic() - t0
    for ev in done:
        ev.wait(DEADLINE / 2)
    client.close()
    return out


def dying_receiver(cfg: dict, rank: int, where: str) -> None:
    """A receiver that SIGKILLs itself as it posts its second broadcast (`where="broadcast"`) or
    as it checks the sender's Seal, every collective done (`where="seal"`)."""
    from vllm_nccl_sync.engine.loaders import ModuleLoader
    from vllm_nccl_sync.engine.receiver import Receiver

    def die(*a, **kw):
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "broadcast":
        real, calls = Transport.broadcast, []

        def broadcast_then_die(self, tensor, src=0, **kw):
            calls.append(1)
            if len(calls) == 2:
                die()
            return real(self, tensor, src, **kw)

        Transport.broadcast = broadcast_then_die
    else:
        Receiver._verify = die
    module = torch.nn.Module()
    for n, t in weights(0, SHAPES5).items():
        module.register_parameter(n, torch.nn.Parameter(t))
    Receiver(SyncConfig(**cfg), rank).receive(ModuleLoader(module), timeout_s=3 * TIMEOUT)
    raise AssertionError(f"rank {rank} should have died at its {where}")


@pytest.mark.multiproc
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
@pytest.mark.parametrize("where", ["broadcast", "seal"])
def test_dead_rank_below_live_ones(where, staged):
    """Trainer + 3 receivers; rank 1 is SIGKILLed mid-update. Ranks 2 and 3 end their update
    (ok False) within bounds, the trainer raises a `PushError` naming rank 1, and no live rank
    holds anything it does not report. Every bucket was agreed before the first byte moved, so
    the trainer still feeds ranks 2 and 3 every bucket: in place they hold all of it, reported
    inconsistent (not committed)."""
    import multiprocessing as mp

    cfg = make_cfg(world_size=4)
    assert all(b.length == CAP for b in plan_buckets(weights(1, SHAPES5).items(), CAP))
    ctx = mp.get_context("spawn")
    done = [ctx.Event(), ctx.Event()]
    trainer, dead, *live = run_procs(
        [(push_proc, (cfg, SHAPES5, staged, done)), (dying_receiver, (cfg, 1, where))]
        + [(receiver_proc, (cfg, r, SHAPES5, 1, done[r - 2])) for r in (2, 3)],
        DEADLINE, allow_killed={1},
    )
    assert dead is None  # rank 1 was killed, as planned
    # The trainer: a PushError (never a raw ZeroMQ or gloo error) naming rank 1.
    assert trainer["raised"] and trainer["push_error"], trainer
    assert 1 in (trainer["missing"] or []) or 1 in (trainer["errors"] or {}), trainer
    assert re.search(r"\branks? \[?1\b", trainer["message"]), trainer
    assert trainer["seconds"] < 3 * TIMEOUT, trainer
    old, new = digests(weights(0, SHAPES5)), digests(weights(1, SHAPES5))
    for rank, [upd] in zip((2, 3), live, strict=True):
        s = upd["summary"]
        assert not s["ok"] and s["version"] == -1, (rank, s)
        assert upd["seconds"] < 3 * TIMEOUT, (rank, upd["seconds"])
        assert "more bytes" not in s["error"], (rank, s)  # nobody broadcast more than announced
        heard_abort = re.search(r"sender aborted update 1 (at bucket \d+|in the commit round)",
                                s["error"])
        # The trainer feeds every receiver directly (point to point on gloo): whatever rank 1
        # did, ranks 2 and 3 must hear the Abort although the trainer cannot reach rank 1.
        assert heard_abort, (rank, s)
        if staged:  # nothing loaded before the commit: old weights, and consistent
            assert upd["calls"] == [] and upd["digests"] == old, (rank, upd["calls"])
            assert s["consistent"] and upd["state"]["consistent"], (rank, s)
        else:  # buckets were loaded in place: a mix (or all new), reported as such
            assert not s["consistent"] and not upd["state"]["consistent"], (rank, s)
            assert upd["digests"] == new, rank  # all arrived, verified and loaded; not committed


@pytest.mark.multiproc
def test_three_receivers_take_buckets_shorter_than_the_capacity():
    """A plain good update, trainer + 3 receivers, with buckets shorter than the capacity (where
    gloo receivers post their whole buffer behind a canary). gloo's broadcast is a tree: rank 3
    gets its bytes from rank 1, which forwards the whole buffer it posted."""
    shapes = {"w": [200], "v": [400], "u": [100]}
    cfg = make_cfg(world_size=4)
    assert any(b.length < CAP for b in plan_buckets(weights(1, shapes).items(), CAP))
    trainer, *receivers = run_procs(
        [(push_proc, (cfg, shapes, False, []))]
        + [(receiver_proc, (cfg, r, shapes, 1)) for r in (1, 2, 3)], DEADLINE)
    errors = {r: upd["summary"].get("error") for r, [upd] in zip((1, 2, 3), receivers)
              if not upd["summary"]["ok"]}
    assert not errors and trainer["raised"] is None, (errors, trainer)
    assert trainer["acks"] == [1, 2, 3]
    for [upd] in receivers:
        assert upd["digests"] == digests(weights(1, shapes))


# ---------------------------------------------------------------- 5b. a receive process

@pytest.mark.multiproc
def test_a_broadcast_over_the_whole_buffer_ends_the_receive_process_not_the_receiver():
    """With `receive_process`, a sender broadcasting more than the receiver's whole buffer
    (which aborts a process receiving over gloo) ends the receive process only: the receiver
    reports it within its bounds, naming the abort, with nothing of the update loaded (the
    module holds update 1's weights, staged: consistent), and leaves normally."""
    cfg = make_cfg(receive_process=True)
    with in_background([(receiver_proc, (cfg, 1, SHAPES, 2))]) as procs:
        tr = HandTrainer(cfg, procs)
        try:
            tr.join()
            tr.good_update(1, weights(1))  # the receive process works
            [b] = plan_buckets([("w", weights(2)["w"])], CAP)
            tr.plan(2, [b], staged=True)
            with contextlib.suppress(RuntimeError):  # the receiving end dies mid-send
                tr.tx.broadcast(torch.ones(4 * CAP, dtype=torch.uint8)).wait()
            heard = tr.error(2)  # the receiver's last update: it ends on its own
            results = procs.result(timeout=DEADLINE)[0]
        finally:
            tr.close()
    first, second = results
    loaded(first, 1, seed=1)
    s = second["summary"]
    assert not s["ok"] and re.search(r"receive process ended during .*SIGABRT.*a sender sent "
                                     r"more than this receiver's bucket holds", s["error"]), s
    assert "SIGABRT" in heard, heard
    assert second["calls"] == [] and second["digests"] == digests(weights(1)), second["calls"]
    assert s["consistent"] and second["state"] == {"version": 1, "consistent": True}, s
    assert second["seconds"] < 2 * TIMEOUT, second["seconds"]


@pytest.mark.multiproc
def test_a_receive_process_killed_mid_update_fails_it_at_once():
    """The receive process SIGKILLed while bucket 0 loads (in place): the wait for bucket 1
    ends at once naming the kill (well before gloo's timeout, the only other end of it), bucket
    1 is never loaded, and the module is reported inconsistent (bucket 0's tensor new, bucket
    1's old)."""
    cfg = make_cfg(receive_process=True)
    kill = (cfg, 1, SHAPES, 1, None, True, True)  # kill_receive_process
    with in_background([(receiver_proc, kill)]) as procs:
        tr = HandTrainer(cfg, procs)
        try:
            tr.join()
            w = weights(1)
            b0, b1 = plan_buckets(w.items(), CAP)
            tr.plan(1, [b0, b1], staged=False)
            wire = pack(b0, tr.buf)
            tr.bucket(1, 0, checksum(wire), wire)  # bucket 1 is never sent: only the kill can
            heard = tr.error(1)  # end the wait for it before gloo's own timeout
            [upd] = procs.result(timeout=DEADLINE)[0]
        finally:
            tr.close()
    s = upd["summary"]
    assert not s["ok"] and re.search(r"receive process ended during .*SIGKILL", s["error"]), s
    assert "SIGKILL" in heard, heard
    assert upd["calls"] == ["begin", ("load", ["w"]), "abort"], upd["calls"]
    assert upd["digests"] == {"w": digests(w)["w"], "v": digests(weights(0))["v"]}
    assert not s["consistent"] and not upd["state"]["consistent"], s
    assert upd["seconds"] < TIMEOUT, upd["seconds"]


# ---------------------------------------------------------------- 6. one vLLM worker fails

MAX_TOKENS = 6


def _generate(llm) -> list[list[int]]:
    from vllm_nccl_sync.tiny import PROMPTS, vllm_greedy

    return vllm_greedy(llm, PROMPTS, MAX_TOKENS)


def _hf(seed: int) -> list[list[int]]:
    from vllm_nccl_sync.tiny import PROMPTS, build_model, hf_greedy

    return hf_greedy(build_model("qwen2", seed), PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """A vLLM CPU engine with tensor parallelism 2 and the fault extension, joined to a
    `WeightSync`."""
    from vllm import LLM

    from vllm_nccl_sync.integrations.vllm.handles import LLMHandle
    from vllm_nccl_sync.tiny import engine_kwargs, make_model
    from vllm_nccl_sync.trainer.sync import WeightSync

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        path = make_model(str(tmp_path_factory.mktemp("hostile")), "qwen2", seed=1)
        llm = LLM(model=path, worker_extension_cls="tests.fault_ext.FaultExt",
                  **engine_kwargs(tensor_parallel_size=2))
        sync = WeightSync([LLMHandle(llm)], bucket_bytes=256 * 1024, timeout_s=60)
        try:
            [workers] = sync.connect()
            assert sorted((w["rank"], w["tp_rank"]) for w in workers) == [(1, 0), (2, 1)]
            yield llm, sync
        finally:
            sync.close()
            llm.llm_engine.engine_core.shutdown()


def _update(sync, version: int, *, staged: bool = False):
    """`sync.update(weights of seed `version`)`; staged through the same steps by hand where
    `WeightSync.update` has no `staged` parameter."""
    from vllm_nccl_sync.tiny import build_model
    from vllm_nccl_sync.trainer.push import PushError

    sd = build_model("qwen2", version).state_dict()
    if not staged:
        return sync.update(sd, version)
    if "staged" in inspect.signature(sync.update).parameters:
        return sync.update(sd, version, staged=True)
    [engine] = sync.engines
    fut = sync._pool.submit(engine.call, "nccl_sync_receive", sync.cfg.timeout_s,
                            timeout=sync.cfg.timeout_s * 3)
    error = result = None
    try:
        result = sync.client.push(sd, version, staged=True)
    except PushError as e:
        error = e
    finally:
        summaries = fut.result(timeout=sync.cfg.timeout_s * 3)
        engine.resume()  # the prefix cache holds KV of the old weights
    failed = [s for s in summaries if not s.get("ok")]
    if error is not None or failed:
        detail = "; ".join(f"rank {s.get('rank')}: {s.get('error')}" for s in failed)
        raise PushError(f"update {version} failed: {error or ''} {detail}".strip())
    return result


def _states(sync) -> list[dict]:
    [workers] = sync.state()
    return sorted(workers, key=lambda w: w["rank"])


def _arm(llm, where: str) -> None:
    got = sorted((r["tp_rank"], r["armed"]) for r in llm.collective_rpc("nccl_test_arm",
                                                                         args=(where,)))
    assert got == [(0, ""), (1, where)], got


def _good(llm, sync, version: int, *, staged: bool = False) -> list[list[int]]:
    _arm(llm, "")
    _update(sync, version, staged=staged)
    states = _states(sync)
    assert [(w["version"], w["consistent"]) for w in states] == [(version, True)] * 2, states
    want = _hf(version)
    assert _generate(llm) == want
    return want


def _fails(llm, sync, version: int, where: str, *, staged: bool) -> str:
    from tests.fault_ext import INJECTED
    from vllm_nccl_sync.trainer.push import PushError

    _arm(llm, where)
    with pytest.raises(PushError) as e:
        _update(sync, version, staged=staged)
    _arm(llm, "")
    text = str(e.value)
    assert INJECTED in text and re.search(r"\brank 2\b", text), text  # tp rank 1 = rank 2
    return text


def _never_mixed_and_consistent(states: list[dict]) -> None:
    if any(w["consistent"] for w in states):  # a consistent worker's peers hold its version
        assert all(w["consistent"] for w in states), states
        assert len({w["version"] for w in states}) == 1, states


@pytest.mark.vllm
def test_tp2_one_worker_fails_in_place(tp2):
    """Worker 1's `finish()` fails after the last bucket: both workers report inconsistent (worker
    0 loaded everything), the version is not stamped; a good update restores both."""
    llm, sync = tp2
    before = _states(sync)
    _fails(llm, sync, 7, "finish", staged=False)
    states = _states(sync)
    assert [w["version"] for w in states] == [w["version"] for w in before], states
    assert [w["consistent"] for w in states] == [False, False], states
    assert all(w["failures"] == b["failures"] + 1 for w, b in zip(states, before)), states
    _never_mixed_and_consistent(states)
    assert len(_generate(llm)) == 5  # still serving
    _good(llm, sync, 8)


@pytest.mark.vllm
def test_tp2_one_worker_fails_staged(tp2):
    """Staged: worker 1 failing before the commit (its check of the seal) leaves both workers on
    the old weights, consistent; worker 1 failing in its staged load (after worker 0 loaded)
    leaves both inconsistent. The engine serves throughout; a good update restores it."""
    llm, sync = tp2
    want = _good(llm, sync, 10, staged=True)
    assert _hf(11) != want  # else "the output did not change" would prove nothing
    _fails(llm, sync, 11, "verify", staged=True)
    states = _states(sync)
    assert [(w["version"], w["consistent"]) for w in states] == [(10, True)] * 2, states
    assert _generate(llm) == want  # nothing of update 11 reached either worker
    _fails(llm, sync, 12, "load", staged=True)
    states = _states(sync)
    assert [(w["version"], w["consistent"]) for w in states] == [(10, False)] * 2, states
    _never_mixed_and_consistent(states)
    assert len(_generate(llm)) == 5  # still serving (a mix: no output is promised)
    _good(llm, sync, 13, staged=True)
