"""Fault injection against a real vLLM CPU engine: never a hang, never silent.

Each scenario runs a trainer in its own process (and, for the receiver fault, a second receiver
process) against one engine. After each: the engine still serves, and either its weights are
intact (staged mode, refused plans) or it reports itself inconsistent with its last good version
until the next complete update, which then restores it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from tests.conftest import free_port
from tests.procs import die_after_broadcasts
from vllm_nccl_sync.tiny import PROMPTS, build_model, engine_kwargs, hf_greedy, make_model

pytestmark = pytest.mark.vllm
MAX_TOKENS = 6
TIMEOUT = 8.0  # every wait of the transfer, per scenario
COUNTS = {"scenarios": 0, "hangs": 0, "silent": 0}


def trainer(cfg: dict, spec: dict, conn) -> None:
    """Push `spec["seed"]` weights as `spec["version"]`, misbehaving as `spec["fault"]` says."""
    import torch

    from vllm_nccl_sync import PushClient, SyncConfig

    sd = build_model(spec.get("arch", "qwen2"), spec["seed"]).state_dict()
    client = PushClient(SyncConfig(**cfg))
    conn.send(("up", None))
    client.connect()
    fault = spec.get("fault")
    if fault == "wrong_shape":
        sd["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 256)
    elif fault == "wrong_dtype":
        sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int32)
    elif fault == "missing":
        sd = {k: v for k, v in sd.items() if "layers.1." not in k}
    elif fault == "corrupt":
        from vllm_nccl_sync.trainer import lane  # where the trainer checksums its buckets

        real = lane.checksum
        lane.checksum = lambda data: real(data) ^ 2  # what the receiver sees differs
    items = sd if fault in ("wrong_shape", "wrong_dtype", "missing") else _stream(sd, fault)
    try:
        res = client.push(items, version=spec["version"], staged=spec.get("staged", False),
                          full=fault == "missing")
        conn.send(("ok", res.bytes))
    except Exception as e:
        conn.send(("error", str(e)))
    client.close()


def _stream(sd: dict, fault: str | None):
    """The state dict as a generator; with `die`, the trainer is SIGKILLed once its third
    bucket's broadcast completed (so buckets did land, whatever the machine's speed)."""
    if fault == "die":
        die_after_broadcasts(3)
    yield from sd.items()


def dying_receiver(cfg: dict, rank: int) -> None:
    """A second engine's worker that dies (SIGKILL) as its second bucket starts."""
    from vllm_nccl_sync import SyncConfig
    from vllm_nccl_sync.engine.loaders import ModuleLoader
    from vllm_nccl_sync.engine.receiver import Receiver
    from vllm_nccl_sync.planes.base import Transport

    loader = ModuleLoader(build_model("qwen2", 1))
    real, calls = Transport.broadcast, []

    def broadcast_then_die(self, tensor, src=0, *, length=None, to=None):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, tensor, src, length=length, to=to)

    Transport.broadcast = broadcast_then_die
    Receiver(SyncConfig(**cfg), rank).receive(loader, timeout_s=60)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from vllm import LLM

    path = make_model(str(tmp_path_factory.mktemp("faults")), "qwen2", seed=1)
    llm = LLM(model=path, worker_extension_cls="vllm_nccl_sync.Ext", **engine_kwargs())
    yield llm
    llm.llm_engine.engine_core.shutdown()
    print(f"\nfault scenarios: {COUNTS}")


def _generate(llm) -> list[list[int]]:
    from vllm_nccl_sync.tiny import vllm_greedy

    return vllm_greedy(llm, PROMPTS, MAX_TOKENS)


def _run(llm, spec: dict, extra_receivers: int = 0) -> tuple[dict, tuple, float]:
    """One update attempt; returns (engine summary, trainer result, seconds)."""
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2 + extra_receivers,
               bucket_bytes=64 * 1024, timeout_s=TIMEOUT)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=trainer, args=(cfg, spec, child), daemon=True)]
    procs += [ctx.Process(target=dying_receiver, args=(cfg, 2 + i), daemon=True)
              for i in range(extra_receivers)]
    for p in procs:
        p.start()
    try:
        assert parent.poll(120) and parent.recv()[0] == "up", "trainer did not start"
        t0 = time.monotonic()
        llm.collective_rpc("nccl_sync_join", timeout=60, args=(cfg, 1))
        [summary] = llm.collective_rpc("nccl_sync_receive", timeout=TIMEOUT * 6, args=(30.0,))
        seconds = time.monotonic() - t0
        result = parent.recv() if parent.poll(TIMEOUT * 3) else ("died", None)
    finally:
        for p in procs:
            p.join(timeout=TIMEOUT * 3)
            if p.is_alive():
                p.kill()
    COUNTS["scenarios"] += 1
    if seconds > TIMEOUT * 5:
        COUNTS["hangs"] += 1
    return summary, result, seconds


def _state(llm) -> dict:
    return llm.collective_rpc("nccl_sync_state")[0]


def _assert_intact(llm, version: int, want: list[list[int]]) -> None:
    """The engine claims `version`, consistent; its output must then be that version's."""
    state = _state(llm)
    assert state["consistent"] and state["version"] == version, state
    if _generate(llm) != want:
        COUNTS["silent"] += 1  # claims intact weights yet computes with others
        pytest.fail("engine reports intact weights but its output changed")


def _good_update(llm, version: int) -> list[list[int]]:
    summary, result, _ = _run(llm, {"seed": version, "version": version})
    assert summary["ok"] and result[0] == "ok", (summary, result)
    assert _state(llm)["consistent"] and _state(llm)["version"] == version
    want = hf_greedy(build_model("qwen2", version), PROMPTS, MAX_TOKENS)
    assert _generate(llm) == want
    return want


@pytest.mark.parametrize("fault, match", [
    ("wrong_shape", "down_proj.weight.*shape \\[64, 256\\] != engine's \\[128, 256\\]"),
    ("wrong_dtype", "model.norm.weight.*dtype int32 != engine's float32"),
    ("missing", "full update misses .* tensors: model.layers.1"),
])
def test_wrong_model_refused_before_any_byte(engine, fault, match):
    import re

    before, state0 = _generate(engine), _state(engine)
    summary, (status, text), _ = _run(engine, {"seed": 7, "version": state0["version"] + 1,
                                                "fault": fault})
    assert not summary["ok"] and re.search(match, summary["error"]), summary
    assert status == "error" and re.search(match, text), text  # the trainer hears the same
    assert summary["bytes"] == 0  # refused before any collective
    _assert_intact(engine, state0["version"], before)  # unchanged, and still serving


def test_trainer_killed_mid_update_in_place_reports_inconsistent(engine):
    last = _good_update(engine, 10)
    summary, result, seconds = _run(engine, {"seed": 11, "version": 11, "fault": "die"})
    assert result[0] == "died" and not summary["ok"] and seconds < TIMEOUT * 5
    assert summary["bytes"] > 0  # some buckets did land: in place, the model is now a mix
    state = _state(engine)
    assert not state["consistent"] and state["version"] == 10, state  # reported, not silent
    assert len(_generate(engine)) == len(PROMPTS)  # still serving
    _good_update(engine, 12)  # the next complete update restores consistency
    assert last != _generate(engine)


def test_trainer_killed_mid_staged_update_leaves_model_intact(engine):
    want = _good_update(engine, 20)
    summary, result, _ = _run(engine, {"seed": 21, "version": 21, "fault": "die", "staged": True})
    assert result[0] == "died" and not summary["ok"] and summary["bytes"] > 0
    _assert_intact(engine, 20, want)  # nothing of the dead update was loaded


def test_corrupted_bucket_is_not_loaded(engine):
    want = _good_update(engine, 30)
    summary, (status, text), _ = _run(engine, {"seed": 31, "version": 31, "fault": "corrupt",
                                                "staged": True})
    assert not summary["ok"] and "arrived corrupted" in summary["error"], summary
    assert status == "error" and "arrived corrupted" in text
    _assert_intact(engine, 30, want)


def test_other_receiver_killed_mid_update(engine):
    want = _good_update(engine, 40)
    summary, (status, text), seconds = _run(
        engine, {"seed": 41, "version": 41, "staged": True}, extra_receivers=1)
    assert not summary["ok"] and status == "error" and seconds < TIMEOUT * 5, (summary, text)
    _assert_intact(engine, 40, want)
    _good_update(engine, 42)
    assert COUNTS["hangs"] == 0 and COUNTS["silent"] == 0, COUNTS
