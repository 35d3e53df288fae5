"""`WeightSync` over real receiver processes (gloo, real ZeroMQ sockets): a failed update raises
exactly what `PushClient.push` raised (type, `errors`, `missing`, cause) plus the workers' typed
reports; the trainer casts to the engines' dtype where that is faithful, and refuses (naming the
option) where it is not."""

from __future__ import annotations

import pytest
import torch

from tests.engine_procs import ProcEngine, digest
from vllm_nccl_sync import PushError, UpdateRefused, WeightSync, WorkerSummary

pytestmark = pytest.mark.multiproc
TIMEOUT = 30.0  # a bound on every wait, never a speed requirement


def tensors(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(300, 64, generator=g).to(dtype),  # > one bucket
            "norm.weight": torch.randn(33, generator=g).to(dtype),
            "steps": torch.arange(5)}


@pytest.fixture
def engines(request):
    kinds = getattr(request, "param", [{}, {}])
    made = [ProcEngine(**kw) for kw in kinds]
    yield made
    for e in made:
        e.stop()


def spied(sync: WeightSync) -> list[BaseException]:
    """What `sync.client.push` raises, recorded as it passes."""
    raised: list[BaseException] = []
    real = sync.client.push

    def push(*a, **kw):
        try:
            return real(*a, **kw)
        except BaseException as e:
            raised.append(e)
            raise
    sync.client.push = push
    return raised


def assert_same_failure(got: PushError, pushed: PushError) -> None:
    assert type(got) is type(pushed)
    assert got.errors == pushed.errors and got.missing == pushed.missing
    assert got.__cause__ is pushed.__cause__
    assert str(got).startswith(str(pushed))
    assert got.summaries and all(isinstance(s, WorkerSummary) for s in got.summaries)


def test_a_refused_update_raises_what_the_push_raised(engines):
    sync = WeightSync(engines, bucket_bytes=16 * 1024, timeout_s=TIMEOUT)
    try:
        assert [a[0]["rank"] for a in sync.connect()] == [1, 2]
        assert sync.update(tensors(1), version=1).version == 1
        raised = spied(sync)
        with pytest.raises(PushError) as e:
            sync.update(tensors(2), version=1)  # both hold version 1 already
        [pushed] = raised
        assert isinstance(pushed, UpdateRefused)
        assert_same_failure(e.value, pushed)
        assert sorted(e.value.errors) == [1, 2] and not e.value.missing
        text = str(e.value)
        # A refusal of the plan, each receiver's text once (not "failed at bucket N").
        assert "update 1 refused at the plan" in text and "at bucket" not in text, text
        for r in (1, 2):
            assert text.count(f"rank {r} refused update 1: it holds version 1") == 1, text
        assert sorted((s.rank, s.ok) for s in e.value.summaries) == [(1, False), (2, False)]
        assert sync.update(tensors(3), version=3).version == 3  # nothing broke
    finally:
        sync.close()


@pytest.mark.parametrize("engines", [[{}, {"die_at_load": True}]], indirect=True)
def test_a_dead_rank_raises_what_the_push_raised(engines):
    sync = WeightSync(engines, bucket_bytes=16 * 1024, timeout_s=TIMEOUT)
    try:
        sync.connect()
        raised = spied(sync)
        with pytest.raises(PushError) as e:
            sync.update(tensors(1), version=1)
        [pushed] = raised
        assert type(pushed) is PushError
        assert_same_failure(e.value, pushed)
        assert 2 in e.value.missing or 2 in e.value.errors, e.value
        by_rank = {s.rank: s for s in e.value.summaries}
        assert not by_rank[2].ok and "receive call failed" in by_rank[2].error, by_rank
        assert "receive call failed" in str(e.value)  # the workers' reports are named too
        assert not by_rank[1].ok and by_rank[1].rank == 1
    finally:
        sync.close()


@pytest.mark.parametrize("engines", [[{"dtype": "float32"}]], indirect=True)
def test_bf16_weights_into_an_fp32_engine_are_cast_on_the_trainer(engines):
    """The engine announces float32; a bf16 trainer's floating tensors go as float32 (exactly
    the values a float32 cast gives), integers as they are. Into float16 the cast is refused,
    naming the option, unless asked for."""
    sync = WeightSync(engines, bucket_bytes=16 * 1024, timeout_s=TIMEOUT)
    try:
        sync.connect()
        sd = tensors(4, torch.bfloat16)
        res = sync.update(sd, version=4)
        assert res.cast == {"bfloat16": "float32"}
        fp32 = {n: t.float() if t.is_floating_point() else t for n, t in sd.items()}
        assert res.bytes >= sum(t.numel() * t.element_size() for t in fp32.values())
        [held] = engines[0].call("digests", timeout=TIMEOUT)
        assert held == {n: (digest(t), str(t.dtype)) for n, t in fp32.items()}
        # An explicit dtype always wins (here: no cast at all of the fp32 tensors).
        assert sync.update(tensors(5), version=5, dtype=torch.float32).cast == {}
    finally:
        sync.close()


@pytest.mark.parametrize("engines", [[{"dtype": "float16"}]], indirect=True)
def test_a_cast_into_float16_is_refused_unless_asked_for(engines):
    sync = WeightSync(engines, bucket_bytes=16 * 1024, timeout_s=TIMEOUT)
    try:
        sync.connect()
        with pytest.raises(PushError, match=r"'embed.weight' is float32 and the engine holds "
                                            r"float16: .*push\(dtype=torch.float16\)"):
            sync.update(tensors(6), version=6)
        res = sync.update(tensors(7), version=7, dtype=torch.float16)
        assert res.cast == {"float32": "float16"}
        [held] = engines[0].call("digests", timeout=TIMEOUT)
        assert held["embed.weight"] == (digest(tensors(7)["embed.weight"].half()), "torch.float16")
    finally:
        sync.close()


@pytest.mark.parametrize("engines", [[{"dtype": "float32"}, {"dtype": "bfloat16"}]],
                         indirect=True)
def test_engines_holding_different_dtypes_are_named(engines):
    sync = WeightSync(engines, bucket_bytes=16 * 1024, timeout_s=TIMEOUT)
    try:
        sync.connect()
        with pytest.raises(PushError, match=r"ranks \[2\] hold bfloat16; ranks \[1\] hold "
                                            r"float32"):
            sync.update(tensors(8), version=8)  # refused before any engine waits
        assert sync.update(tensors(9, torch.bfloat16), version=9, dtype=torch.bfloat16).cast == {}
    finally:
        sync.close()


def test_a_bad_value_is_refused_where_it_was_written():
    from types import SimpleNamespace

    from vllm_nccl_sync.wire.config import SyncConfig

    handle = SimpleNamespace(workers=2)
    with pytest.raises(ValueError, match=r"^WeightSync\.bucket_bytes: SyncConfig\.bucket_bytes"):
        WeightSync([handle], bucket_bytes=100)
    sync = WeightSync([handle], backend="gloo", bucket_bytes=8192, timeout_s=5.0)
    assert sync.cfg == SyncConfig(world_size=3, backend="gloo", bucket_bytes=8192,
                                  timeout_s=5.0, control_port=sync.cfg.control_port,
                                  group_port=sync.cfg.group_port)
