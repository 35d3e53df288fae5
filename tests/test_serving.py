"""Live hot-swap while serving (issue 4): AsyncLLM in-process and a real `vllm serve` process.

Requests are in flight while the update runs; each pause mode is checked for what it promises:
`wait` and `keep` lose no request, `abort` reports the requests it aborted as aborted. After each
update the engine's greedy output equals transformers' with the pushed weights, and the engine
reports the version it holds.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import Future

import pytest

from vllm_nccl_sync.engines import AsyncLLMHandle, HTTPHandle
from vllm_nccl_sync.sync import WeightSync
from vllm_nccl_sync.testing import (
    PROMPTS,
    build_model,
    engine_kwargs,
    hf_greedy,
    make_model,
    start_server,
)

pytestmark = pytest.mark.vllm
MAX_TOKENS = 8
LONG = 160  # tokens per in-flight request: long enough to still run when the update starts


# ---------------------------------------------------------------------------- AsyncLLM in-process


@pytest.fixture(scope="module")
def async_engine(tmp_path_factory):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    path = make_model(str(tmp_path_factory.mktemp("async")), "qwen2", seed=1)
    args = AsyncEngineArgs(model=path, worker_extension_cls="vllm_nccl_sync.Ext", **engine_kwargs())

    async def make():
        return AsyncLLM.from_engine_args(args)

    engine = asyncio.run_coroutine_threadsafe(make(), loop).result(300)
    sync = WeightSync([AsyncLLMHandle(engine, loop)], timeout_s=60)
    sync.connect()
    yield engine, loop, sync
    sync.close()
    engine.shutdown()
    loop.call_soon_threadsafe(loop.stop)


def _submit(engine, loop, prompt: list[int], max_tokens: int, rid: str) -> Future:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    async def run():
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        last = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, request_id=rid):
            last = out
        return list(last.outputs[0].token_ids), last.outputs[0].finish_reason

    return asyncio.run_coroutine_threadsafe(run(), loop)


def _greedy_async(engine, loop, tag: str) -> list[list[int]]:
    futs = [_submit(engine, loop, p, MAX_TOKENS, f"{tag}-{i}") for i, p in enumerate(PROMPTS)]
    return [f.result(120)[0] for f in futs]


@pytest.mark.parametrize("mode, version", [("wait", 2), ("keep", 3), ("abort", 4)])
def test_async_llm_update_while_serving(async_engine, mode, version):
    engine, loop, sync = async_engine
    inflight = [_submit(engine, loop, p, LONG, f"{mode}-long-{i}") for i, p in enumerate(PROMPTS)]
    time.sleep(0.5)  # let them start decoding
    assert not all(f.done() for f in inflight), "requests finished before the update: make them longer"
    model = build_model("qwen2", seed=version)
    result = sync.update(model.state_dict(), version=version, pause_mode=mode)
    assert result.version == version and len(result.acks) == 1
    finished = [f.result(180) for f in inflight]
    reasons = [r for _, r in finished]
    if mode == "abort":
        assert "abort" in reasons, reasons  # aborted requests come back marked as aborted
        assert all(r in ("abort", "length") for r in reasons)
    else:
        assert reasons == ["length"] * len(PROMPTS), reasons  # nothing lost
        assert all(len(toks) == LONG for toks, _ in finished)
    assert _greedy_async(engine, loop, f"check-{mode}") == hf_greedy(model, PROMPTS, MAX_TOKENS)
    [[state]] = sync.state()
    assert state["version"] == version and state["consistent"]


def test_async_llm_refuses_going_back_unless_forced(async_engine):
    from vllm_nccl_sync import PushError

    engine, loop, sync = async_engine
    [[held]] = sync.state()
    old = build_model("qwen2", seed=1)
    with pytest.raises(PushError, match="refused update"):
        sync.update(old.state_dict(), version=held["version"] - 1)
    [[state]] = sync.state()
    assert state["version"] == held["version"] and state["consistent"]
    sync.update(old.state_dict(), version=1, force=True)
    assert _greedy_async(engine, loop, "forced") == hf_greedy(old, PROMPTS, MAX_TOKENS)
    [[state]] = sync.state()
    assert state["version"] == 1


# ---------------------------------------------------------------------------- vllm serve (HTTP)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp("served")), "qwen2", seed=1)
    proc, url = start_server(path, str(tmp_path_factory.mktemp("logs") / "server.log"))
    sync = WeightSync([HTTPHandle(url)], timeout_s=60)
    sync.connect()
    yield url, path, sync
    sync.close()
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _complete(url: str, path: str, prompt: list[int], max_tokens: int) -> dict:
    import json

    body = {"model": path, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=180) as r:
        return json.loads(r.read())["choices"][0]


@pytest.mark.parametrize("mode, version", [("wait", 2), ("keep", 3)])
def test_served_update_with_requests_in_flight(server, mode, version):
    from concurrent.futures import ThreadPoolExecutor

    url, path, sync = server
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        inflight = [pool.submit(_complete, url, path, p, LONG) for p in PROMPTS]
        time.sleep(1.0)
        assert not all(f.done() for f in inflight)
        model = build_model("qwen2", seed=version)
        result = sync.update(model.state_dict(), version=version, pause_mode=mode)
        finished = [f.result(240) for f in inflight]  # raises if any request failed
    assert result.version == version
    assert [c["finish_reason"] for c in finished] == ["length"] * len(PROMPTS)
    assert all(len(c["token_ids"]) == LONG for c in finished)
    after = [_complete(url, path, p, MAX_TOKENS)["token_ids"] for p in PROMPTS]
    assert after == hf_greedy(model, PROMPTS, MAX_TOKENS)
    [[state]] = sync.state()
    assert state["version"] == version
