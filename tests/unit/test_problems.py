"""Failures as values: what a receiver's checks return (`outcomes.Problem`), and the one place a
problem becomes an exception (`Problem.error`)."""

from __future__ import annotations

import pytest
import torch

from vllm_nccl_sync.engine.dataplane import digest_problem, seal_problem
from vllm_nccl_sync.engine.handshake import Reference
from vllm_nccl_sync.engine.residency import Residency
from vllm_nccl_sync.engine.shadow import Shadow
from vllm_nccl_sync.engine.update import Update, plan_problem
from vllm_nccl_sync.outcomes import (
    Kind,
    NotUpdatable,
    Problem,
    ProtocolError,
    SyncError,
    UpdateFailed,
)
from vllm_nccl_sync.planes.ipc import IpcMemory, open_shared
from vllm_nccl_sync.wire.protocol import PROTOCOL_VERSION as P
from vllm_nccl_sync.wire.protocol import BucketHeader, Plan, Seal, Slot, TensorSpec

W = "model.layers.0.mlp.down_proj.weight"
REF = Reference({W: ("float32", [8, 4])})


def _plan(version: int = 3, shape: tuple[int, ...] = (8, 4), **kw) -> Plan:
    return Plan(P, version, [TensorSpec(W, "float32", list(shape))], **kw)


def _header(seq: int = 0, shape: tuple[int, ...] = (8, 4), is_last: bool = True,
            **kw) -> BucketHeader:
    nbytes = 4 * shape[0] * shape[1]
    return BucketHeader(P, 3, seq, nbytes, is_last,
                        [Slot(W, "float32", list(shape), 0, nbytes)], **kw)


def test_each_kind_raises_as_its_one_exception_class():
    """A forged CUDA IPC handle breaks the protocol (`ProtocolError`, still a `ValueError`); an
    engine with a drafter cannot be updated in place (`NotUpdatable`, still the `ValueError` it
    always raised); every other kind fails the update on this side (`UpdateFailed`, which a
    receiver's update ends cleanly on). Every one is a `SyncError` carrying the problem's text
    exactly."""
    for kind in Kind:
        err = Problem(kind, f"rank 1: {kind.value} went wrong").error()
        assert isinstance(err, SyncError) and str(err) == f"rank 1: {kind.value} went wrong"
        if kind is Kind.HANDLE:
            assert type(err) is ProtocolError and isinstance(err, ValueError)
        elif kind is Kind.DRAFTER:
            assert type(err) is NotUpdatable and isinstance(err, ValueError)
        else:
            assert type(err) is UpdateFailed and isinstance(err, RuntimeError), kind


def test_no_problem_is_none_and_never_an_error():
    """A check that finds nothing returns None (not an empty text); a `Problem` always has a
    text, so it is always true and `a or b` chains of checks stop at the first one."""
    with pytest.raises(ValueError, match="needs a text"):
        Problem(Kind.SEAL, "")
    assert Problem(Kind.SEAL, "x")
    assert plan_problem(_plan(), 1, 2, REF, False) is None
    assert seal_problem(1, 3, Seal(P, 3, 1, [7]), [7], True) is None
    assert digest_problem(1, 0, 7, 7, True) is None
    u = Update(1, 1 << 20, version=3)
    assert u.residency_problem(_plan(), None, REF) is None
    assert u.residency_problem(_plan(), lambda: Residency(), REF) is None  # awake, intact
    assert u.open(_plan(buckets=[_header()]), REF) is None and u.failed is None
    assert REF.problems([TensorSpec(W, "float32", [8, 4])]) == []


def test_plan_checks_tell_a_stale_plan_from_one_the_model_refuses():
    """The same refusal, two kinds: a version already held is the plan's own problem; a tensor
    that does not fit the engine's model is the model's. The text is what the sender hears."""
    stale = plan_problem(_plan(version=2), 1, 2, REF, False)
    assert stale is not None and stale.kind is Kind.PLAN
    assert stale.text.startswith("rank 1 refused update 2:") and "force=True" in stale.text
    wrong = plan_problem(_plan(shape=(4, 8)), 1, 2, REF, False)
    assert wrong is not None and wrong.kind is Kind.MODEL
    assert wrong.text == (f"rank 1 refused update 3: tensor {W!r}: shape [4, 8] != engine's "
                          "[8, 4]")
    assert [p.kind for p in REF.problems([TensorSpec("junk", "float32", [1])])] == [Kind.MODEL]


def test_a_refused_header_is_the_updates_first_problem_with_its_kind():
    """A header against the protocol's rules is a `HEADER` problem, one against the model a
    `MODEL` problem; the first one refused stays the update's `failed`, and raises as the
    `UpdateFailed` the receiver ends the update with."""
    u = Update(1, 1 << 20, version=3)
    assert u.open(_plan(buckets=[_header(is_last=False)]), REF) is None
    refused = u.accept(_header(seq=1, staged=True))
    assert refused is not None and refused.kind is Kind.HEADER
    assert refused.text == "rank 1 rejected bucket 1: staged flag differs from the plan's"
    assert u.failed is refused and u.refused == 1
    assert u.accept(_header(seq=1)) is refused  # once failed, every later header gets the same
    model = Update(1, 1 << 20, version=3).open(_plan(shape=(4, 8), buckets=[_header()]), REF)
    assert model is not None and model.kind is Kind.HEADER  # not the plan's tensor
    bare = Update(1, 1 << 20, version=3)
    assert bare.open(Plan(P, 3, [], buckets=[_header(shape=(4, 8))]), REF).kind is Kind.MODEL
    with pytest.raises(UpdateFailed, match="staged flag differs"):
        raise u.failed.error()


def test_integrity_and_residency_checks_name_their_kind():
    """A bucket that arrived other than sent is a `DIGEST` or `SEAL` problem by where it was
    caught; an engine asleep refuses as `RESIDENCY`; a shadow that does not fit is `SHADOW`."""
    assert digest_problem(1, 0, 7, 8, True).kind is Kind.DIGEST
    assert digest_problem(1, 0, 7, 0, True).kind is Kind.DIGEST
    assert seal_problem(1, 3, Seal(P, 3, 2, [7, 8]), [7], True).kind is Kind.SEAL
    asleep = Residency()
    asleep.slept(1)
    problem = Update(1, 1 << 20, version=3).residency_problem(_plan(), lambda: asleep, REF)
    assert problem is not None and problem.kind is Kind.RESIDENCY
    assert problem.text.startswith("rank 1 refused update 3: ")
    shadow = Shadow(torch.device("cpu"), "host", available=lambda d, p: 0)
    tight = shadow.reserve(1 << 20)
    assert tight is not None and tight.kind is Kind.SHADOW
    assert tight.at("rank 1 refused update 3") == Problem(
        Kind.SHADOW, f"rank 1 refused update 3: {tight.text}")
    assert Shadow(torch.device("cpu"), "host", available=lambda d, p: 1 << 30).reserve(64) is None


def test_a_forged_ipc_reference_counter_raises_as_a_protocol_error():
    """The ipc plane's handle check returns a `HANDLE` problem, and mapping such a handle raises
    what that kind raises as, before PyTorch opens anything (so on any host)."""
    forged = IpcMemory("GPU-x", b"h" * 64, 4096, 0, b"/torch_4243_1_0", 0, b"", False)
    with pytest.raises(ProtocolError, match="not one the sender's process made: refused"):
        open_shared(forged, torch.device("cpu"), 0, "the trainer's buffers", 4242)


def test_trainer_checks_name_their_kind():
    """The trainer's own checks: peers that left the data plane are `LOST`; a sender's part of a
    multi-sender plan it does not hold is `MODEL`, flags other than the coordinator's `PLAN`."""
    from types import SimpleNamespace

    from vllm_nccl_sync.outcomes import PeerFailed
    from vllm_nccl_sync.trainer.lane import BucketLane
    from vllm_nccl_sync.trainer.multisend import PeerUpdate

    lane = SimpleNamespace(lost=[])
    assert BucketLane.lost_problem(lane, 1) == (None, [])
    lane.lost = [PeerFailed("gone", 2)]
    problem, left = BucketLane.lost_problem(lane, 1)
    assert problem.kind is Kind.LOST and left == [3]
    assert problem.text == "rank 3 left the data plane: gone"

    sender = SimpleNamespace(peer=SimpleNamespace(rank=1), caster=SimpleNamespace(dtype=None),
                             flags=(False, False, False), parts={})
    mine = [_header(src=1)]
    held = {W: torch.zeros(8, 4)}
    assert PeerUpdate._problem(sender, _plan(), mine, held) is None
    missing = PeerUpdate._problem(sender, _plan(), mine, {})
    assert missing.kind is Kind.MODEL and "sender 1 holds no such tensor" in missing.text
    flags = PeerUpdate._problem(sender, _plan(force=True), mine, held)
    assert flags.kind is Kind.PLAN and "force/staged/full=(False, False, False)" in flags.text


def test_an_engine_with_a_drafter_is_refused_as_a_value_error():
    """`drafter_problem` is a `DRAFTER` problem; it raises as `NotUpdatable`, the `ValueError`
    such engines always raised, with the same text."""
    from types import SimpleNamespace

    from vllm_nccl_sync.integrations.vllm.loader import drafter_problem

    assert drafter_problem(SimpleNamespace(speculative_config=None)) is None
    problem = drafter_problem(SimpleNamespace(speculative_config=SimpleNamespace(method="mtp")))
    err = problem.at("this engine cannot be updated in place").error()
    assert isinstance(err, ValueError) and problem.kind is Kind.DRAFTER
    assert str(err).startswith("this engine cannot be updated in place: speculative decoding")
