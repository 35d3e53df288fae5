"""Shard to shard into a mixture-of-experts model: tiny Qwen3-MoE on a TP=2 vLLM CPU engine.

One engine serves the module. Its two workers' read sets tile the checkpoint; attention, the
vocabulary and the LM head are split as in the dense case, and any tensor a worker reads whole
while the other reads another part of it says why (the CPU MoE backend re-lays out the experts).
Then two pushes of strong weights feed the engine shard to shard: it answers as transformers does,
each worker's data plane received what was planned for it, less than the model twice over, and
`PushResult.whole` names the tensors read whole for a reason, with it.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from vllm_nccl_sync.engine.handshake import read_safetensors_index
from vllm_nccl_sync.integrations.vllm.handles import LLMHandle
from vllm_nccl_sync.tiny import (
    PROMPTS,
    build_model,
    engine_kwargs,
    hf_greedy,
    make_model,
    save_model,
    vllm_greedy,
)
from vllm_nccl_sync.trainer.sync import WeightSync
from vllm_nccl_sync.wire.packing import tensor_nbytes
from vllm_nccl_sync.wire.reads import Read, ReadSet, problems, whole

pytestmark = pytest.mark.vllm

FAMILY = "qwen3_moe"
LAYER = "model.layers.0."


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        path = make_model(str(tmp_path_factory.mktemp(FAMILY)), FAMILY, seed=1)
        llm = LLM(model=path, worker_extension_cls="vllm_nccl_sync.Ext",
                  **engine_kwargs(tensor_parallel_size=2))
    yield path, llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def read_sets(engine) -> list[ReadSet]:
    _, llm = engine
    results = llm.collective_rpc("nccl_sync_read_set")
    assert [r["error"] for r in results] == ["", ""]
    return sorted((msgspec.convert(r["read_set"], ReadSet) for r in results),
                  key=lambda s: s.worker)


def _is_whole(r: Read) -> bool:
    return r.blocks == whole(r.dtype, r.shape).blocks


def _spans(r: Read) -> list[tuple[list[int], list[int]]]:
    return [(b.start, b.stop) for b in r.blocks]



def test_read_sets_tile_the_checkpoint_and_say_why_a_tensor_is_whole(engine, read_sets):
    path, _ = engine
    index = read_safetensors_index(path)
    assert [s.worker for s in read_sets] == [0, 1]
    for s in read_sets:
        assert {n: (r.dtype, r.shape) for n, r in s.tensors.items()} == {
            n: (d, shape) for n, (d, shape) in index.items()}
    assert problems(read_sets) == []

    reasons = sorted({r.why for s in read_sets for r in s.tensors.values() if r.why})
    print(f"read whole for a reason: {reasons or 'none'}")
    a, b = (s.tensors for s in read_sets)
    for name in index:
        replicated = a[name] == b[name] and _is_whole(a[name]) and not a[name].why
        for r in (a[name], b[name]):
            assert replicated or not _is_whole(r) or r.why, (name, a[name], b[name])

    for leaf in ("q_proj", "k_proj", "v_proj"):  # column-parallel: a range of rows
        rows, cols = a[f"{LAYER}self_attn.{leaf}.weight"].shape
        assert _spans(a[f"{LAYER}self_attn.{leaf}.weight"]) == [([0, 0], [rows // 2, cols])]
        assert _spans(b[f"{LAYER}self_attn.{leaf}.weight"]) == [([rows // 2, 0], [rows, cols])]
    rows, cols = a[f"{LAYER}self_attn.o_proj.weight"].shape  # row-parallel: a block of columns
    assert _spans(a[f"{LAYER}self_attn.o_proj.weight"]) == [([0, 0], [rows, cols // 2])]
    assert _spans(b[f"{LAYER}self_attn.o_proj.weight"]) == [([0, cols // 2], [rows, cols])]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # vocab-parallel: rows
        assert a[name].blocks[0].stop[0] == b[name].blocks[0].start[0] > 0, name
    for name in (f"{LAYER}input_layernorm.weight", f"{LAYER}self_attn.q_norm.weight",
                 "model.norm.weight"):
        assert a[name] == b[name] and _is_whole(a[name]) and not a[name].why, name


def _checkpoint(seed: int, path: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Model `seed` and its tensors as its checkpoint names them (per-expert weights)."""
    from safetensors.torch import load_file

    model = build_model(FAMILY, seed)
    return model, load_file(f"{save_model(model, path)}/model.safetensors")



def test_two_pushes_shard_to_shard_feed_the_moe_engine(engine, read_sets, tmp_path):
    """Each worker's data plane received what was planned for it; the engine then answers as
    transformers does; `whole` names exactly the tensors some worker reads whole, and why."""
    _, llm = engine
    fallback: dict[str, str] = {}
    for s in read_sets:
        for name, r in s.tensors.items():
            if r.why:
                fallback.setdefault(name, f"rank {s.worker + 1}: {r.why}")
    sync = WeightSync([LLMHandle(llm)], shard=True, bucket_bytes=256 * 1024, timeout_s=60)
    try:
        sync.connect()
        assert [sync.client.reads[r] for r in (1, 2)] == read_sets
        answers = []
        for version in (5, 7):
            model, tensors = _checkpoint(version, str(tmp_path / f"w{version}"))
            result = sync.update(tensors, version=version)
            answers.append(hf_greedy(model, PROMPTS, 8))
            assert vllm_greedy(llm, PROMPTS, 8) == answers[-1], f"after update {version}"
            got = {a.rank: a.bytes for a in result.acks}
            planned = result.per_receiver or dict.fromkeys(got, result.bytes)  # {}: broadcast
            assert got == planned  # received (the data plane's count) = planned
            model_bytes = sum(tensor_nbytes(str(t.dtype).removeprefix("torch."), list(t.shape))
                              for t in tensors.values())
            ratio = (got[1] + got[2]) / model_bytes
            print(f"update {version}: the two workers took {ratio:.3f}x the model "
                  f"(broadcast: 2x); read whole: {sorted(set(result.whole.values())) or 'none'}")
            assert ratio < 2
            assert result.whole == fallback
        assert answers[0] != answers[1]  # the second update changed what the engine says
    finally:
        sync.close()
