"""Fan-out: one push, one broadcast per bucket, several receivers.

Two engines (replicas) updated at once through one transfer group, and an engine with tensor
parallelism 2 whose two workers each receive full tensors and keep their own shard (over gloo,
then over the shared-memory plane, both workers reading the one trainer segment).
"""

from __future__ import annotations

import pytest

from vllm_nccl_sync import PushError, UpdateRefused
from vllm_nccl_sync.integrations.vllm.handles import LLMHandle
from vllm_nccl_sync.tiny import PROMPTS, build_model, engine_kwargs, hf_greedy, make_model
from vllm_nccl_sync.trainer.sync import WeightSync

pytestmark = pytest.mark.vllm
MAX_TOKENS = 8


def _generate(llm) -> list[list[int]]:
    from vllm_nccl_sync.tiny import vllm_greedy

    return vllm_greedy(llm, PROMPTS, MAX_TOKENS)


def test_one_push_updates_two_engines(tmp_path):
    from vllm import LLM

    path = make_model(str(tmp_path / "m"), "llama", seed=1)
    llms = [LLM(model=path, worker_extension_cls="vllm_nccl_sync.Ext", **engine_kwargs())
            for _ in range(2)]
    sync = WeightSync([LLMHandle(llm) for llm in llms], bucket_bytes=256 * 1024, timeout_s=60)
    try:
        ranks = sync.connect()
        assert [[w["rank"] for w in e] for e in ranks] == [[1], [2]]
        model = build_model("llama", seed=5)
        result = sync.update(model.state_dict(), version=5)
        assert sorted(a.rank for a in result.acks) == [1, 2]
        assert sync.client.transport.collectives == result.buckets  # one broadcast feeds both
        want = hf_greedy(model, PROMPTS, MAX_TOKENS)
        for llm in llms:
            assert _generate(llm) == want
        assert [s[0]["version"] for s in sync.state()] == [5, 5]
        # Refused by both engines: what `update` raises is what the push raised, with the
        # workers' reports added (a refusal of the plan, each engine's text once).
        raised, push = [], sync.client.push

        def spy(*a, **kw):
            try:
                return push(*a, **kw)
            except PushError as e:
                raised.append(e)
                raise
        sync.client.push = spy
        with pytest.raises(UpdateRefused) as refused:
            sync.update(model.state_dict(), version=5)
        [pushed] = raised
        assert type(refused.value) is type(pushed)
        assert (refused.value.errors, refused.value.missing) == (pushed.errors, pushed.missing)
        assert sorted(refused.value.errors) == [1, 2] and "refused at the plan" in str(pushed)
        assert [(s.rank, s.ok) for s in refused.value.summaries] == [(1, False), (2, False)]
        assert [s[0]["version"] for s in sync.state()] == [5, 5]
    finally:
        sync.close()
        for llm in llms:
            llm.llm_engine.engine_core.shutdown()


def test_tensor_parallel_2_engine(tmp_path, monkeypatch):
    from vllm import LLM

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # test-only: RPC of _qkv_rows
    path = make_model(str(tmp_path / "m"), "qwen2", seed=1)
    llm = LLM(model=path, worker_extension_cls="vllm_nccl_sync.Ext",
              **engine_kwargs(tensor_parallel_size=2))
    sync = WeightSync([LLMHandle(llm)], timeout_s=60)
    try:
        [workers] = sync.connect()
        assert sorted((w["rank"], w["tp_rank"], w["tp_size"]) for w in workers) == [
            (1, 0, 2), (2, 1, 2)]
        ptrs = llm.collective_rpc("nccl_sync_param_ptrs")
        model = build_model("qwen2", seed=6)
        result = sync.update(model.state_dict(), version=6)
        assert sorted(a.rank for a in result.acks) == [1, 2]
        assert _generate(llm) == hf_greedy(model, PROMPTS, MAX_TOKENS)
        assert llm.collective_rpc("nccl_sync_param_ptrs") == ptrs
        # Each worker holds its shard, not the full tensor: vLLM's loaders did the sharding.
        shapes = llm.collective_rpc(_qkv_rows)
        assert shapes[0] == shapes[1] and shapes[0] * 2 == _qkv_rows_full(model)
        # Colocated on this host: both workers map the trainer's shared memory and take their
        # shards from it (the CPU twin of a TP engine reading the trainer's GPU memory): first
        # from the plane's bucket segment, then with the model itself in shared memory, read
        # where it lies (the plan names its places; either worker would refuse what it cannot map).
        sync.close()
        sync = WeightSync([LLMHandle(llm)], backend="shm", timeout_s=60)
        sync.connect()
        for seed, share in ((7, False), (8, True)):
            model = build_model("qwen2", seed=seed)
            if share:
                model.share_memory()
            result = sync.update(model.state_dict(), version=seed)
            assert sorted(a.rank for a in result.acks) == [1, 2]
            assert bool(sync.client.lane.held) == share  # the tensors read in place, held
            assert _generate(llm) == hf_greedy(model, PROMPTS, MAX_TOKENS)
            assert llm.collective_rpc("nccl_sync_param_ptrs") == ptrs
    finally:
        sync.close()
        llm.llm_engine.engine_core.shutdown()


def _qkv_rows(worker) -> int:
    """Rows of layer 0's stacked qkv weight on this worker (before CPU packing: its loader's view)."""
    layer = worker.model_runner.model.model.layers[0].self_attn.qkv_proj
    return sum(layer.output_partition_sizes)


def _qkv_rows_full(model) -> int:
    attn = model.model.layers[0].self_attn
    return sum(m.weight.shape[0] for m in (attn.q_proj, attn.k_proj, attn.v_proj))

