"""Real vLLM CPU engine, real trainer process: the whole product, end to end.

The engine starts from weights W1 (seed 1). A separate trainer process holds a transformers
model of the same config drawn with seed 2 (every layer matters: see `random_weights`) and pushes
it over ZeroMQ + gloo. Afterwards the engine's greedy output equals transformers' with W2, token
for token, and the storage vLLM keeps is the storage it had before.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

from tests.conftest import free_port
from vllm_nccl_sync.tiny import PROMPTS, build_model, engine_kwargs, hf_greedy, make_model

pytestmark = pytest.mark.vllm
MAX_TOKENS = 8


def trainer(cfg: dict, arch: str, seeds: list[int], conn, share: bool = False) -> None:
    """The trainer process: push each seed's weights as version = seed; send back what it saw.
    `share`: the model's tensors lie in shared memory (`model.share_memory()`)."""
    from vllm_nccl_sync import PushClient, SyncConfig

    try:
        client = PushClient(SyncConfig(**cfg))
        client.connect()
        out = []
        for seed in seeds:
            model = build_model(arch, seed)
            if share:
                model.share_memory()
            res = client.push(model.state_dict(), version=seed)
            out.append({"bytes": res.bytes, "buckets": res.buckets, "acks": len(res.acks),
                        "expected": hf_greedy(model, PROMPTS, MAX_TOKENS)})
        client.close()
        conn.send(("ok", out))
    except BaseException as e:  # report, the test asserts
        conn.send(("error", repr(e)))


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def engine(request, tmp_path_factory):
    from vllm import LLM

    arch = request.param
    path = make_model(str(tmp_path_factory.mktemp(arch)), arch, seed=1)
    llm = LLM(model=path, worker_extension_cls="vllm_nccl_sync.Ext", **engine_kwargs())
    yield arch, llm
    del llm


def generate(llm) -> list[list[int]]:
    from vllm_nccl_sync.tiny import vllm_greedy

    return vllm_greedy(llm, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("backend", ["gloo", "shm", "shm-in-place", "gloo-receive-process"])
def test_push_from_trainer_process_takes_effect_in_place(engine, backend):
    """Over gloo, then (same engine, newer versions) over the shared-memory plane, whose
    receiver loads straight from the trainer's segment; then with the trainer's model in
    shared memory, which the engine reads where it lies; then over gloo received by a process
    of the worker's own (`receive_process`)."""
    arch, llm = engine
    share = backend == "shm-in-place"
    apart = backend == "gloo-receive-process"
    backend = "shm" if share else "gloo" if apart else backend
    before = generate(llm)
    [held] = llm.collective_rpc("nccl_sync_state")
    first = max(held["version"], 1) + 1
    versions = [first, first + 1]
    ptrs_before = llm.collective_rpc("nccl_sync_param_ptrs")
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2, backend=backend,
               bucket_bytes=64 * 1024, timeout_s=60.0,  # small buckets: many, and chunking
               receive_process=apart)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=trainer, args=(cfg, arch, versions, child, share), daemon=True)
    proc.start()
    try:
        joined = llm.collective_rpc("nccl_sync_join", timeout=90, args=(cfg, 1))
        assert joined == [{"rank": 1, "replica": 0, "tp_rank": 0, "tp_size": 1,
                           "host": "127.0.0.1"}]
        outputs = []
        for version in versions:
            [summary] = llm.collective_rpc("nccl_sync_receive", timeout=120, args=(60.0,))
            assert summary["ok"], summary
            assert summary["version"] == version and summary["consistent"]
            assert (summary.get("read_in_place", 0) > 0) == share, summary
            # the embedding (and untied LM head) exceed a bucket: loaded row by row
            assert summary["load"]["loaded_by_rows"] == (1 if arch == "qwen2" else 2), summary
            if version == versions[-1]:  # the loader's copies, recorded before, replayed:
                # the CPU backend's linears, made anew for each update, included
                assert summary["load"]["replayed"] > 0, summary
                assert summary["load"]["through_loader"] == 0, summary
            llm.reset_prefix_cache()
            outputs.append(generate(llm))
        assert parent.poll(120), "trainer process did not report"
        status, pushed = parent.recv()
        assert status == "ok", pushed
        [state] = llm.collective_rpc("nccl_sync_state")
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        llm.collective_rpc("nccl_sync_close", timeout=30)

    for out, push in zip(outputs, pushed):
        assert out == push["expected"], "engine output differs from transformers with the pushed weights"
        assert push["buckets"] > 3 and push["acks"] == 1
    assert outputs[0] != before and outputs[1] != outputs[0]
    # In place: everything vLLM keeps non-empty lives where it lived before.
    ptrs_after = llm.collective_rpc("nccl_sync_param_ptrs")
    assert ptrs_after == ptrs_before and len(ptrs_before[0]) > 5
    assert state["version"] == versions[-1] and state["failures"] == 0
    assert state["updates"] == held["updates"] + 2


def test_after_vllms_weight_reset_only_an_update_of_every_weight_commits(engine):
    """vLLM's own `reset_weights` (the RL router's weight checker "reset", the same loss as a
    level-2 sleep) zeroes every parameter: the engine then reports inconsistent, an update that
    leaves out a tensor is refused before a byte moves, and one of every weight restores it
    (its output equals transformers' with the pushed weights, every parameter written)."""
    from vllm_nccl_sync import LLMHandle, UpdateRefused, WeightSync

    arch, llm = engine
    [held] = llm.collective_rpc("nccl_sync_state")
    version = max(held["version"], 1) + 10
    sync = WeightSync([LLMHandle(llm)], backend="gloo", bucket_bytes=64 * 1024, timeout_s=60.0)
    sync.connect()
    try:
        llm.collective_rpc("reset_weights")
        [st] = llm.collective_rpc("nccl_sync_state")
        assert not st["consistent"] and "reset_weights zeroed" in st["discarded"], st
        weights = build_model(arch, 7).state_dict()
        partial = {n: t for n, t in weights.items() if not n.endswith("post_attention_layernorm.weight")}
        with pytest.raises(UpdateRefused, match="every weight must be rewritten.*post_attention_layernorm"):
            sync.update(partial, version)
        [st] = llm.collective_rpc("nccl_sync_state")
        assert not st["consistent"] and st["version"] == held["version"]
        model = build_model(arch, 8)
        sync.update(model.state_dict(), version + 1)
        [st] = llm.collective_rpc("nccl_sync_state")
        assert st["consistent"] and st["version"] == version + 1 and st["discarded"] == ""
        assert generate(llm) == hf_greedy(model, PROMPTS, MAX_TOKENS)
    finally:
        sync.close()
