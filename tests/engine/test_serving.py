"""Live hot-swap while serving: AsyncLLM in-process and a real `vllm serve` process.

Requests are in flight while the update runs; each pause mode is checked for what it promises:
`wait` and `keep` lose no request, `abort` reports the requests it aborted as aborted. After each
update the engine's greedy output equals transformers' with the pushed weights, and the engine
reports the version it holds.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import urllib.request
from concurrent.futures import Future

import pytest

from tests.helpers import carried
from tests.procs import wait_until
from vllm_nccl_sync.integrations.vllm.handles import AsyncLLMHandle, HTTPHandle
from vllm_nccl_sync.outcomes import label_version, version_label
from vllm_nccl_sync.tiny import (
    PROMPTS,
    build_model,
    engine_kwargs,
    hf_greedy,
    make_model,
    start_server,
    stop_server,
)
from vllm_nccl_sync.trainer.sync import WeightSync

pytestmark = pytest.mark.vllm
MAX_TOKENS = 8
LONG = 160  # tokens per in-flight request (prompts are <= 12 tokens, max_model_len is 256)
DEADLINE_S = 120.0  # bound on waiting for an observed state; never a guess at how fast things run

# No test here depends on wall-clock speed. "Requests are in flight" is observed (each request has
# streamed a token), never assumed after a sleep; and every assertion about the in-flight requests
# holds whether a request was still running when the update paused the engine or had already
# finished: `wait`/`keep` -> finish_reason "length" with all LONG tokens, `abort` -> that, or
# "abort" with fewer. Where a request *must* be held by the engine at the pause (abort), the test
# freezes the engine first and adds one while it is frozen (see the abort case below).



def _all_started(started: list[threading.Event], futs: list[Future]) -> bool:
    for f in futs:  # a request that failed will never start: raise its error, don't wait
        if f.done() and f.exception() is not None:
            raise f.exception()
    return all(e.is_set() for e in started)


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


def _submit(engine, loop, prompt: list[int], max_tokens: int, rid: str,
            started: threading.Event | None = None) -> Future:
    """Generate on the engine's loop; `started` is set once the engine has streamed a token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    async def run():
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        last = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, request_id=rid):
            last = out
            if started is not None and out.outputs[0].token_ids:
                started.set()
        return list(last.outputs[0].token_ids), last.outputs[0].finish_reason, _spans(last)

    return asyncio.run_coroutine_threadsafe(run(), loop)


def _spans(out) -> list[tuple[str, int, int]]:
    """A finished request's weight-version spans, as vLLM reports them."""
    return [(s.version, s.start, s.end) for s in out.outputs[0].weight_versions or []]


def _submit_added(engine, loop, prompt: list[int], max_tokens: int,
                  rid: str) -> tuple[threading.Event, Future]:
    """Like `_submit`, through `AsyncLLM.add_request`: `added` is set once the request has been
    sent to the engine core, on the same input socket (hence in order) as a later pause."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    added = threading.Event()

    async def run():
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        q = await engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), sp)
        added.set()
        while True:
            out = q.get_nowait() or await q.get()
            if out.finished:
                return list(out.outputs[0].token_ids), out.outputs[0].finish_reason, _spans(out)

    return added, asyncio.run_coroutine_threadsafe(run(), loop)


def _on_loop(loop, coro, timeout: float = DEADLINE_S):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def _greedy_async(engine, loop, tag: str, label: str | None = None) -> list[list[int]]:
    """Greedy tokens of every prompt; with `label`, each request's tokens are one span of it."""
    futs = [_submit(engine, loop, p, MAX_TOKENS, f"{tag}-{i}") for i, p in enumerate(PROMPTS)]
    done = [f.result(120) for f in futs]
    if label is not None:
        assert [spans for _, _, spans in done] == [[(label, 0, MAX_TOKENS)]] * len(PROMPTS)
    return [toks for toks, _, _ in done]


def _label(engine, loop) -> str:
    return _on_loop(loop, engine.get_weight_version())


def _split(toks: list[int], spans: list[tuple[str, int, int]], old: str,
           new: str) -> int:
    """Where a request's tokens go from weights `old` to `new` (len(toks): never): its spans are
    contiguous over all its tokens, and at most one boundary, from `old` to `new`."""
    assert spans and spans[0][1] == 0 and spans[-1][2] == len(toks), spans
    assert all(a[2] == b[1] for a, b in itertools.pairwise(spans)), spans
    assert [v for v, _, _ in spans] in ([old], [old, new], [new]), (spans, old, new)
    return next((s for v, s, _ in spans if v == new), len(toks))


@pytest.mark.parametrize("mode, version", [("wait", 2), ("keep", 3), ("abort", 4)])
def test_async_llm_update_while_serving(async_engine, mode, version):
    engine, loop, sync = async_engine
    started = [threading.Event() for _ in PROMPTS]
    inflight = [_submit(engine, loop, p, LONG, f"{mode}-long-{i}", e)
                for i, (p, e) in enumerate(zip(PROMPTS, started))]
    wait_until(lambda: _all_started(started, inflight),
               "every in-flight request streaming a token", DEADLINE_S)
    held = None
    if mode == "abort":
        # For `abort` to be exercised, the engine must hold a request when the update pauses it;
        # "still running after we looked" would be a speed assumption. So freeze the engine
        # (`keep`: nothing is scheduled, nothing finishes) and add one more request while it is
        # frozen: it sits in the engine's queue, and the update's abort pause (sent later on the
        # same socket) must abort it. The running ones are frozen wherever they had got to.
        _on_loop(loop, engine.pause_generation(mode="keep", clear_cache=False))
        try:
            added, held = _submit_added(engine, loop, PROMPTS[0], LONG, "abort-held")
            wait_until(added.is_set, "the held request reaching the frozen engine", DEADLINE_S)
        except BaseException:
            _on_loop(loop, engine.resume_generation())
            raise
    before = _label(engine, loop)
    model = build_model("qwen2", seed=version)
    result = sync.update(model.state_dict(), version=version, pause_mode=mode)
    assert result.version == version and len(result.acks) == 1
    [live] = result.live  # set in the turn that received it, before the engine resumed
    assert (live["version"], live["label"]) == (version, str(version)), live
    finished = [f.result(180) for f in inflight]
    reasons = [r for _, r, _ in finished]
    if mode == "abort":
        toks, reason, spans = held.result(180)  # held by the engine at the pause: aborted
        assert (toks, reason, spans) == ([], "abort", [])
        # Each running request had either completed before the freeze or was aborted unfinished.
        for toks, reason, _ in finished:
            assert (reason, len(toks) == LONG) in (("length", True), ("abort", False)), (
                reason, len(toks))
    else:
        # Nothing lost, whether a request was still running at the pause or had just finished.
        assert reasons == ["length"] * len(PROMPTS), reasons
        assert all(len(toks) == LONG for toks, _, _ in finished)
    _check_spans(mode, finished, before, version)
    assert _label(engine, loop) == str(version)
    assert _greedy_async(engine, loop, f"check-{mode}", str(version)) == hf_greedy(
        model, PROMPTS, MAX_TOKENS)
    [[state]] = sync.state()
    assert state["version"] == version and state["consistent"]


def _check_spans(mode: str, finished: list, before: str, version: int) -> None:
    """The in-flight requests' spans: `wait` finishes them on the old weights; `abort`'s end at
    their last token, on the old weights; under `keep` a request paused mid-way is labelled old
    up to the swap and new after it. Its tokens say the same: the old model's greedy tokens just
    before the boundary (continuing the engine's own tokens), the new model's from it."""
    old_version = label_version(before)
    old = build_model("qwen2", seed=old_version if old_version >= 0 else 1)
    new = build_model("qwen2", seed=version)
    n = MAX_TOKENS
    for prompt, (toks, _, spans) in zip(PROMPTS, finished, strict=True):
        b = _split(toks, spans, before, str(version))
        if mode != "keep":
            assert b == len(toks), spans  # nothing sampled with the new weights
        if b >= n:
            assert toks[b - n:b] == hf_greedy(old, [prompt + toks[:b - n]], n)[0], (b, spans)
        if b + n <= len(toks):
            after = toks[b:b + n]
            assert after in (carried(old, new, prompt, toks[:b], n),  # its KV kept
                             hf_greedy(new, [prompt + toks[:b]], n)[0]), (b, spans)  # recomputed


def test_async_llm_pause_goes_straight_to_the_engine_core(async_engine):
    """The handle pauses through the engine core (`integrations/vllm/patches/pause.py`), never
    through
    `pause_generation` and its closing sleep, on this vLLM; the engine is paused, then resumed."""
    from vllm_nccl_sync.integrations.vllm.patches import pause as pause_patch

    engine, loop, sync = async_engine
    assert pause_patch._direct(engine, clear_cache=True)
    [handle] = sync.engines
    called = []
    real = engine.pause_generation

    async def spy(**kw):
        called.append(kw)
        await real(**kw)

    engine.pause_generation = spy
    try:
        handle.pause("abort")
        assert _on_loop(loop, engine.is_paused())
        handle.resume()
        assert not _on_loop(loop, engine.is_paused())
    finally:
        del engine.pause_generation
    assert called == []
    assert _greedy_async(engine, loop, "after-pause") == _greedy_async(engine, loop, "again")


def test_async_llm_refuses_going_back_unless_forced(async_engine):
    from vllm_nccl_sync import PushError

    engine, loop, sync = async_engine
    [[held]] = sync.state()
    label = _label(engine, loop)
    assert label == version_label(held["version"])  # one value: the engine's label and ours
    old = build_model("qwen2", seed=1)
    with pytest.raises(PushError, match="refused update"):
        sync.update(old.state_dict(), version=held["version"] - 1)
    [[state]] = sync.state()
    assert state["version"] == held["version"] and state["consistent"]
    assert _label(engine, loop) == label  # a refused update changes no label
    sync.update(old.state_dict(), version=1, force=True)
    assert _greedy_async(engine, loop, "forced", "1") == hf_greedy(old, PROMPTS, MAX_TOKENS)
    [[state]] = sync.state()
    assert state["version"] == 1


# ---------------------------------------------------------------------------- vllm serve (HTTP)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_model(str(tmp_path_factory.mktemp("served")), "qwen2", seed=1)
    proc, url = start_server(path, str(tmp_path_factory.mktemp("logs") / "server.log"),
                             args=["--enable-scale-out"])  # vLLM's /inference/v1/generate
    sync = WeightSync([HTTPHandle(url)], timeout_s=60)
    sync.connect()
    yield url, path, sync
    sync.close()
    stop_server(proc)


def _complete(url: str, path: str, prompt: list[int], max_tokens: int) -> dict:
    import json

    body = {"model": path, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=180) as r:
        return json.loads(r.read())["choices"][0]


def _generate(url: str, prompt: list[int], max_tokens: int) -> dict:
    """vLLM's token-in/token-out route (`--enable-scale-out`): tokens and weight-version spans."""
    import json

    body = {"token_ids": prompt, "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens,
                                                     "ignore_eos": True}}
    req = urllib.request.Request(url + "/inference/v1/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=180) as r:
        return json.loads(r.read())["choices"][0]


def _weight_info(url: str) -> str:
    import json

    with urllib.request.urlopen(url + "/weight_info", timeout=60) as r:
        return json.loads(r.read())["weight_version"]


def _complete_streamed(url: str, path: str, prompt: list[int], max_tokens: int,
                       started: threading.Event) -> dict:
    """`_complete` as a stream; `started` is set once the server has streamed a token."""
    import json

    body = {"model": path, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    token_ids: list[int] = []
    finish_reason = None
    with urllib.request.urlopen(req, timeout=180) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:"):].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"streamed completion failed: {chunk['error']}")
            for choice in chunk.get("choices", []):
                token_ids += choice.get("token_ids") or []
                finish_reason = choice.get("finish_reason") or finish_reason
            if token_ids:
                started.set()
    return {"token_ids": token_ids, "finish_reason": finish_reason}


@pytest.mark.parametrize("mode, version", [("wait", 2), ("keep", 3)])
def test_served_update_with_requests_in_flight(server, mode, version):
    from concurrent.futures import ThreadPoolExecutor

    url, path, sync = server
    started = [threading.Event() for _ in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        inflight = [pool.submit(_complete_streamed, url, path, p, LONG, e)
                    for p, e in zip(PROMPTS, started)]
        # In flight = the server has streamed each request a token (observed, not slept on).
        # Whether each is still running when the update pauses the server or has just finished,
        # `wait` and `keep` must return it whole: the assertions below hold either way.
        wait_until(lambda: _all_started(started, inflight),
                   "every in-flight request streaming a token", DEADLINE_S)
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
    # The server's label: the same value, on /weight_info and on every output's spans.
    assert [(x["version"], x["label"]) for x in result.live] == [(version, str(version))]
    assert _weight_info(url) == str(version)
    generated = [_generate(url, p, MAX_TOKENS) for p in PROMPTS]
    assert [g["token_ids"] for g in generated] == after
    assert all(g["weight_versions"] == [{"version": str(version), "start": 0, "end": MAX_TOKENS}]
               for g in generated), generated
