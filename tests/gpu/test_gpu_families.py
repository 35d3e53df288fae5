"""Support matrix on a GPU (vLLM's CUDA build, CUDA graphs on), for every family, including those
vLLM's CPU build cannot run (MLA, a VLM's language tower, block-FP8).

Per family, as `tests/engine/test_families.py` does on CPU: engine A starts from W1 and is pushed W2,
then W1 again; engine B starts fresh from W2. After each push A's greedy output equals the fresh
engine's token for token, no parameter moved, every parameter equals the fresh engine's (sha256),
derived tensors (MLA's `W_UK_T`/`W_UV`) included, and `verify` compares every parameter with the
pushed checkpoint. bf16 on GPU, so transformers (fp32) is not compared. The MLA family takes
DeepSeek's own head dimensions here (`GPU_OVERRIDES`: vLLM's GPU MLA prefill backends take no
others). A VLM serving its language tower only (text-only mode) does not build its vision tower
and its loader skips the `visual.` tensors: `verify` reports those as not in the engine, and
compares everything else.

block_fp8: an engine started from FP8 weights + `weight_scale_inv` (128 x 128 blocks) is pushed
the trainer's bf16 first (quantized by the engine as the checkpoint was made: it must then equal
a fresh engine on the FP8 checkpoint of the same weights), then FP8 + scales.

Run in four parts (two engine starts per family, each with torch.compile and CUDA graphs):
    python -m pytest -q -s -m gpu tests/gpu/test_gpu_families.py -k "(qwen3 and not moe) or phi3"
    python -m pytest -q -s -m gpu tests/gpu/test_gpu_families.py -k "qwen3_moe or gemma2"
    python -m pytest -q -s -m gpu tests/gpu/test_gpu_families.py -k "deepseek or qwen2_vl"
    python -m pytest -q -s -m gpu tests/gpu/test_gpu_families.py -k "fp8"
"""

from __future__ import annotations

import sys

import pytest

from tests.helpers import make_block_fp8
from tests.engine.test_families import _greedy, _push, _rpc, _start, _stop
from vllm_nccl_sync.engine.handshake import read_safetensors_index
from vllm_nccl_sync.tiny import GPU_OVERRIDES, build_model, save_model

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

GPU_FAMILIES = {
    "qwen3": {},
    "qwen3_moe": {},
    "deepseek_v2": {},
    "gemma2": {},
    "phi3": {},
    "qwen2_vl": {"limit_mm_per_prompt": {"image": 0, "video": 0}},
    "block_fp8": {},
}
"""Family -> extra engine arguments (a VLM serves its language tower only)."""
VISION = ("visual.", "model.visual.")
"""Checkpoint prefixes of a VLM's vision tower (not built in text-only mode)."""


@pytest.fixture(autouse=True)
def _spawn_workers(monkeypatch):
    """This process touches CUDA before vLLM starts its engine process: fork would break it."""
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def test_block_fp8_quantization_is_the_same_on_gpu():
    """The engine quantizes bf16 on its GPU exactly as the checkpoint maker does on CPU (scales
    and FP8 values bit for bit): else a pushed update differs from a fresh engine."""
    import torch

    from tests.unit.test_family_checks import _bits
    from vllm_nccl_sync.integrations.vllm.block_fp8 import quantize

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    g = torch.Generator().manual_seed(0)
    for shape in ((384, 128), (512, 256), (200, 300)):
        w = (torch.randn(shape, generator=g) / 16).to(torch.bfloat16)
        q, s = quantize(w, (128, 128))
        qg, sg = quantize(w.cuda(), (128, 128))
        assert _bits(sg) == _bits(s) and _bits(qg) == _bits(q), shape


def _save(family: str, seed: int, path: str) -> str:
    if family == "block_fp8":
        return make_block_fp8(path, seed)
    return save_model(build_model(family, seed, **GPU_OVERRIDES.get(family, {})), path)


@pytest.mark.parametrize("family", sorted(GPU_FAMILIES))
def test_family_updates_in_place_gpu(family, tmp_path):
    from vllm_nccl_sync.verify import compare

    extra = {"dtype": "bfloat16", "enforce_eager": False, **GPU_FAMILIES[family]}
    paths = {s: _save(family, s, str(tmp_path / f"w{s}")) for s in (1, 2)}
    llm = _start(paths[1], extra)
    try:
        fresh1, state1 = _greedy(llm), _rpc(llm, "nccl_test_state")
        ptrs, rule = _rpc(llm, "nccl_test_ptrs"), _rpc(llm, "nccl_test_rule")
        print(f"{family}: rule {rule}", file=sys.stderr)
        specs = [[n, d, s] for n, (d, s) in read_safetensors_index(paths[2]).items()]
        assert _rpc(llm, "nccl_test_plan_problems", specs) == []
        push2 = paths[2]
        if family == "block_fp8":  # push 1: the trainer's bf16, quantized by the engine
            push2 = make_block_fp8(str(tmp_path / "w2-bf16"), 2, quantized=False)
            bf16 = [[n, d, s] for n, (d, s) in read_safetensors_index(push2).items()]
            assert _rpc(llm, "nccl_test_plan_problems", bf16) == []
        res2 = _push(llm, push2)
        out2, state2 = _greedy(llm), _rpc(llm, "nccl_test_state")
        checks2 = _rpc(llm, "nccl_test_checksums")
        _push(llm, paths[1])
        out1, state1b = _greedy(llm), _rpc(llm, "nccl_test_state")
        ptrs_after = _rpc(llm, "nccl_test_ptrs")
    finally:
        _stop(llm)
    llm = _start(paths[2], extra)
    try:
        fresh2, fresh_state2 = _greedy(llm), _rpc(llm, "nccl_test_state")
    finally:
        _stop(llm)

    assert fresh1 != fresh2
    assert out2 == fresh2, "after push 1 (W2): differs from a fresh engine on W2"
    assert out1 == fresh1, "after push 2 (W1): differs from a fresh engine on W1"
    assert state2 == fresh_state2 and state1b == state1, "a parameter differs from a fresh engine"
    assert ptrs_after == ptrs, "a parameter moved"
    assert res2["loaded"] > 0, res2
    report = compare(paths[2], [checks2])
    print(f"{family} verify: {report.summary()}", file=sys.stderr)
    if family == "block_fp8":  # FP8 kernels may keep weights/scales in their own layout: shown
        print([(e.name, e.status, e.detail) for e in report.entries if e.status != "match"][:8],
              file=sys.stderr)
        assert report.count("match") > 0, report.summary()
    else:
        assert report.ok and report.count("mismatch") == 0, report.summary()
        # MLA's W_UK_T/W_UV are derived from kv_b_proj, not checkpoint tensors: they were compared
        # with the fresh engine's above (`state2`), which is where their correctness shows
        derived = [n for n in report.engine_only if n.endswith((".W_UK_T", ".W_UV"))]
        assert report.engine_only == derived, report.engine_only[:6]
        assert bool(derived) == (family == "deepseek_v2") and set(derived) <= set(state2)
        absent = "the engine has no parameter of this name"
        left = [(e.name, e.detail) for e in report.entries if e.status != "match"
                and not (family == "qwen2_vl" and e.name.startswith(VISION) and e.detail == absent)]
        assert not left, left[:6]
        if family == "qwen2_vl":  # the whole language tower was compared
            assert report.count("match") == sum(not n.startswith(VISION) for n in
                                                read_safetensors_index(paths[2])), report.summary()
