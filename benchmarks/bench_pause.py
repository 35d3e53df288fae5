"""The pause that requests served by `AsyncLLM` see around a weight update, against the push alone.

    python benchmarks/bench_pause.py --layers 14 --updates 5 --json out.json   # 2 GPUs
    python benchmarks/bench_pause.py --trainer-gpu cpu --engine-gpu 0 ...       # 1 GPU, gloo
    python benchmarks/bench_pause.py --cpu-smoke --updates 2 --json out.json    # gloo, CPU vLLM

This process is the trainer and the front end of a vLLM v1 `AsyncLLM` (what `vllm serve` runs):
its engine core is a process of its own on `--engine-gpu`, its event loop runs in a thread here,
and the trainer's `WeightSync` drives it through `AsyncLLMHandle` from the main thread, pushing
from `--trainer-gpu` over NCCL. The model is `bench_vllm_gpu.py`'s Qwen2-7B-shaped bf16 model
(`--layers 14`: 8.7 GB, 171 tensors; `load_format="dummy"`), with torch.compile and CUDA graphs
unless `--eager`. `--clients` streaming clients on the engine's loop each keep one request in
flight (random prompt ids, `--max-tokens` tokens, then the next request at once), so generation
never stops on its own; with `--stagger` the clients' first requests have 1/clients, 2/clients,
... of the tokens, so requests end (and new ones are prefilled) one at a time rather than all at
once. Every token's arrival is time-stamped on the loop.

Each update is a plain `WeightSync.update(tensors, version, pause_mode=...)`. The engine's own
calls (`pause_generation`, `collective_rpc`, `reset_prefix_cache`, `resume_generation`) and
`PushClient.push` are wrapped to record when they ran, so the measurement follows whatever those
calls do. With `--trainer-gpu cpu` the trainer's tensors stay on the host and travel over gloo
to the engine on one GPU: the push is then slower than over NCCL, but everything around it (the
engine's pause, reset, resume and first step) is the GPU engine's own. Per update:

  paused       the handle's pause called -> the engine's `resume_generation` returned: how long
               generation is held for the update
  push         `PushClient.push`, start to return: the transfer (plan, buckets, commit)
  stall        the gap in the engine's token stream (all clients) that contains the push's start:
               last token before it to the first one after; what a user sees as the pause,
               the first step after the resume included
  phases       last token -> pause called; pause call (`integrations/vllm/patches/pause.py`: the
  engine core's
               pause without `pause_generation`'s closing 20 ms sleep, on the vLLM versions it
               checks); pause returned -> push; push; push returned -> receive RPCs
               returned; prefix-cache reset; resume; resume returned -> first token (the first
               step: with `keep`, the reset preempts the running requests, which recompute)
  per client   each client's own gap around the push (median, max)

`--pause-modes beside:keep,beside:wait,...` receives beside serving
(`WeightSync.update(beside=True)`): the engine keeps generating during the push and is paused per
the mode only for the swap (`beside:carry` never pauses: the swap runs between two steps and the
running requests keep their KV). Then also reported: the longest token gap anywhere around the update
(`max_gap_s`, and where it fell against the worker's own steps and garbage collections), the gap
the swap made, the decode rate during the receive against `--baseline-s` of undisturbed decoding
just before the update, and the requests that spanned the swap (`wait` promises none).
`--trainer-process` pushes from a process of its own (`trainer_proc.py`), as an RL trainer does,
instead of from this one, which is also the engine's front end.

The step interval (median gap between a client's consecutive tokens outside updates) is
reported for scale. The target is paused <= push + 20 ms. After the timed updates the engine's
weights are zeroed, one more update runs, and every engine parameter is compared bit for bit
(exact int64 checksums) with the trainer's tensors; with `keep` and `wait` no request may be lost.
The analysis of what was recorded is `pause_analysis.py`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import shutil
import sys
import threading
import time
from array import array
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

SMOKE_DIMS = dict(hidden=128, inter=256, heads=4, kv_heads=2, vocab=1000)
"""`--cpu-smoke`: vLLM CPU attention needs a head size of 32 or more."""
GPU_ARGS = dict(layers=14, clients=16, prompt_len=128, max_tokens=256, settle_tokens=8,
                bucket_mib=0)
SMOKE_ARGS = dict(layers=2, clients=2, prompt_len=8, max_tokens=16, settle_tokens=4,
                  bucket_mib=0.0625)
"""Defaults of the options left out (bucket 0: the library's default)."""


class Timeline:
    """Start and end (`perf_counter`) of every wrapped call, in the order they ended."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def add(self, name: str, t0: float, t1: float, **extra: Any) -> None:
        with self.lock:
            self.events.append({"name": name, "t0": t0, "t1": t1, **extra})

    def between(self, t0: float, t1: float) -> dict[str, dict[str, Any]]:
        """The last event of each name that ran inside [t0, t1]."""
        with self.lock:
            return {e["name"]: e for e in self.events if e["t0"] >= t0 and e["t1"] <= t1}


def instrument(engine: Any, handle: Any, client: Any, tl: Timeline) -> None:
    """Record the handle's pause, the engine calls it makes and the trainer's push in `tl`."""

    def wrap_async(name: str, fn: Any) -> Any:
        async def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = await fn(*args, **kwargs)
            label = f"rpc:{args[0] if args else kwargs.get('method')}" if name == "rpc" else name
            extra = {"result": out} if label in ("rpc:nccl_sync_receive", "rpc:nccl_sync_swap",
                                                 "rpc:nccl_sync_swap_carry") else {}
            tl.add(label, t0, time.perf_counter(), **extra)
            return out
        return timed

    for attr, name in (("reset_prefix_cache", "reset_prefix_cache"),
                       ("resume_generation", "resume"), ("collective_rpc", "rpc")):
        setattr(engine, attr, wrap_async(name, getattr(engine, attr)))
    pause, push = handle.pause, client.push

    def timed_pause(mode: str) -> None:  # whatever the handle calls to pause the engine
        t0 = time.perf_counter()
        pause(mode)
        tl.add("pause", t0, time.perf_counter())

    handle.pause = timed_pause

    def timed_push(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = push(*args, **kwargs)
        tl.add("push", t0, time.perf_counter(), reported_s=out.seconds, buckets=out.buckets)
        return out

    client.push = timed_push


class Probes:
    """Where a gap in the token stream came from: when the engine core produced each step's
    outputs (their own timestamp, taken in the core process) against when this front end got
    them, this process's garbage collections and the times its threads were held up (`Watch`).
    Kept in arrays (no object per record), so the probes add no work to the collector they
    watch."""

    def __init__(self, engine: Any) -> None:
        from bench_vllm_gpu import Watch

        self.watch = Watch(threads=())  # this process held up (with the engine's: the host)
        self.core, self.seen = array("d"), array("d")  # per EngineCoreOutputs
        self.gcs = array("d")  # start, seconds, generation; flat
        self._gc_t0 = 0.0
        core = engine.engine_core
        get = core.get_output_async

        async def timed_get() -> Any:
            out = await get()
            self.core.append(out.timestamp)  # time.monotonic() there: perf_counter's clock
            self.seen.append(time.perf_counter())
            return out

        core.get_output_async = timed_get  # the output handler looks it up on every step
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gcs.extend((self._gc_t0, time.perf_counter() - self._gc_t0,
                             info.get("generation", -1)))

    def close(self) -> None:
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)

    def view(self) -> dict[str, list]:
        """What `pause_analysis.analyse` reads: core steps as (produced, received), GCs."""
        g = self.gcs
        return {"core": list(zip(self.core, self.seen)),
                "gcs": [tuple(g[i:i + 3]) for i in range(0, len(g), 3)],
                "frontend_stalls": [x[:2] for x in self.watch.take()]}


# ----------------------------------------------------------------------------- the request stream


class Stream:
    """`clients` coroutines on the engine's loop, each keeping one streaming request in flight."""

    def __init__(self, engine: Any, loop: Any, args: Any, vocab: int) -> None:
        self.engine, self.loop, self.args, self.vocab = engine, loop, args, vocab
        self.times, self.who = array("d"), array("i")  # every streamed token: arrival, client
        self.firsts = array("d")  # every request's first token: when a prefill step ended
        self.requests: list[tuple[float, float, str]] = []  # (first, last token, finish reason)
        self.counts = [0] * args.clients
        self.finished: dict[str, int] = {}
        self.short: list[tuple[str, int]] = []  # requests that ended with fewer tokens
        self.stop = threading.Event()
        self.futs = [asyncio.run_coroutine_threadsafe(self._client(c), loop)
                     for c in range(args.clients)]

    async def _client(self, cid: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rng = random.Random(cid)
        full = self.args.max_tokens
        n = 0
        while not self.stop.is_set():
            want = full * (cid + 1) // self.args.clients if self.args.stagger and not n else full
            sp = SamplingParams(temperature=0.0, max_tokens=want, ignore_eos=True,
                                detokenize=False)
            prompt = [rng.randrange(3, self.vocab) for _ in range(self.args.prompt_len)]
            got, reason, first, last = 0, None, None, None
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt), sp,
                                                  request_id=f"c{cid}-{n}"):
                k = len(out.outputs[0].token_ids)
                if k > got:
                    t = time.perf_counter()
                    self.times.extend([t] * (k - got))
                    self.who.extend([cid] * (k - got))
                    self.counts[cid] += k - got
                    got, last = k, t
                    if first is None:
                        self.firsts.append(t)
                    first = first or t
                reason = out.outputs[0].finish_reason
            self.finished[str(reason)] = self.finished.get(str(reason), 0) + 1
            if first is not None:
                self.requests.append((first, last, str(reason)))
            if got != want:
                self.short.append((str(reason), got))
            n += 1

    @property
    def tokens(self) -> list[tuple[float, int]]:
        """(arrival, client) of every streamed token so far."""
        n = min(len(self.times), len(self.who))
        return list(zip(self.times[:n], self.who[:n]))

    def check(self) -> None:
        for f in self.futs:  # a client that failed raises its error here
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()

    def wait_tokens(self, each: int, timeout_s: float, what: str) -> None:
        """Until every client has streamed `each` more tokens than now (observed, bounded)."""
        want = [c + each for c in self.counts]
        end = time.monotonic() + timeout_s
        while any(c < w for c, w in zip(self.counts, want)):
            self.check()
            if time.monotonic() > end:
                raise TimeoutError(f"{what}: clients streamed {self.counts}, wanted {want} "
                                   f"within {timeout_s:.0f} s")
            time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        for f in self.futs:
            f.cancel()  # the in-flight request is aborted with its task


# ----------------------------------------------------------------------------- analysis


# ----------------------------------------------------------------------------- the run


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def start_engine(args: Any, path: str, loop: Any) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    ea = AsyncEngineArgs(
        model=path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        enforce_eager=args.eager or args.cpu_smoke, gpu_memory_utilization=args.gpu_mem,
        max_model_len=args.prompt_len + args.max_tokens + 16, max_num_seqs=args.clients, seed=0,
        worker_extension_cls="bench_vllm_gpu.BenchExt")

    async def make() -> Any:
        return AsyncLLM.from_engine_args(ea)

    return asyncio.run_coroutine_threadsafe(make(), loop).result(args.start_s)


def run(args: Any) -> dict:
    import tempfile

    import bench_vllm_gpu as bvg
    import torch
    from pause_analysis import analyse, spanned, step_interval, summarise, table
    from trainer_proc import RemoteClient, host_tensors

    from tests.helpers import stop_async_llm
    from vllm_nccl_sync.integrations.vllm.handles import AsyncLLMHandle
    from vllm_nccl_sync.trainer.sync import WeightSync

    if args.cpu_smoke:
        bvg.DIMS.update(SMOKE_DIMS)
    path = bvg.save_config(tempfile.mkdtemp(prefix="bench-pause-"), args.layers)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    t0 = time.perf_counter()
    engine = start_engine(args, path, loop)
    startup = time.perf_counter() - t0
    stream = sync = probes = None
    try:
        host = args.cpu_smoke or args.trainer_gpu == "cpu"  # the trainer's tensors on the host
        dev = None if host else torch.device("cuda", 1)  # see main(): the trainer's GPU
        if dev is not None:
            torch.cuda.set_device(dev)  # NCCL and every trainer tensor on it, never the engine's
        if args.trainer_threads:
            torch.set_num_threads(args.trainer_threads)
        handle = AsyncLLMHandle(engine, loop, call_timeout_s=args.timeout_s)
        bucket = int(args.bucket_mib * (1 << 20)) if args.bucket_mib else None
        sync = WeightSync([handle], backend="gloo" if host else "nccl",
                          bucket_bytes=bucket, timeout_s=args.timeout_s, device=dev,
                          receive_process=args.receive_process)
        remote = host and args.trainer_process
        if remote:  # the push from a process of its own (trainer_proc), tensors drawn there
            sync.client.close()
            sync.client = RemoteClient(sync.cfg, args.layers, dict(bvg.DIMS),
                                       args.trainer_threads, args.timeout_s)
            tensors: dict = {}
            nbytes = sum(math.prod(s) * 2 for _, s in bvg.model_spec(args.layers))
            ntensors = len(bvg.model_spec(args.layers))
            expected = sync.client.expected()
        else:
            if host:
                tensors = host_tensors(args.layers)
            else:
                g = torch.Generator(device=dev).manual_seed(1234)
                tensors = {n: torch.empty(s, dtype=torch.bfloat16, device=dev).normal_(generator=g)
                           for n, s in bvg.model_spec(args.layers)}
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            ntensors = len(tensors)
            expected = bvg.checksums(bvg.vllm_layout(tensors))
        sync.connect()
        tl = Timeline()
        instrument(engine, handle, sync.client, tl)
        probes = Probes(engine)
        handle.call("bench_stalls", timeout=args.timeout_s)  # the engine's process watched
        handle.call("bench_steps", timeout=args.timeout_s)  # and its model runner's steps timed
        stream = Stream(engine, loop, args, bvg.DIMS["vocab"])
        stream.wait_tokens(2, args.timeout_s, "every client streaming")
        updates, version, windows = [], 0, []
        for mode in args.pause_modes:
            pause_mode = mode.removeprefix("beside:")
            for _ in range(args.updates):
                handle.call("bench_zero", timeout=args.timeout_s)  # each update rewrites all
                stream.wait_tokens(args.settle_tokens, args.timeout_s, "generation before update")
                b0 = time.perf_counter()  # undisturbed decoding just before, for the rate during
                time.sleep(args.baseline_s)  # the receive (same clients, same request mix), and
                stream.wait_tokens(2, args.timeout_s, "undisturbed decoding")  # a gap of each
                baseline = (b0, time.perf_counter())
                version += 1
                u0 = time.perf_counter()
                sync.update(tensors, version, pause_mode=pause_mode,
                            beside=mode.startswith("beside:"), shadow=args.shadow)
                u1 = time.perf_counter()
                windows.append((u0, u1))
                stream.wait_tokens(args.settle_tokens, args.timeout_s,
                                   f"generation after update {version}")
                # after the first tokens past the update: this RPC holds the engine's loop
                [got] = handle.call("bench_checksums", timeout=args.timeout_s)
                seen = probes.view()
                seen["stalls"] = handle.call("bench_stalls", timeout=args.timeout_s)[0]
                seen["firsts"] = list(stream.firsts)
                u = analyse({"mode": mode, "version": version, "update_s": u1 - u0,
                             "exact": got == expected},
                            tl.between(u0, u1), stream.tokens, args.clients,
                            stream.requests, baseline, seen)
                if windows_ := u.pop("gap_windows", None):  # where the engine's thread was
                    u["main_thread_in_gap"], u["main_thread_in_baseline_gap"] = handle.call(
                        "bench_where", windows_, timeout=args.timeout_s)[0]
                    u["steps_in_gap"], u["steps_in_baseline_gap"] = handle.call(
                        "bench_steps", windows_, timeout=args.timeout_s)[0]
                updates.append(u)
                print(f"{mode} v{version}: stall {u.get('stall_s', float('nan')) * 1e3:.1f} ms, "
                      f"longest gap {u.get('max_gap_s', float('nan')) * 1e3:.1f} ms, "
                      f"push {u['push_s'] * 1e3:.1f} ms, update {u['update_s'] * 1e3:.1f} ms, "
                      f"rate during receive {u.get('receive_rate_ratio')}, exact {u['exact']}; "
                      f"gap source: core steps in it {u.get('core_steps_in_gap')}, core interval "
                      f"{_ms(u.get('core_max_interval_near_gap_s'))}, front-end lag "
                      f"{_ms(u.get('frontend_lag_in_gap_s'))}, front-end GCs "
                      f"{u.get('frontend_gcs_in_gap')}, undisturbed max gap "
                      f"{_ms(u.get('baseline_max_gap_s'))}, front-end stalls "
                      f"{u.get('frontend_stalls_in_gap')}, engine process stalls "
                      f"{u.get('engine_stalls_in_gap')}, requests begun at its end "
                      f"{u.get('requests_begun_at_gap_end')} (undisturbed: "
                      f"{u.get('requests_begun_at_baseline_gap_end')}); engine thread in it "
                      f"{u.get('main_thread_in_gap')}; in the undisturbed one "
                      f"{u.get('main_thread_in_baseline_gap')}; model runner calls in it [name, "
                      f"from its start s, wall ms, CPU ms, device ms] {u.get('steps_in_gap')}; "
                      f"in the undisturbed one {u.get('steps_in_baseline_gap')}", flush=True)
        handle.call("bench_zero", timeout=args.timeout_s)  # then one more update must fill all
        last = args.pause_modes[0]
        sync.update(tensors, version + 1, pause_mode=last.removeprefix("beside:"),
                    beside=last.startswith("beside:"), shadow=args.shadow)
        [got] = handle.call("bench_checksums", timeout=args.timeout_s)
        bad = sorted(n for n in expected if got.get(n) != expected[n])
        stream.wait_tokens(1, args.timeout_s, "generation after the check")
        stream.check()
        for u in updates:  # the requests in flight at a swap have ended by now
            if "swap_window" in u:
                spanned(u, stream.requests)
        rep = {
            "command": " ".join(["python3", "benchmarks/bench_pause.py"] + [  # no directories
                os.path.basename(a) if os.path.isabs(a) else a for a in sys.argv[1:]]),
            "env": bvg.env_info(), "engine_startup_s": startup, "data_plane": sync.cfg.backend,
            "receive_process": sync.cfg.receive_process,
            "model": {"bytes": nbytes, "tensors": ntensors, "layers": args.layers},
            "trainer": "own process" if remote else "this process (the engine's front end)",
            "trainer_threads": args.trainer_threads or torch.get_num_threads(),
            "clients": args.clients, "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "stagger": args.stagger, "bucket_bytes": sync.cfg.bucket_bytes,
            "compiled": not (args.eager or args.cpu_smoke), "updates_per_mode": args.updates,
            "step_interval_s": step_interval(stream.tokens, windows), "updates": updates,
            "summary": summarise(updates),
            "requests": {"finished": dict(stream.finished), "short": stream.short[:20],
                         "tokens": len(stream.times)},
            "exact": not bad and set(got) == set(expected) and all(u["exact"] for u in updates),
            "mismatched": bad[:10], "shadow": args.shadow,
        }
        rep["table"] = table(rep)
        return rep
    finally:
        if stream is not None:
            stream.close()
        if probes is not None:
            probes.close()
        if sync is not None:
            sync.close()
        stop_async_llm(engine, loop, args.timeout_s)  # its output handler first: no traceback
        loop.call_soon_threadsafe(loop.stop)
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, help="Qwen2-7B layers (default 14: 8.7 GB)")
    ap.add_argument("--updates", type=int, default=5, help="timed updates per pause mode")
    ap.add_argument("--pause-modes", default="keep",
                    help="comma list of keep, wait, abort; beside:<mode> receives beside serving "
                         "and pauses per <mode> only for the swap (beside:carry: never pauses)")
    ap.add_argument("--shadow", default="device", help="beside: the shadow's place (device, host)")
    ap.add_argument("--trainer-process", action="store_true",
                    help="host trainer: push from a process of its own (trainer_proc.py), not "
                         "from this one, which is the engine's front end")
    ap.add_argument("--baseline-s", type=float, default=0.0,
                    help="undisturbed decoding measured at least this long before each update, "
                         "and until every client streamed two more tokens (beside: the decode "
                         "rate during the receive is compared with it; default 4, smoke 0.5)")
    ap.add_argument("--trainer-threads", type=int, default=0,
                    help="torch threads of the trainer (0: torch's default)")
    ap.add_argument("--clients", type=int, help="streaming requests kept in flight (16)")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens (128)")
    ap.add_argument("--max-tokens", type=int, help="tokens per request (256)")
    ap.add_argument("--stagger", action="store_true",
                    help="client c's first request is (c+1)/clients of --max-tokens long: requests "
                         "end one at a time, as in steady serving, not all together")
    ap.add_argument("--settle-tokens", type=int,
                    help="tokens every client streams before and after each update (8)")
    ap.add_argument("--bucket-mib", type=float, help="bucket size (default: the library's)")
    ap.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs")
    ap.add_argument("--receive-process", action="store_true",
                    help="gloo (--trainer-gpu cpu): the engine's worker receives in a process of "
                         "its own (SyncConfig.receive_process)")
    ap.add_argument("--gpu-mem", type=float, default=0.35, help="vLLM gpu_memory_utilization")
    ap.add_argument("--engine-gpu", default="1")
    ap.add_argument("--trainer-gpu", default="0",
                    help="the trainer's GPU (NCCL), or 'cpu': tensors on the host, over gloo")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="bound on every wait")
    ap.add_argument("--start-s", type=float, default=600.0, help="bound on the engine's start")
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="script check on a CPU vLLM: tiny dims, gloo, few short requests")
    args = ap.parse_args()
    if not args.baseline_s:
        args.baseline_s = 0.5 if args.cpu_smoke else 4.0
    for k, v in (SMOKE_ARGS if args.cpu_smoke else GPU_ARGS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.pause_modes = [m for m in args.pause_modes.split(",") if m]
    if not args.pause_modes or set(args.pause_modes) - {
            "keep", "wait", "abort", "beside:keep", "beside:wait", "beside:abort", "beside:carry"}:
        ap.error("--pause-modes takes keep, wait, abort, beside:keep, beside:wait, beside:abort, "
                 "beside:carry")
    if args.cpu_smoke:
        for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                     "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}.items():
            os.environ.setdefault(k, v)
    elif args.trainer_gpu == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = args.engine_gpu
    else:
        if args.engine_gpu == args.trainer_gpu:
            ap.error("the engine and the trainer need GPUs of their own")
        # The engine core (a child process) uses the first visible GPU, the trainer cuda:1.
        os.environ["CUDA_VISIBLE_DEVICES"] = f"{args.engine_gpu},{args.trainer_gpu}"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])
    try:
        rep = run(args)
    except BaseException:  # noqa: BLE001 - report, then leave without vLLM/NCCL teardown hooks
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    print(rep["table"], flush=True)
    for path, text in ((args.json, json.dumps(rep, indent=1)), (args.md, rep["table"] + "\n")):
        if path:
            with open(path, "w") as f:
                f.write(text)
    aborting = any(m.endswith("abort") for m in args.pause_modes)
    lost = [s for s in rep["requests"]["short"]  # only `abort` may cut a request short
            if s[0] != "abort" or not aborting]

    failed = [u for u in rep["updates"] if "error" in u or u.get("promise_broken")]
    if not rep["exact"]:
        print(f"not bit-exact: {rep['mismatched']}", flush=True)
    if lost or failed:
        print(f"FAILED: requests cut short {lost[:5]}, updates {failed[:2]}", flush=True)
    sys.stdout.flush()
    os._exit(0 if rep["exact"] and not lost and not failed else 1)  # skip vLLM/NCCL atexit hooks


if __name__ == "__main__":
    main()
