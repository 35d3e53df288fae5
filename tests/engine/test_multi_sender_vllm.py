"""Several senders into a real vLLM CPU engine: two trainer processes, each sending its half.

The engine starts from weights W1 (seed 1); two trainer processes hold the same transformers
model drawn with seed 2 (then 3). Update 2: sender 0 owns the even layers and the rest, sender 1
the odd layers; update 3: both offer everything and the coordinator balances bytes. Afterwards
the engine's greedy output equals transformers' with those weights, and its storage is the one
it had before (in place).
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

from tests.conftest import free_port
from vllm_nccl_sync.tiny import PROMPTS, build_model, engine_kwargs, hf_greedy, make_model

pytestmark = pytest.mark.vllm
MAX_TOKENS = 8
ARCH = "qwen2"


def half(state: dict, rank: int) -> dict:
    """Sender `rank`'s tensors: the odd layers for 1; the even layers and the rest for 0."""
    def owner(name: str) -> int:
        parts = name.split(".")
        return int(parts[2]) % 2 if parts[1:2] == ["layers"] else 0
    return {n: t for n, t in state.items() if owner(n) == rank}


def trainer(cfg: dict, rank: int, conn) -> None:
    from vllm_nccl_sync import PushClient, SyncConfig

    try:
        client = PushClient(SyncConfig(**cfg), rank=rank)
        client.connect()
        out = []
        for seed, balance in ((2, False), (3, True)):
            model = build_model(ARCH, seed)
            state = model.state_dict()
            res = client.push(state if balance else half(state, rank), version=seed,
                              balance=balance)
            out.append({"bytes": res.bytes, "per_sender": res.per_sender,
                        "acks": len(res.acks),
                        "expected": hf_greedy(model, PROMPTS, MAX_TOKENS) if rank == 0 else None})
        client.close()
        conn.send(("ok", out))
    except BaseException as e:  # report, the test asserts
        conn.send(("error", repr(e)))


def test_two_senders_into_a_vllm_engine(tmp_path):
    from vllm import LLM

    from vllm_nccl_sync.tiny import vllm_greedy

    path = make_model(str(tmp_path / ARCH), ARCH, seed=1)
    llm = LLM(model=path, worker_extension_cls="vllm_nccl_sync.Ext", **engine_kwargs())
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=3,
               bucket_bytes=64 * 1024, timeout_s=60.0, senders=[["127.0.0.1", free_port()]])
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=trainer, args=(cfg, r, pipes[r][1]), daemon=True)
             for r in range(2)]
    before = vllm_greedy(llm, PROMPTS, MAX_TOKENS)
    ptrs_before = llm.collective_rpc("nccl_sync_param_ptrs")
    for p in procs:
        p.start()
    try:
        joined = llm.collective_rpc("nccl_sync_join", timeout=90, args=(cfg, 2))
        assert joined == [{"rank": 2, "replica": 0, "tp_rank": 0, "tp_size": 1,
                           "host": "127.0.0.1"}]
        outputs = []
        for version in (2, 3):
            [summary] = llm.collective_rpc("nccl_sync_receive", timeout=120, args=(60.0,))
            assert summary["ok"], summary
            assert summary["version"] == version and summary["consistent"]
            llm.reset_prefix_cache()
            outputs.append(vllm_greedy(llm, PROMPTS, MAX_TOKENS))
        pushed = []
        for parent, _ in pipes:
            assert parent.poll(120), "a trainer process did not report"
            status, out = parent.recv()
            assert status == "ok", out
            pushed.append(out)
        ptrs_after = llm.collective_rpc("nccl_sync_param_ptrs")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        llm.collective_rpc("nccl_sync_close", timeout=30)
        del llm
    for i, out in enumerate(outputs):
        coord, other = pushed[0][i], pushed[1][i]
        assert out == coord["expected"], "engine output differs from transformers"
        assert coord["acks"] == 1
        assert coord["per_sender"] == {0: coord["bytes"], 1: other["bytes"]}
        assert other["bytes"] > 0
    assert outputs[0] != before and outputs[1] != outputs[0]
    assert ptrs_after == ptrs_before
