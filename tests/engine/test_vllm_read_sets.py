"""Read sets and shard to shard on real vLLM CPU engines.

One TP=2 engine per model (tiny llama: untied embeddings; qwen2: tied, q/k/v biases) serves
every test here, and a TP=1 engine of the same model joins it for the last one. Each worker
rehearses its loaders on the checkpoint's tensors (`nccl_sync_read_set`); together the two read
sets tile the checkpoint: column-parallel weights and the vocabulary split by rows, row-parallel
ones by columns, norms read whole by both. Then one push feeds both engines shard to shard.
"""

from __future__ import annotations

import msgspec
import pytest

from vllm_nccl_sync.engine.handshake import read_safetensors_index
from vllm_nccl_sync.integrations.vllm.handles import LLMHandle
from vllm_nccl_sync.tiny import (
    DTYPE,
    PROMPTS,
    build_model,
    engine_kwargs,
    hf_greedy,
    make_model,
    vllm_greedy,
)
from vllm_nccl_sync.trainer.sync import WeightSync
from vllm_nccl_sync.trainer.tensors import without_aliases
from vllm_nccl_sync.wire.packing import ALIGN, tensor_nbytes
from vllm_nccl_sync.wire.reads import ReadSet, nbytes, problems

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def engine(request, tmp_path_factory):
    from vllm import LLM

    arch = request.param
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        path = make_model(str(tmp_path_factory.mktemp(arch)), arch, seed=1)
        llm = LLM(model=path, worker_extension_cls="vllm_nccl_sync.Ext",
                  **engine_kwargs(tensor_parallel_size=2))
    yield arch, path, llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def read_sets(engine) -> list[ReadSet]:
    _, _, llm = engine
    results = llm.collective_rpc("nccl_sync_read_set")
    assert [r["error"] for r in results] == ["", ""]
    return sorted((msgspec.convert(r["read_set"], ReadSet) for r in results),
                  key=lambda s: s.worker)


def test_the_two_workers_read_sets_tile_the_checkpoint(engine, read_sets):
    _, path, _ = engine
    index = read_safetensors_index(path)
    assert [s.worker for s in read_sets] == [0, 1]
    for s in read_sets:
        assert {n: (r.dtype, r.shape) for n, r in s.tensors.items()} == {
            n: (d, shape) for n, (d, shape) in index.items()}
    assert problems(read_sets) == []


def test_sharded_tensors_are_split_and_norms_read_whole(read_sets):
    a, b = (s.tensors for s in read_sets)
    layer = "model.layers.0."
    for leaf in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj"):
        rows = a[f"{layer}{leaf}.weight"].shape[0]
        cols = a[f"{layer}{leaf}.weight"].shape[1]
        assert [(x.start, x.stop) for x in a[f"{layer}{leaf}.weight"].blocks] == [
            ([0, 0], [rows // 2, cols])], leaf
        assert [(x.start, x.stop) for x in b[f"{layer}{leaf}.weight"].blocks] == [
            ([rows // 2, 0], [rows, cols])], leaf
    for leaf in ("self_attn.o_proj", "mlp.down_proj"):  # row-parallel: a block of columns
        rows, cols = a[f"{layer}{leaf}.weight"].shape
        assert [(x.start, x.stop) for x in a[f"{layer}{leaf}.weight"].blocks] == [
            ([0, 0], [rows, cols // 2])], leaf
        assert [(x.start, x.stop) for x in b[f"{layer}{leaf}.weight"].blocks] == [
            ([0, cols // 2], [rows, cols])], leaf
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # vocab-parallel: rows
        if name in a:  # qwen2 ties its LM head to the embedding: no such checkpoint tensor
            assert a[name].blocks[0].stop[0] == b[name].blocks[0].start[0] > 0, name
    for name in (n for n in a if n.endswith("_proj.bias")):  # qwen2's q/k/v biases: halves
        half = a[name].shape[0] // 2
        assert [x.stop for x in a[name].blocks] == [[half]] == [x.start for x in b[name].blocks]
    for name in (f"{layer}input_layernorm.weight", "model.norm.weight"):
        assert a[name] == b[name] and a[name].blocks[0].stop == a[name].shape and not a[name].why


def test_read_bytes_are_the_model_once_plus_its_replicated_tensors(engine, read_sets):
    _, path, _ = engine
    model = sum(tensor_nbytes(d, s) for d, s in read_safetensors_index(path).values())
    a, b = (s.tensors for s in read_sets)
    replicated = sum(nbytes(r) for n, r in a.items() if r == b[n])
    total = sum(nbytes(s) for s in read_sets)
    assert total == model + replicated
    print(f"read {total} bytes for a {model}-byte model: {total / model:.3f}x, not 2x")
    assert total < 1.1 * model


def test_the_rehearsal_leaves_the_engine_serving_its_weights(engine, read_sets):
    """The CPU backend's packed linears got full-size weights for the rehearsal and their
    packed ones back: the engine's output is still the checkpoint's; a second call is cached."""
    arch, _, llm = engine
    assert vllm_greedy(llm, PROMPTS, 8) == hf_greedy(build_model(arch, 1), PROMPTS, 8)
    again = llm.collective_rpc("nccl_sync_read_set")
    assert sorted((msgspec.convert(r["read_set"], ReadSet) for r in again),
                  key=lambda s: s.worker) == read_sets


@pytest.fixture(scope="module")
def tp1(engine):
    from vllm import LLM

    _, path, _ = engine
    llm = LLM(model=path, worker_extension_cls="vllm_nccl_sync.Ext", **engine_kwargs())
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_one_push_feeds_a_tp2_and_a_tp1_engine_shard_to_shard(engine, tp1, read_sets, backend):
    """Each TP=2 worker receives its read set (counted at its data plane), the TP=1 worker the
    whole model, and both engines then answer as transformers does, over two updates; over gloo
    in place, and over shared memory staged (each worker keeps only its blocks until the commit
    makes them whole)."""
    arch, _, llm = engine
    sync = WeightSync([LLMHandle(llm), LLMHandle(tp1)], bucket_bytes=256 * 1024, timeout_s=60,
                      shard=True, backend=backend)
    try:
        sync.connect()
        assert [sync.client.reads[r] for r in (1, 2)] == read_sets
        for version in {"gloo": (3, 5), "shm": (6, 7)}[backend]:  # the FSDP test's: 9, 11
            model = build_model(arch, seed=version)
            result = sync.update(model.state_dict(), version=version, staged=backend == "shm")
            want = hf_greedy(model, PROMPTS, 8)
            assert vllm_greedy(llm, PROMPTS, 8) == want and vllm_greedy(tp1, PROMPTS, 8) == want
            got = {a.rank: a.bytes for a in result.acks}
            assert got == result.per_receiver  # received (the data plane's count) = planned
            for rank, rs in zip((1, 2), read_sets):
                reads = sum(r.numel() for r in rs.tensors.values()) * DTYPE.itemsize
                assert reads <= got[rank] < reads + ALIGN * (len(rs.tensors) + result.buckets)
            model_bytes = sum(t.numel() for _, t in without_aliases(model.state_dict()))
            model_bytes *= DTYPE.itemsize
            assert got[3] >= model_bytes
            ratio = (got[1] + got[2]) / model_bytes
            print(f"{arch}: the TP=2 engine's workers took {ratio:.3f}x the model (broadcast: 2x)")
            assert ratio < 1.1
    finally:
        sync.close()


def fsdp_rank(rank: int, port: int, cfg: dict, arch: str, seeds: list[int]) -> list[dict]:
    """Rank `rank` of a 2-rank FSDP2 trainer (gloo): its parameters stay sharded DTensors, and
    it pushes its own shards of each model shard to shard."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from vllm_nccl_sync import PushClient, SyncConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    client = PushClient(SyncConfig(**cfg), rank=rank)
    try:
        client.connect()
        out = []
        for seed in seeds:
            model = build_model(arch, seed)
            mesh = init_device_mesh("cpu", (2,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            r = client.push(model.state_dict(), seed)
            out.append({"bytes": r.bytes, "per_receiver": r.per_receiver})
        return out
    finally:
        client.close()
        dist.destroy_process_group()


def test_an_fsdp2_trainer_feeds_both_engines_from_its_shards(engine, tp1, read_sets):
    """Two FSDP2 ranks, each sending only the intersections of its shards with what each
    worker reads: no rank gathers a tensor, and both engines answer as transformers does."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.conftest import free_port
    from tests.procs import run_procs

    arch, _, llm = engine
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=5, timeout_s=60.0,
               bucket_bytes=256 * 1024, senders=[["127.0.0.1", free_port()]], shard=True)
    seeds, port = [9, 11], free_port()
    with ThreadPoolExecutor(3) as pool:
        trainers = pool.submit(run_procs, [(fsdp_rank, (r, port, cfg, arch, seeds))
                                           for r in (0, 1)], 300)
        joins = [pool.submit(e.collective_rpc, "nccl_sync_join", timeout=90, args=(cfg, off))
                 for e, off in ((llm, 2), (tp1, 4))]
        assert [w["rank"] for j in joins for w in j.result(timeout=120)] == [2, 3, 4]
        for seed in seeds:
            calls = [pool.submit(e.collective_rpc, "nccl_sync_receive", timeout=120,
                                 args=(60.0,)) for e in (llm, tp1)]
            summaries = [s for c in calls for s in c.result(timeout=180)]
            assert [(s["ok"], s["version"]) for s in summaries] == [(True, seed)] * 3, summaries
            want = hf_greedy(build_model(arch, seed), PROMPTS, 8)
            assert vllm_greedy(llm, PROMPTS, 8) == want and vllm_greedy(tp1, PROMPTS, 8) == want
        pushed = trainers.result(timeout=330)
    for rank, rs in zip((2, 3), read_sets):  # each TP=2 worker took its read set, no more
        reads = sum(r.numel() for r in rs.tensors.values()) * DTYPE.itemsize
        for push in pushed[0]:
            assert reads <= push["per_receiver"][rank] < reads + ALIGN * 4 * len(rs.tensors)
    assert pushed[1][0]["bytes"] > 0  # rank 1 sent its own shards
