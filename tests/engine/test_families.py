"""Support matrix on vLLM's CPU build: every model family it runs, updated in place twice.

Per family (tiny config of its own layout, fp32, every layer drawn to matter: `random_weights`):
engine A starts from W1 and is pushed W2, then W1 again (three batches from one reused buffer, as a
receiver loads); engine B then starts fresh from W2. After each push A's greedy output equals a
fresh engine's with the same weights (B for W2, A's own start for W1) token for token, and
transformers' (both fp32); no parameter moved; tensors vLLM derives after loading (MLA's
`W_UK_T`/`W_UV`) equal the fresh engine's; the plan check accepts the checkpoint's names and any
spelling the model's loader maps to them, and refuses a name it would drop or does not have.

One engine at a time; two engine starts per family. Families vLLM's CPU build cannot run
(`NOT_ON_CPU`, with the reason) are in `tests/gpu/test_gpu_families.py`.
"""

from __future__ import annotations

import sys
import time

import pytest

from vllm_nccl_sync.engine.handshake import read_safetensors_index
from vllm_nccl_sync.tiny import PROMPTS, build_model, engine_kwargs, hf_greedy, save_model

MAX_TOKENS = 8

CPU_FAMILIES = {
    "qwen3": {},
    "qwen3_moe": {},
    "gemma2": {},
    "phi3": {},
}
"""Family -> extra engine arguments."""

NOT_ON_CPU = {
    "deepseek_v2": "on vLLM CPU 0.32 its greedy output depends on the batch (a prompt alone "
                   "decodes otherwise than in a batch) and differs from transformers on a fresh "
                   "engine; its MLA refresh is shown here by "
                   "test_mla_derived_tensors_follow_every_update",
    "qwen2_vl": "vLLM CPU 0.32 imports torchvision for Qwen2-VL, which the CPU build lacks",
    "block_fp8": "vLLM's CPU build has no block-FP8 linear kernels",
}
"""Families of the matrix this module does not run, and why (each runs on GPU)."""

MLA_ENGINE = {"attention_backend": "CPU_MLA"}
"""Engine arguments of the MLA family here. Unpinned, vLLM CPU takes `AMX_MLA` on a CPU with
AMX: bf16 only, and its `process_weights_after_loading` refuses fp32 weights
(`convert_weight_packed`), so the engine never starts. Pinned, every host takes the reference
`CPU_MLA` with block size 16, as one without AMX does
(`test_engine_choices_here_do_not_depend_on_amx`)."""

RULE = {
    "qwen3_moe": ("transformed", "experts re-laid out by the CPU MoE backend"),
}
"""What the per-layer rule must find (kind, part of the description), where it finds anything."""


def _start(path: str, extra: dict):
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=path, **engine_kwargs(worker_extension_cls="tests.family_ext.FamilyExt",
                                         **extra))
    print(f"engine start {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return llm


def _stop(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def _greedy(llm) -> list[list[int]]:
    from vllm_nccl_sync.tiny import vllm_greedy

    return vllm_greedy(llm, PROMPTS, MAX_TOKENS)


def _push(llm, path: str) -> dict:
    [res] = llm.collective_rpc("nccl_test_load_dir", args=(path,), kwargs={"n_batches": 3})
    llm.reset_prefix_cache()  # cached KV came from the old weights
    print(f"push {path}: {res}", file=sys.stderr)
    return res


def _rpc(llm, method: str, *args):
    [res] = llm.collective_rpc(method, args=args)
    return res


def _plan_checks(llm, path: str, family: str) -> None:
    specs = [[n, d, s] for n, (d, s) in read_safetensors_index(path).items()]
    assert _rpc(llm, "nccl_test_plan_problems", specs) == []
    bogus = [["model.layers.0.self_attn.nope.weight", "float32", [4]]]
    [why] = _rpc(llm, "nccl_test_plan_problems", bogus)
    assert "unknown tensor" in why
    if family == "qwen2_vl":  # the older spelling of the language tower maps to the same weight
        name = "model.language_model.layers.0.mlp.down_proj.weight"
        d, s = read_safetensors_index(path)[name]
        old = name.replace("model.language_model.", "model.")
        assert _rpc(llm, "nccl_test_plan_problems", [[old, d, s]]) == []


def _state(llm) -> dict[str, str]:
    """sha256 of every parameter as the engine holds it (packed linears read back)."""
    return _rpc(llm, "nccl_test_state")


def _diff(a: dict, b: dict) -> str:
    return "differs from a fresh engine: " + ", ".join(
        sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))[:6])


def _verify_covers(checks: dict, paths: dict, family: str) -> None:
    """`verify` against the pushed checkpoint: every tensor either matches or is one the CPU
    backend packed (linears) or re-laid out (experts), said so; against the other: mismatches."""
    from vllm_nccl_sync.verify import compare

    report = compare(paths[2], [checks])
    nc = [e for e in report.entries if e.status == "not_comparable"]
    print(f"{family} verify: {report.summary()}", file=sys.stderr)
    assert report.ok and report.count("mismatch") == 0, report.summary()
    assert all("packed by vLLM's CPU backend" in e.detail or "re-laid out" in e.detail
               for e in nc), [(e.name, e.detail) for e in nc][:4]
    assert all(".experts." in e.name for e in nc if "re-laid out" in e.detail)
    stale = compare(paths[1], [checks])
    assert stale.count("mismatch") == report.count("match"), stale.summary()


@pytest.mark.vllm
@pytest.mark.parametrize("family", sorted(CPU_FAMILIES))
def test_family_updates_in_place(family, tmp_path):
    pytest.importorskip("vllm")
    extra = CPU_FAMILIES[family]
    paths = {s: save_model(build_model(family, s), str(tmp_path / f"w{s}")) for s in (1, 2)}
    hf = {s: hf_greedy(build_model(family, s), PROMPTS, MAX_TOKENS) for s in (1, 2)}
    assert hf[1] != hf[2]

    llm = _start(paths[1], extra)
    try:
        fresh1, derived1 = _greedy(llm), _rpc(llm, "nccl_test_derived")
        state1 = _state(llm)
        ptrs = _rpc(llm, "nccl_test_ptrs")
        rule = _rpc(llm, "nccl_test_rule")
        _plan_checks(llm, paths[2], family)
        res2 = _push(llm, paths[2])
        out2, derived2, state2 = _greedy(llm), _rpc(llm, "nccl_test_derived"), _state(llm)
        checks2 = _rpc(llm, "nccl_test_checksums")
        res1 = _push(llm, paths[1])
        out1, derived1b, state1b = _greedy(llm), _rpc(llm, "nccl_test_derived"), _state(llm)
        if family == "qwen3_moe":  # one expert of a layer alone: refused, the layer keeps W1
            why = _rpc(llm, "nccl_test_try_load_dir", paths[2], ["layers.0.mlp.experts.0."])
            assert "only part of their weights" in why and "all experts" in why, why
            llm.reset_prefix_cache()
            assert _state(llm) == state1b and _greedy(llm) == out1
        ptrs_after = _rpc(llm, "nccl_test_ptrs")
    finally:
        _stop(llm)
    llm = _start(paths[2], extra)
    try:
        fresh2, derived_fresh2 = _greedy(llm), _rpc(llm, "nccl_test_derived")
        fresh_state2 = _state(llm)
    finally:
        _stop(llm)

    # Everything the engine holds readably (experts as laid out, derived tensors, norms,
    # embeddings) equals a fresh engine's with the same weights.
    assert state2 == fresh_state2, _diff(state2, fresh_state2)
    assert state1b == state1, _diff(state1b, state1)
    assert fresh1 == hf[1] and fresh2 == hf[2], "a fresh engine differs from transformers"
    assert out2 == fresh2, "after push 1 (W2): differs from a fresh engine on W2"
    assert out1 == fresh1, "after push 2 (W1): differs from a fresh engine on W1"
    _verify_covers(checks2, paths, family)
    assert ptrs_after == ptrs and len(ptrs) > 5, "a parameter moved"
    for res in (res1, res2):
        assert res["loaded"] > 0 and res["stats"].get("untouched", 0) == 0, res
    assert derived2 == derived_fresh2 and derived1b == derived1, "a derived tensor is stale"
    if family in RULE:
        kind, what = RULE[family]
        found = rule[kind] if kind == "derived" else list(rule[kind].values())
        assert any(what in x for x in found), rule
        if kind == "derived":
            assert derived1 and derived2 != derived1
            assert res2["stats"]["derived_refreshed"] == len(rule["derived"]) > 0
        else:
            assert res2["stats"]["layerwise_layers"] == len(rule["transformed"]) > 0
    else:
        assert rule == {"transformed": {}, "derived": []}


@pytest.mark.vllm
def test_mla_derived_tensors_follow_every_update(tmp_path):
    """MLA (tiny DeepSeek-V2): after each push `W_UK_T`/`W_UV` equal the split of what
    `kv_b_proj` holds, in place. On vLLM CPU they start as views of `kv_b_proj`'s weight, so they
    are first given their own copies, as backends that dequantize or re-lay out `kv_b_proj` hold
    them; with the refresh skipped (negative control) they then go stale, and the check sees it.

    Compares the engine with itself, so it holds whatever vLLM CPU's own DeepSeek loading does
    (see `NOT_ON_CPU`)."""
    pytest.importorskip("vllm")
    paths = {s: save_model(build_model("deepseek_v2", s), str(tmp_path / f"w{s}")) for s in (1, 2)}
    llm = _start(paths[1], MLA_ENGINE)
    try:
        rule = _rpc(llm, "nccl_test_rule")
        consistent = dict.fromkeys(rule["derived"], True)
        assert len(consistent) == 2, rule  # one MLA attention per layer
        assert _rpc(llm, "nccl_test_mla_consistent") == consistent
        views = _rpc(llm, "nccl_test_detach_derived")
        print(f"derived tensors were views of kv_b_proj: {views}", file=sys.stderr)
        assert _rpc(llm, "nccl_test_mla_consistent") == consistent
        ptrs, before = _rpc(llm, "nccl_test_ptrs"), _rpc(llm, "nccl_test_derived")
        res = _push(llm, paths[2])
        assert res["stats"]["derived_refreshed"] == 2, res
        assert _rpc(llm, "nccl_test_mla_consistent") == consistent
        assert _rpc(llm, "nccl_test_derived") != before
        assert _rpc(llm, "nccl_test_ptrs") == ptrs
        _rpc(llm, "nccl_test_skip_derived", True)
        try:
            _push(llm, paths[1])
            assert not any(_rpc(llm, "nccl_test_mla_consistent").values()), "stale not seen"
        finally:
            _rpc(llm, "nccl_test_skip_derived", False)
        _push(llm, paths[1])
        assert _rpc(llm, "nccl_test_mla_consistent") == consistent
        assert _rpc(llm, "nccl_test_derived") == before
        assert _rpc(llm, "nccl_test_ptrs") == ptrs
    finally:
        _stop(llm)


def test_engine_choices_here_do_not_depend_on_amx(tmp_path, monkeypatch):
    """What this module's engines run on is the same with and without AMX (CI hosts may have it):
    the config vLLM builds for the tiny DeepSeek-V2 with `MLA_ENGINE` and the attention backend
    it then selects, and the fp32 linear kernels (AMX's sgl-kernel GEMM takes bf16/fp16/int8
    only). Negative control: unpinned, an AMX host selects `AMX_MLA` (block size 128)."""
    pytest.importorskip("vllm")
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU build decides this")
    path = save_model(build_model("deepseek_v2", 1), str(tmp_path / "w1"))

    def chosen(amx: bool, extra: dict) -> tuple[int, str]:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        cfg = EngineArgs(model=path, **engine_kwargs(**extra)).create_engine_config()
        mla = AttentionSelectorConfig(head_size=512 + 64, dtype=torch.float32,
                                      kv_cache_dtype="auto",
                                      block_size=cfg.cache_config.block_size, use_mla=True)
        backend = current_platform.get_attn_backend_cls(cfg.attention_config.backend, mla)
        return cfg.cache_config.block_size, backend.rsplit(".", 1)[-1]

    here = (16, "CPUMLABackend")
    assert chosen(False, MLA_ENGINE) == chosen(True, MLA_ENGINE) == chosen(False, {}) == here
    assert chosen(True, {}) == (128, "AMXMLABackend")
    for amx in (False, True):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert not check_cpu_sgl_kernel(256, 128, torch.float32)
    assert check_cpu_sgl_kernel(256, 128, torch.bfloat16)  # AMX on: bf16 would differ


def test_matrix_leaves_no_family_out():
    """Every family is run here or listed with the reason it is not; the GPU module runs all."""
    from tests.gpu.test_gpu_families import GPU_FAMILIES
    from vllm_nccl_sync.tiny import FAMILIES

    everything = {*FAMILIES, "block_fp8"}
    assert set(CPU_FAMILIES) | set(NOT_ON_CPU) == everything
    assert not set(CPU_FAMILIES) & set(NOT_ON_CPU)
    assert set(GPU_FAMILIES) == everything
