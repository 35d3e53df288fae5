"""VllmWeightLoader against a real vLLM CPU engine (no mocks).

One engine per architecture (qwen2: tied embeddings, eager; llama: untied, torch.compile), started
from W1. Weights W2, W3 (every layer matters, see `random_weights`) are fed through
begin/load/finish inside the worker; afterwards the engine's greedy output must equal transformers'
with the same weights token for token, and the storage vLLM keeps must be the storage it had before.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from vllm_nccl_sync.tiny import PROMPTS, build_model, engine_kwargs, hf_greedy, save_model

pytestmark = pytest.mark.vllm
MAX_TOKENS = 8


@pytest.fixture(
    scope="module",
    params=[("qwen2", True), ("llama", False)],
    ids=["qwen2-eager", "llama-compiled"],
)
def engine(request, tmp_path_factory):
    """One engine per architecture; llama runs vLLM's default torch.compile."""
    pytest.importorskip("vllm")
    from vllm import LLM

    arch, eager = request.param
    paths = {
        s: save_model(build_model(arch, s), str(tmp_path_factory.mktemp(f"{arch}-w{s}")))
        for s in (1, 2, 3)
    }
    t0 = time.perf_counter()
    llm = LLM(
        model=paths[1],
        **engine_kwargs(enforce_eager=eager, worker_extension_cls="tests.loader_ext.LoaderExt"),
    )
    print(
        f"\n{arch} (eager={eager}): engine start {time.perf_counter() - t0:.1f} s", file=sys.stderr
    )
    yield arch, llm, paths
    llm.llm_engine.engine_core.shutdown()
    del llm


def generate(llm) -> list[list[int]]:
    from vllm_nccl_sync.tiny import vllm_greedy

    return vllm_greedy(llm, PROMPTS, MAX_TOKENS)


def push(llm, path: str, **kw) -> dict:
    [res] = llm.collective_rpc("nccl_test_load_dir", args=(path,), kwargs=kw)
    llm.reset_prefix_cache()  # cached KV came from the old weights
    print(f"load {os.path.basename(path)}: {res}", file=sys.stderr)
    return res


def test_models_are_sensitive():
    """W1 and W2 decode differently, and one stale layer changes the output."""
    m1, m2 = build_model("llama", 1), build_model("llama", 2)
    ref = hf_greedy(m2, PROMPTS, MAX_TOKENS)
    assert hf_greedy(m1, PROMPTS, MAX_TOKENS) != ref
    for stale in (
        "model.layers.1.self_attn.o_proj.weight",
        "lm_head.weight",
        "model.layers.0.mlp.down_proj.weight",
    ):
        m = build_model("llama", 2)
        m.get_parameter(stale).data.copy_(m1.get_parameter(stale))
        assert hf_greedy(m, PROMPTS, MAX_TOKENS) != ref, stale


def test_start_matches_transformers(engine):
    arch, llm, _ = engine
    assert generate(llm) == hf_greedy(build_model(arch, 1), PROMPTS, MAX_TOKENS)


def test_update_takes_effect_in_place_twice(engine):
    arch, llm, paths = engine
    w1 = generate(llm)
    ptrs = llm.collective_rpc("nccl_test_ptrs")
    for seed in (2, 3):
        res = push(llm, paths[seed], n_batches=3)
        assert res["loaded"] > 0 and res["stats"].get("untouched", 0) == 0, res
        expected = hf_greedy(build_model(arch, seed), PROMPTS, MAX_TOKENS)
        assert generate(llm) == expected, f"W{seed}"
        assert expected != w1
        assert llm.collective_rpc("nccl_test_ptrs") == ptrs


@pytest.mark.parametrize("abort", [False, True], ids=["finish", "abort"])
def test_partial_update(engine, abort):
    """Only some tensors (one of qkv's three, the MLP of layer 1, the LM head): the rest stays W3.

    Tied qwen2 gets its LM head only as the alias `lm_head.weight`: it must reach the embedding.

    `abort()` (after a failed update) leaves the same usable mix as `finish()`."""
    arch, llm, paths = engine
    push(llm, paths[3])
    only = ["layers.0.self_attn.k_proj", "layers.1.mlp.", "lm_head"]
    res = push(llm, paths[2], n_batches=2, only=only, abort=abort)
    if not abort:
        assert res["stats"]["partial"] == 1 and res["stats"]["untouched"] > 0, res
    model, w2 = build_model(arch, 3), build_model(arch, 2)
    for name, p in model.named_parameters(remove_duplicate=False):
        if any(s in name for s in only):
            p.data.copy_(w2.get_parameter(name))
    mixed = hf_greedy(model, PROMPTS, MAX_TOKENS)
    assert mixed != hf_greedy(build_model(arch, 3), PROMPTS, MAX_TOKENS)
    assert generate(llm) == mixed
