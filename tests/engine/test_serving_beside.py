"""Receiving beside serving into a real vLLM CPU engine (`AsyncLLM`, tensor parallelism 2).

The engine keeps producing tokens while an update is received (observed: the trainer holds the
push after its first bucket until the token stream has moved on, which it never would if the
receive stopped the engine); after the swap the greedy output equals transformers' with the
pushed weights. A worker that fails verification keeps both workers on the old weights; a failure
during the swap is reported inconsistent; a trainer killed mid-receive leaves the served output
and the version unchanged. `pause_mode="carry"` swaps between two steps without pausing: a
request running at the swap keeps its KV and continues on the new weights (checked against
transformers continuing the old model's KV cache with the new model), while every request after
the swap sees only the new weights, also where its prefix was cached before the swap or filled
by the carried request after it. No test depends on wall-clock speed: every wait is for an
observed state, bounded by a generous deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from tests.helpers import carried
from tests.procs import wait_until
from vllm_nccl_sync import PushError
from vllm_nccl_sync.integrations.vllm.handles import AsyncLLMHandle
from vllm_nccl_sync.outcomes import CARRY_RPC
from vllm_nccl_sync.tiny import PROMPTS, build_model, engine_kwargs, hf_greedy, make_model
from vllm_nccl_sync.trainer.sync import WeightSync
from vllm_nccl_sync.trainer.tensors import without_aliases

pytestmark = pytest.mark.vllm
MAX_TOKENS = 8
DEADLINE_S = 120.0  # bound on waiting for an observed state; never a guess at how fast things run
BUCKET = 64 * 1024  # several buckets per update
LONG_LEN = 512  # room for a request that fills a second KV block (128 tokens each on CPU)
LONG = [(7 * i + 3) % 500 + 1 for i in range(130)]
"""A prompt that fills one whole KV block: its block is cached and can be hit."""


class Stream:
    """Clients on the engine's loop, each keeping one request in flight (the next one submitted
    as soon as one ends), so generation never stops on its own; `tokens` counts what streamed."""

    def __init__(self, engine, loop, clients: int = 2) -> None:
        self.engine, self.loop = engine, loop
        self.tokens = 0
        self.finished: list[str] = []
        self._stop = False
        self._futs = [asyncio.run_coroutine_threadsafe(self._client(c), loop)
                      for c in range(clients)]

    async def _client(self, c: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        n = 0
        while not self._stop:
            sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            seen, last = 0, None
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=PROMPTS[c]), sp,
                                                  request_id=f"stream-{id(self)}-{c}-{n}"):
                got = len(out.outputs[0].token_ids)
                self.tokens += got - seen
                seen, last = got, out
            self.finished.append(last.outputs[0].finish_reason)
            n += 1

    def moved(self, by: int, what: str) -> None:
        """Wait until `by` more tokens streamed."""
        at = self.tokens
        wait_until(lambda: self._raise() or self.tokens >= at + by, what, DEADLINE_S)

    def _raise(self) -> bool:
        for f in self._futs:
            if f.done() and f.exception() is not None:
                raise f.exception()
        return False

    def stop(self) -> list[str]:
        self._stop = True
        for f in self._futs:
            f.result(DEADLINE_S)
        return self.finished


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tests.helpers import stop_async_llm

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        path = make_model(str(tmp_path_factory.mktemp("beside")), "qwen2", seed=1)
        args = AsyncEngineArgs(model=path, worker_extension_cls="tests.fault_ext.FaultExt",
                               enable_prefix_caching=True,
                               **engine_kwargs(tensor_parallel_size=2, max_model_len=LONG_LEN))

        async def make():
            return AsyncLLM.from_engine_args(args)

        llm = asyncio.run_coroutine_threadsafe(make(), loop).result(300)
    sync = WeightSync([AsyncLLMHandle(llm, loop)], bucket_bytes=BUCKET, timeout_s=60)
    try:
        [workers] = sync.connect()
        assert sorted((w["rank"], w["tp_rank"]) for w in workers) == [(1, 0), (2, 1)]
        yield llm, loop, sync
    finally:
        sync.close()
        stop_async_llm(llm, loop)
        loop.call_soon_threadsafe(loop.stop)


def greedy(llm, loop, tag: str, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    """Greedy tokens of `prompts`; every request's tokens are one span of the engine's label."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    now = label(llm, loop)

    async def one(i: int, p: list[int]) -> list[int]:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        last = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=p), sp,
                                      request_id=f"{tag}-{i}"):
            last = out
        spans = [(x.version, x.start, x.end) for x in last.outputs[0].weight_versions]
        assert spans == [(now, 0, MAX_TOKENS)], (spans, now)
        return list(last.outputs[0].token_ids)

    async def every() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    return asyncio.run_coroutine_threadsafe(every(), loop).result(DEADLINE_S)


def label(llm, loop) -> str:
    """vLLM's weight-version label of the engine."""
    return asyncio.run_coroutine_threadsafe(llm.get_weight_version(), loop).result(DEADLINE_S)


def states(sync: WeightSync) -> list[tuple[int, bool, str]]:
    [workers] = sync.state()
    return [(w["version"], w["consistent"], w["beside"]) for w in workers]


class Recorded:
    """What every worker answered to the handle's calls of `method` (the handle is the
    fixture's: this wraps its `call` for the rest of the module)."""

    def __init__(self, handle, method: str) -> None:
        self.answers: list[dict] = []
        call = handle.call

        def recorded(m, *args, timeout=None):
            out = call(m, *args, timeout=timeout)
            if m == method:
                self.answers += out
            return out

        handle.call = recorded


def test_tokens_keep_coming_while_the_update_is_received(engine):
    llm, loop, sync = engine
    stream = Stream(llm, loop)
    stream.moved(1, "the stream's first token")
    during: list = []

    def progress(buckets: int, nbytes: int, seconds: float) -> None:
        if buckets == 1:  # the engine holds a plan and a bucket of this update; not swapped yet
            stream.moved(3, "tokens streaming while the update is received")
            during.append(states(sync))

    swapped = Recorded(sync.engines[0], "nccl_sync_swap")
    model = build_model("qwen2", seed=2)
    result = sync.update(model.state_dict(), 2, beside=True, pause_mode="keep", progress=progress)
    assert result.version == 2 and result.buckets > 2
    assert during == [[(-1, True, "receiving")] * 2], during
    # The engine's first update: the loader's copies were recorded while it served (rehearsed),
    # so the swap already replays them (the CPU backend's packed linears load through vLLM).
    assert [s["load"]["replayed"] > 0 for s in swapped.answers] == [True, True], swapped.answers
    stream.moved(1, "tokens after the swap")
    assert set(stream.stop()) <= {"length"}  # `keep`: no request lost
    assert [(x["version"], x["label"]) for x in result.live] == [(2, "2")]
    assert label(llm, loop) == "2"
    assert greedy(llm, loop, "after-2") == hf_greedy(model, PROMPTS, MAX_TOKENS)
    assert states(sync) == [(2, True, "")] * 2


def test_both_workers_swap_or_neither(engine):
    llm, loop, sync = engine
    held = build_model("qwen2", seed=2)
    before = greedy(llm, loop, "before-verify")
    # Worker 2 rejects the update's seal: worker 1 verified everything, yet neither swaps.
    asyncio.run_coroutine_threadsafe(
        llm.collective_rpc("nccl_test_arm", args=("verify", 1)), loop).result(DEADLINE_S)
    try:
        with pytest.raises(PushError, match="injected failure"):
            sync.update(build_model("qwen2", seed=3).state_dict(), 3, beside=True)
        assert states(sync) == [(2, True, "")] * 2 and label(llm, loop) == "2"
        assert greedy(llm, loop, "after-verify") == before == hf_greedy(held, PROMPTS, MAX_TOKENS)
        # Worker 2 fails half-way through its swap: both report inconsistent.
        asyncio.run_coroutine_threadsafe(
            llm.collective_rpc("nccl_test_arm", args=("load", 1)), loop).result(DEADLINE_S)
        with pytest.raises(PushError, match="injected failure"):
            sync.update(build_model("qwen2", seed=4).state_dict(), 4, beside=True)
        assert [c for _, c, _ in states(sync)] == [False, False]
        assert label(llm, loop) == "2"  # never a version a worker does not hold
    finally:
        asyncio.run_coroutine_threadsafe(
            llm.collective_rpc("nccl_test_arm", args=("",)), loop).result(DEADLINE_S)
    model = build_model("qwen2", seed=5)  # the next complete update heals both
    sync.update(model.state_dict(), 5, beside=True, pause_mode="wait")
    assert states(sync) == [(5, True, "")] * 2 and label(llm, loop) == "5"
    assert greedy(llm, loop, "after-5") == hf_greedy(model, PROMPTS, MAX_TOKENS)


def test_carry_swaps_with_tokens_streaming_and_no_request_lost(engine):
    llm, loop, sync = engine
    seen = Recorded(sync.engines[0], CARRY_RPC)
    stream = Stream(llm, loop)
    stream.moved(1, "the stream's first token")
    during: list = []

    def progress(buckets: int, nbytes: int, seconds: float) -> None:
        if buckets == 1:
            stream.moved(3, "tokens streaming while the update is received")
            during.append(states(sync))

    model = build_model("qwen2", seed=21)
    result = sync.update(model.state_dict(), 6, beside=True, pause_mode="carry",
                         progress=progress)
    assert result.version == 6 and during and during[0][0][2] == "receiving"
    assert [(x["version"], x["label"]) for x in result.live] == [(6, "6")]
    assert [s["ok"] for s in seen.answers] == [True, True], seen.answers
    assert all(s["carry"]["dropped"] for s in seen.answers)  # taken by the engine core
    # in the swap's turn, once every worker's loads were queued (not after the swap's end)
    assert all(s["carry"]["started"] >= s["beside"]["marks"]["loaded"] for s in seen.answers)
    stream.moved(3, "tokens after the swap")
    assert set(stream.stop()) <= {"length"}
    assert greedy(llm, loop, "after-6") == hf_greedy(model, PROMPTS, MAX_TOKENS)
    assert states(sync) == [(6, True, "")] * 2


def test_carry_keeps_a_running_request_on_its_kv_and_no_later_request_sees_old_kv(engine):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_nccl_sync.integrations.vllm.patches.pause import pause

    llm, loop, sync = engine
    seen = Recorded(sync.engines[0], CARRY_RPC)
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(DEADLINE_S)  # noqa: E731
    sync.update(build_model("qwen2", seed=22).state_dict(), 7, beside=True, pause_mode="wait")
    old, new = build_model("qwen2", seed=22), build_model("qwen2", seed=23)
    assert greedy(llm, loop, "cache-long", [LONG]) == hf_greedy(old, [LONG], MAX_TOKENS)
    # A long request: it hits LONG's cached block, and fills its second block after the swap.
    tokens: list[int] = []
    spans: list[tuple[str, int, int]] = []

    async def long_request() -> str:
        sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        async for out in llm.generate(TokensPrompt(prompt_token_ids=LONG), sp,
                                      request_id="carried"):
            tokens[:] = out.outputs[0].token_ids
        spans[:] = [(x.version, x.start, x.end) for x in out.outputs[0].weight_versions]
        return out.outputs[0].finish_reason

    done = asyncio.run_coroutine_threadsafe(long_request(), loop)
    wait_until(lambda: len(tokens) >= 4, "the long request's first tokens", DEADLINE_S)
    run(pause(llm, "keep", clear_cache=False))  # frozen: it is certain to span the swap
    try:
        at = len(tokens)
        sync.update(new.state_dict(), 8, beside=True, pause_mode="carry")
        assert not done.done()
    finally:
        run(llm.resume_generation())
    assert done.result(DEADLINE_S) == "length" and len(tokens) == 200
    assert [s["carry"]["requests_kept"] for s in seen.answers] == [1, 1], seen.answers
    # Its tokens: the old model's, then the new model continuing the KV computed with the old.
    reference = hf_greedy(old, [LONG], 200)[0]
    k_max = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), 200)
    assert at <= k_max, (at, k_max)
    fits = [k for k in range(at, k_max + 1)
            if tokens[k:k + MAX_TOKENS] == carried(old, new, LONG, tokens[:k], MAX_TOKENS)]
    assert fits, (at, k_max, tokens[:k_max + MAX_TOKENS])
    # Its labels say exactly that: version 7 up to the swap, 8 from the first token after it.
    [(v7, _, b), (v8, b8, end)] = spans
    assert (v7, v8, b8, end) == ("7", "8", b, 200) and b in fits, (spans, at, fits)
    assert tokens[fits[0]:fits[0] + MAX_TOKENS] != hf_greedy(
        new, [LONG + tokens[:fits[0]]], MAX_TOKENS)[0]  # not recomputed: carried KV differs
    # After the swap: LONG's cached block was dropped, and the carried request's second block
    # (filled after the swap) is never found: a follow-up turn over its output, asked twice (the
    # second hits the first's blocks), equals transformers' with the new weights.
    assert greedy(llm, loop, "long-after", [LONG]) == hf_greedy(new, [LONG], MAX_TOKENS)
    turn = LONG + tokens[:150]
    want = hf_greedy(new, [turn], MAX_TOKENS)
    assert greedy(llm, loop, "turn-1", [turn]) == want
    assert greedy(llm, loop, "turn-2", [turn]) == want
    assert states(sync) == [(8, True, "")] * 2


def _doomed_trainer(cfg: dict, go, seed: int) -> None:
    """A trainer process: joins, waits for `go`, pushes beside serving and SIGKILLs itself once
    its second bucket is on the wire."""
    from vllm_nccl_sync.tiny import build_model
    from vllm_nccl_sync.trainer.push import PushClient
    from vllm_nccl_sync.wire.config import SyncConfig

    client = PushClient(SyncConfig.from_dict(cfg))
    client.connect()
    go.wait(DEADLINE_S)

    def die(buckets: int, nbytes: int, seconds: float) -> None:
        if buckets == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    client.push(build_model("qwen2", seed).state_dict(), 9, staged=True, progress=die)


def test_a_trainer_killed_mid_receive_leaves_the_served_weights(engine):
    import multiprocessing as mp

    from vllm_nccl_sync.wire.config import SyncConfig

    llm, loop, sync = engine
    [held] = {v for v, _, _ in states(sync)}
    before = greedy(llm, loop, "before-kill")
    cfg = SyncConfig.build(world_size=3, backend="gloo", bucket_bytes=BUCKET, timeout_s=10)
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    trainer = ctx.Process(target=_doomed_trainer, args=(cfg.to_dict(), go, 9), daemon=True)
    trainer.start()
    stream = None
    try:
        rpc = lambda *a: asyncio.run_coroutine_threadsafe(  # noqa: E731
            llm.collective_rpc(a[0], args=a[1:], timeout=DEADLINE_S), loop).result(DEADLINE_S)
        assert [j["rank"] for j in rpc("nccl_sync_join", cfg.to_dict(), 1)] == [1, 2]
        assert all(s["ok"] for s in rpc("nccl_sync_receive_beside", 10.0, "device"))
        stream = Stream(llm, loop)
        go.set()
        trainer.join(DEADLINE_S)
        assert trainer.exitcode == -signal.SIGKILL
        stream.moved(3, "tokens streaming while the receive waits for the dead trainer")
        wait_until(lambda: all(b == "" for _, _, b in states(sync)),
                   "the receive beside serving ending by its own timeout", DEADLINE_S)
        summaries = rpc("nccl_sync_swap", 30.0)
        assert not any(s["ok"] for s in summaries), summaries
        assert states(sync) == [(held, True, "")] * 2
        assert label(llm, loop) == str(held)  # a failed update changes no label
        stream.moved(1, "tokens after the failed update")
        assert set(stream.stop()) <= {"length"}
        stream = None
        assert greedy(llm, loop, "after-kill") == before
    finally:
        if stream is not None:
            stream.stop()
        if trainer.is_alive():
            trainer.kill()
    # A new trainer joins and updates the engine fully.
    fresh = WeightSync([AsyncLLMHandle(llm, loop)], bucket_bytes=BUCKET, timeout_s=60)
    try:
        fresh.connect()
        model = build_model("qwen2", seed=11)
        fresh.update(model.state_dict(), 11, beside=True)
        assert greedy(llm, loop, "after-11") == hf_greedy(model, PROMPTS, MAX_TOKENS)
    finally:
        fresh.close()



def test_shard_to_shard_beside_serving_keeps_only_each_workers_blocks(engine):
    """Received beside serving shard to shard, each worker's shadow keeps only its own blocks
    (about half the model on TP=2, where a broadcast keeps the whole model in each), and after
    the swap the engine answers as transformers does."""
    llm, loop, _ = engine
    shard = WeightSync([AsyncLLMHandle(llm, loop)], bucket_bytes=BUCKET, timeout_s=60, shard=True)
    try:
        shard.connect()
        model = build_model("qwen2", seed=12)
        result = shard.update(model.state_dict(), 12, beside=True)
        assert greedy(llm, loop, "after-12") == hf_greedy(model, PROMPTS, MAX_TOKENS)
        kept = {r["rank"]: r["shadow_kept"] for e in shard.state() for r in e}
    finally:
        shard.close()
    model_bytes = sum(t.nbytes for _, t in without_aliases(model.state_dict()))
    got = {a.rank: a.bytes for a in result.acks}
    assert set(kept) == set(got) == {1, 2}
    for rank, n in kept.items():
        print(f"rank {rank}: the shadow kept {n / model_bytes:.3f} of the model (broadcast: 1)")
        assert 0 < n < 0.6 * model_bytes and n <= got[rank]  # what arrived, no more
