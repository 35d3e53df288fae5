"""Receiving beside serving, on the one engine session (CPU, gloo, real ZeroMQ sockets).

A torch module stands in for the engine's model (the vLLM engine's own test is
`test_serving_beside.py`); `WeightSync` drives it through an in-process handle. The promises: the
live weights stay the old ones until the swap, and the swap happens only after every worker
verified everything, with the engine paused; a plan that is not staged, or whose shadow does not
fit, is refused before a byte moves; a failure before the swap leaves the weights and the version
untouched, and says so.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.procs import wait_until
from tests.session_engine import SessionEngine, driven, same
from vllm_nccl_sync import PushError, UpdateRefused, WeightSync
from vllm_nccl_sync.engine.commit import CommitRound
from vllm_nccl_sync.engine.loaders import ModuleLoader
from vllm_nccl_sync.engine.session import Placement
from vllm_nccl_sync.engine.shadow import Shadow

TIMEOUT = 20.0  # a bound on every wait, never a speed requirement


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(300, 64, generator=g),  # larger than one bucket
            "norm.weight": torch.randn(33, generator=g), "steps": torch.arange(5.0)}


def make_model() -> torch.nn.Module:
    m = torch.nn.Module()
    for n, t in tensors(0).items():
        m.register_parameter(n.replace(".", "_"), torch.nn.Parameter(t.clone(), False))
    return m


class Loader(ModuleLoader):
    """`ModuleLoader` under the tensors' dotted names."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.targets = {n.replace("_", ".", 1): t for n, t in self.targets.items()}


class LocalEngine(SessionEngine):
    """An in-process engine of one worker. `pause` records what the worker reported and held
    when it was called."""

    def __init__(self) -> None:
        super().__init__(make_model(), Loader)
        self.events: list[tuple[str, Any]] = []

    def held(self) -> dict[str, torch.Tensor]:
        return {n.replace("_", ".", 1): p.detach().clone() for n, p in self.model.named_parameters()}

    def pause(self, mode: str) -> None:
        self.events.append(("pause", (mode, self.session.report()["beside"], self.held())))

    def resume(self) -> None:
        self.events.append(("resume", self.session.report()["version"]))


@pytest.fixture
def engine():
    e = LocalEngine()
    with driven(e, TIMEOUT) as sync:
        yield e, sync


def test_the_weights_change_only_at_the_swap_after_everything_verified(engine):
    e, sync = engine
    before, ptrs = e.held(), e.session.param_ptrs()
    during: list[tuple[str, bool]] = []

    def progress(buckets: int, nbytes: int, seconds: float) -> None:  # mid-push
        during.append((e.session.report()["beside"], same(e.held(), before)))

    result = sync.update(tensors(1), 1, beside=True, pause_mode="keep", progress=progress)
    assert result.version == 1 and result.buckets > 2
    assert during and all(d == ("receiving", True) for d in during), during
    (kind, (mode, stage, held)), resumed = e.events
    # Paused once every worker verified (the worker may still be taking the first Commit).
    assert kind == "pause" and mode == "keep" and stage in ("receiving", "ready")
    assert same(held, before)
    assert resumed == ("resume", 1)
    assert same(e.held(), tensors(1)) and e.session.param_ptrs() == ptrs  # in place
    report = e.session.report()
    assert report["version"] == 1 and report["consistent"] and report["beside"] == ""
    assert report["shadow_bytes"] >= sum(t.nbytes for t in tensors(1).values())
    # The shadow is kept: the next update reuses it.
    sync.update(tensors(2), 2, beside=True)
    assert same(e.held(), tensors(2)) and e.session.report()["shadow_bytes"] == \
        report["shadow_bytes"]


def test_carry_on_an_engine_that_cannot_swap_in_turn_swaps_under_a_keep_pause(engine):
    e, sync = engine
    with pytest.raises(ValueError, match="beside=True"):
        sync.update(tensors(1), 1, pause_mode="carry")
    before = e.held()
    sync.update(tensors(1), 1, beside=True, pause_mode="carry")
    (kind, (mode, _, held)), resumed = e.events  # the worker refused; then a keep pause
    assert (kind, mode) == ("pause", "keep") and same(held, before)
    assert resumed == ("resume", 1) and same(e.held(), tensors(1))
    assert e.session.report()["version"] == 1


def test_a_plan_that_is_not_staged_is_refused_before_a_byte_moves(engine):
    e, sync = engine
    assert e.session.receive_beside(TIMEOUT).ok
    with pytest.raises(UpdateRefused, match="must be staged"):
        sync.client.push(tensors(1), 1)
    out = e.session.swap(TIMEOUT)
    assert not out.ok and "must be staged" in out.error
    assert same(e.held(), tensors(0)) and e.session.report()["version"] == -1


def test_a_shadow_that_does_not_fit_is_refused_with_the_numbers(engine):
    e, sync = engine
    e.session._shadow = Shadow(torch.device("cpu"), "device", available=lambda d, p: 1000)
    with pytest.raises(UpdateRefused, match=r"shadow copy of the update \(0\.\d+ GB\).*0\.00 GB "
                                            r"is free.*shadow='host'") as err:
        sync.update(tensors(1), 1, beside=True)
    assert err.value.summaries and not err.value.summaries[0].ok
    assert same(e.held(), tensors(0)) and e.session.report()["consistent"]
    assert e.events == []  # never paused: nothing to swap


def test_a_failure_mid_receive_leaves_the_served_weights_and_version(engine):
    e, sync = engine
    sync.update(tensors(1), 1, beside=True)

    def stream():
        yield "embed.weight", tensors(2)["embed.weight"]
        raise RuntimeError("the trainer's gather failed")

    with pytest.raises(PushError, match="gather failed") as err:
        sync.update(stream(), 2, beside=True)
    assert same(e.held(), tensors(1))
    report = e.session.report()
    assert report["version"] == 1 and report["consistent"] and report["beside"] == ""
    assert [s.ok for s in err.value.summaries] == [False]
    assert [k for k, _ in e.events] == ["pause", "resume"]  # only the first update's swap
    sync.update(tensors(3), 3, beside=True)  # and the next one goes through
    assert same(e.held(), tensors(3))


def test_no_other_receive_or_join_while_one_runs_beside(engine):
    e, sync = engine
    assert e.session.receive_beside(TIMEOUT).ok
    s = e.session.receive(0.1)
    assert not s.ok and "beside serving" in s.error
    again = e.session.receive_beside(TIMEOUT)
    assert not again.ok and "beside serving" in again.error
    with pytest.raises(RuntimeError, match="beside serving"):
        e.session.join(sync.cfg, Placement(1), lambda: Loader(e.model))
    with pytest.raises(PushError, match="still receiving"):
        sync.update(tensors(1), 1, beside=True)
    e.session.close()  # cancels it: nothing loaded
    assert same(e.held(), tensors(0)) and e.session.report()["beside"] == ""


def test_a_swap_nobody_asks_for_ends_the_update_unloaded():
    e = LocalEngine()
    sync = WeightSync([e], backend="gloo", bucket_bytes=8192, timeout_s=2.0)
    sync.connect()
    try:
        assert e.session.receive_beside(2.0).ok
        with pytest.raises(PushError):
            sync.client.push(tensors(1), 1, staged=True)  # nobody swaps
        # the receive ends by itself (its gate's bound); a swap asked before then could race
        # the trainer's Abort, which may still be on its way
        wait_until(lambda: not e.session.report()["beside"], "the receive ending", 60)
        out = e.session.swap(30.0)
        assert not out.ok and "no swap was asked" in out.error, out
        assert same(e.held(), tensors(0)) and e.session.report()["version"] == -1
    finally:
        sync.close()


def test_a_streamed_update_lands_whole_through_the_shadow(engine):
    """A generator (no tensor list in the plan, so no arena is sized): each tensor gets room of
    its own; the one larger than a bucket arrives in chunks of rows."""
    e, sync = engine
    sync.update(((n, t) for n, t in tensors(4).items()), 4, beside=True)
    assert same(e.held(), tensors(4)) and e.session.report()["version"] == 4


class OpeningEngine(LocalEngine):
    """Swaps as vLLM's patched engine core does for a carry: the swap begun (`open_swap`), the
    turn's own work (here: what the worker had reached), then the swap's end."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: list[tuple[set[str], dict[str, torch.Tensor]]] = []

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        if method == "nccl_sync_swap":
            self.session.open_swap(TIMEOUT)
            beside = self.session._beside
            self.opened.append((set(beside.marks) if beside else set(), self.held()))
        return super().call(method, *args, timeout=timeout)


def test_an_opened_swap_returns_with_its_loads_queued_and_its_end_still_waited_for():
    e = OpeningEngine()
    with driven(e, TIMEOUT) as sync:
        result = sync.update(tensors(1), 1, beside=True, pause_mode="keep")
        assert result.version == 1
        [(marks, held)] = e.opened
        # Open returned once the loads were queued (on the CPU: done), not before
        assert {"swap", "begun", "copied", "loaded"} <= marks and same(held, tensors(1))
        assert same(e.held(), tensors(1)) and e.session.report()["version"] == 1
        # A swap whose loads fail (a shape the model does not have: found by the loader, in
        # the swap): open returns at the receive's end instead, which reports the failure
        e.opened.clear()
        bad = dict(tensors(2), **{"norm.weight": torch.randn(34)})
        with pytest.raises(PushError, match="norm.weight"):
            sync.update(bad, 2, beside=True, pause_mode="keep")
        [(marks, _)] = e.opened
        assert {"swap", "begun", "end"} <= marks and "loaded" not in marks, marks
        assert not e.session.report()["consistent"]  # the swap had begun writing


def test_the_swaps_commit_round_runs_while_it_copies_and_a_copy_failing_after_it_is_reported(
        engine, monkeypatch):
    """`Ack(2)` goes out once the swap's copies are queued; the copies are waited for (bounded)
    before `Commit(2)` is taken. A wait that fails after that `Ack` fails the update, which the
    worker reports inconsistent even if the sender committed meanwhile."""
    e, sync = engine
    calls: list[str] = []
    fail = []
    ack, settle = CommitRound._ack, Shadow.settle

    def acking(self, phase: int, u: Any) -> None:
        calls.append(f"ack{phase}")
        ack(self, phase, u)

    def settling(self) -> None:
        calls.append("settle")
        if fail and calls[-2:] == ["ack2", "settle"]:
            raise RuntimeError("the device's copy failed")
        settle(self)

    monkeypatch.setattr(CommitRound, "_ack", acking)
    monkeypatch.setattr(Shadow, "settle", settling)
    sync.update(tensors(1), 1, beside=True)
    # the gate's wait (the shadow received), then the swap's copies: waited for after Ack(2)
    assert calls == ["ack1", "settle", "ack2", "settle"], calls
    assert same(e.held(), tensors(1)) and e.session.report()["version"] == 1
    fail.append(True)
    with pytest.raises(PushError, match="copy failed") as err:
        sync.update(tensors(2), 2, beside=True)
    assert [s.ok for s in err.value.summaries] == [False]
    report = e.session.report()
    assert not report["consistent"] and report["version"] == 1  # it had begun writing
    fail.clear()
    sync.update(tensors(3), 3, beside=True)  # the next update puts it right
    assert same(e.held(), tensors(3)) and e.session.report()["consistent"]
