"""Colocated weight updates, side by side: the trainer and the vLLM engine share one GPU.

    python benchmarks/bench_colocated.py --layers 14 --bucket-mib 1024 --reps 7 --json out.json
    python benchmarks/bench_colocated.py --cpu-smoke --layers 2 --bucket-mib 0.0625 --reps 2

The engine is a vLLM `LLM` in this process, built as `bench_vllm_gpu.py` builds it (in-process
engine core, `load_format="dummy"`, a Qwen2-7B-shaped bf16 model with `--layers` layers, untied
embeddings; 14 layers = 171 tensors, 8.71 GB), here with torch.compile + CUDA graphs, this
project's worker extension and vLLM's weight-transfer backend `ipc`. The trainer is a separate
process holding random bf16 weights under the HF names. Both see only GPU `--gpu`
(`CUDA_VISIBLE_DEVICES`). The trainer allocates its weights and the floor's buffers before the
engine starts, so that vLLM's memory profiling sees a steady neighbour. Methods, in one run:

  floor               in the trainer, one device-to-device copy of a contiguous buffer of the
                      model's bytes into another (timed there, `torch.cuda.synchronize`)
  floor_per_tensor    the same, one copy per tensor: with floor, the copy floor
  ours                `PushClient(backend="ipc")` -> `Ext.nccl_sync_receive` (checksums on, in
                      place), joined once; the state dict's tensors are read where they lie in
                      the trainer's memory (each storage mapped once), gathered into buckets
  ours_packed         the same plane pushing a stream of the tensors: every byte packed into
                      the trainer's two buckets, which the engine mapped once
  vllm_ipc            vLLM's `ipc` backend, one CUDA IPC handle per tensor
  vllm_ipc_packed_2g  the same, packed through its reusable IPC buffer of 2 GiB
  vllm_ipc_packed_1g  the same with its default buffer (1 GiB): once, last (see below)

vLLM's trainer side: on 0.26 `IPCWeightTransferEngine.trainer_send_weights` (a callable send
mode) between `start_weight_update` and `finish_weight_update`; on 0.32
`IPCTrainerWeightTransferEngine.trainer_init` + `send_weights`. Its engine calls reach the `LLM`
over the bench's control socket (`bench_vllm_gpu.RemoteClient`), the IPC handles pickled as
vLLM's HTTP client sends them (`ipc_handles_pickled`, read with
`VLLM_ALLOW_INSECURE_SERIALIZATION=1`).

`--cpu-smoke` runs the script on vLLM's CPU build (tiny dims, trainer on the host): floor and
floor_per_tensor (host copies), raw_gloo (one gloo broadcast of a contiguous buffer of the
model's size into a preallocated engine buffer), ours_gloo (`PushClient(backend="gloo")`) and
ours_shm (`backend="shm"`, POSIX shared memory); the engine keeps one session per plane, each
joined once.

As in `bench_vllm_gpu.py`: an update is timed from telling the trainer to send until the
engine-side calls returned and the engine's GPU work is done (the floor on the trainer's own
clock); methods interleaved in rotating order, median of `--reps` after one warm-up; engine extra
GPU memory = what a method keeps allocated + its peak during an update (torch's allocator, this
process), the trainer's likewise in its process; afterwards every method updates once more into
zeroed engine weights and every engine parameter is checked bit for bit against the trainer's
tensors stacked the way vLLM stores them. Ratios: a method's time / the floor's; ours against the
best vLLM ipc mode (its time / ours).

A method that raises is recorded with its error and not run again. After a failed vLLM update the
engine's state is recorded: parameters left on the meta device and whether it generates, then
the same after `finish_weight_update` (which vLLM's trainer side does not send when it fails).
vLLM's default 1 GiB buffer cannot hold the 1.09 GB embedding, and the refusal comes after
`start_weight_update` put the layers on the meta device: that mode runs last, after every check.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from types import ModuleType
from typing import Any

import bench_vllm_gpu as bvg

GPU_METHODS = ("floor", "floor_per_tensor", "ours", "ours_packed", "vllm_ipc", "vllm_ipc_packed_2g",
               "vllm_ipc_packed_1g")
CPU_METHODS = ("floor", "floor_per_tensor", "raw_gloo", "ours_gloo", "ours_shm")
FLOORS = ("floor", "floor_per_tensor")
"""Timed in the trainer alone."""
REFERENCES = (*FLOORS, "raw_gloo")
"""Methods that move bytes without updating the engine: timed, not checked."""
PLANE = {"ours": "ipc", "ours_packed": "ipc", "raw_gloo": "gloo", "ours_gloo": "gloo", "ours_shm": "shm"}
"""This project's data plane (and engine session) of each method that uses one."""
VLLM_BUFFER = {"vllm_ipc": 0, "vllm_ipc_packed_2g": 2 << 30, "vllm_ipc_packed_1g": 1 << 30}
"""vLLM ipc modes: 0 one handle per tensor, else packed through a buffer of this size."""
LAST = "vllm_ipc_packed_1g"
"""Sent without a buffer size: vLLM's default (`DEFAULT_PACKED_BUFFER_SIZE_BYTES`, 1 GiB)."""
COMPARE = {"gpu": ("ours", ("vllm_ipc", "vllm_ipc_packed_2g")), "cpu": ("ours_shm", ("ours_gloo",))}
"""Per mode: this project's method and the timed alternatives it is compared with."""
IDLE_S = 900.0
"""The trainer's bound on any wait for the driver (engine start-up with compile and graphs)."""


def text(e: BaseException) -> str:
    """An exception as one clipped line: its type and message."""
    from vllm_nccl_sync.outcomes import clip

    return clip(f"{type(e).__name__}: {e}")


def vllm_ipc() -> ModuleType:
    """vLLM's `ipc_engine` module. vLLM 0.26 imports `ray` and `requests` at its top, for send
    modes this bench does not use; one that is not installed is an empty module in
    `sys.modules` during that import only (its dependencies are imported before)."""
    import importlib
    import importlib.util

    import vllm.distributed.weight_transfer.base  # its dependencies, without stand-ins
    import vllm.distributed.weight_transfer.packed_tensor
    import vllm.envs  # noqa: F401

    absent = [m for m in ("ray", "requests") if importlib.util.find_spec(m) is None]
    for m in absent:
        sys.modules[m] = ModuleType(m)
    try:
        return importlib.import_module("vllm.distributed.weight_transfer.ipc_engine")
    finally:
        for m in absent:
            sys.modules.pop(m, None)


def generate(llm: Any) -> dict:
    """Whether the engine generates: four greedy tokens from a fixed prompt, or the error. At
    most 32 engine steps; the request is aborted after, so a failed step leaves nothing behind
    (`LLM.generate` would leave it scheduled, and the next call would wait on it forever)."""
    from vllm import SamplingParams

    engine, rid = llm.llm_engine, f"bench-generate-{time.monotonic_ns()}"
    try:
        engine.add_request(rid, {"prompt_token_ids": [1, 2, 3, 4]},
                           SamplingParams(max_tokens=4, temperature=0.0, detokenize=False))
        for _ in range(32):
            for out in engine.step():
                if out.finished:
                    return {"ok": True, "tokens": list(out.outputs[0].token_ids)}
        return {"ok": False, "error": "not finished after 32 engine steps"}
    except Exception as e:  # noqa: BLE001 - reported
        return {"ok": False, "error": text(e)}
    finally:
        engine.abort_request([rid])


class ColocatedExt(bvg.BenchExt):
    """`BenchExt` with one `nccl_sync` session per data plane (so that the CPU smoke keeps gloo
    and shm joined at once) and a probe for parameters left on the meta device."""

    _bench_sessions: dict | None = None
    _bench_plane = ""

    def bench_session(self, plane: str) -> None:
        """Make `plane`'s session the one `nccl_sync_*` calls use (a new one on first use)."""
        if self._bench_sessions is None:
            self._bench_sessions = {}
        if self._bench_plane:
            self._bench_sessions[self._bench_plane] = self._nccl_sync
        self._nccl_sync = self._bench_sessions.get(plane)
        self._bench_plane = plane

    def bench_close(self) -> None:
        """Leave every plane's group."""
        self.bench_session("")
        for session in self._bench_sessions.values():
            if session is not None:
                session.close()

    def bench_meta(self) -> list[str]:
        """The model's parameters on the meta device (a layerwise reload left open)."""
        return [n for n, p in self.model_runner.model.named_parameters() if p.is_meta]


# --------------------------------------------------------------------------- trainer process


class HandlesClient(bvg.RemoteClient):
    """`RemoteClient` for vLLM's ipc backend: the CUDA IPC handles travel pickled and base64
    encoded (`ipc_handles_pickled`), as vLLM's HTTP client sends them."""

    def update_weights(self, update_info: dict) -> None:
        import base64
        import pickle

        info = {k: v for k, v in update_info.items()
                if k not in ("ipc_handles", "ipc_handles_pickled")}
        info["ipc_handles_pickled"] = base64.b64encode(
            pickle.dumps(update_info["ipc_handles"])).decode()
        super().update_weights(info)


def vllm_send(client: HandlesClient, tensors: dict, method: str) -> None:
    """One update by vLLM's ipc backend, trainer side, its engine calls made through `client`."""
    ipc = vllm_ipc()
    wire: dict[str, Any] = {"packed": VLLM_BUFFER[method] > 0}
    if wire["packed"] and method != LAST:
        wire["packed_buffer_size_bytes"] = VLLM_BUFFER[method]
    if hasattr(ipc, "IPCTrainerWeightTransferEngine"):  # 0.32: init (packed), start, ..., finish
        engine = ipc.IPCTrainerWeightTransferEngine.trainer_init(
            ipc.IPCTrainerInitInfo(rank=0, **wire), client=client,
            source=bvg.dict_source(tensors))
        engine.send_weights()
        return
    client.start_weight_update()  # 0.26: the caller brackets the send
    ipc.IPCWeightTransferEngine.trainer_send_weights(
        iter(tensors.items()),
        {"send_mode": lambda info: client.update_weights(asdict(info)), **wire})
    client.finish_weight_update()


def trainer(args: argparse.Namespace) -> None:
    """Holds the weights and the floor's buffers (allocated before it reports to the driver);
    sends them by whichever method the driver asks for."""
    import traceback

    import torch
    import zmq

    from vllm_nccl_sync import PushClient, SyncConfig

    gpu = not args.cpu_smoke
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(dev)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    def allocated() -> int:
        sync()
        return torch.cuda.memory_allocated() if gpu else 0

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    for opt in (zmq.RCVTIMEO, zmq.SNDTIMEO):  # every wait for the driver is bounded
        sock.setsockopt(opt, int(IDLE_S * 1000))
    sock.connect(f"tcp://127.0.0.1:{args.ctl_port}")
    tensors, info = bvg.trainer_weights(args.layers, dev)
    src = torch.empty(info["nbytes"], dtype=torch.uint8, device=dev)  # floor; raw_gloo sends it
    dst = torch.empty_like(src)
    views, off = [], 0
    for t in tensors.values():
        n = t.numel() * t.element_size()
        views.append(dst[off : off + n].view(t.dtype).view(t.shape))
        off += n
    sync()
    sock.send_json(info)
    client = HandlesClient(sock)
    clients: dict[str, PushClient] = {}
    phases: dict[str, float] = {}  # this update's push, by phase (`timing`)
    profiler = cProfile.Profile() if args.profile else None  # this side of `ours`' pushes
    kept: dict[str, int] = {}
    peak: dict[str, int] = {}
    while True:
        try:
            msg = sock.recv_json()
        except zmq.Again:
            print(f"no word from the driver for {IDLE_S:.0f} s: exiting", flush=True)
            break
        cmd = msg["cmd"]
        if cmd == "quit":
            sock.send_json({"ok": True, "s": 0.0})
            break
        if cmd == "memory":
            sock.send_json({"ok": True, "s": 0.0, "kept": kept, "peak": peak})
            continue
        base = allocated()
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            if cmd == "join":
                cfg = SyncConfig(**msg["cfg"])
                clients[cfg.backend] = PushClient(cfg, dev if gpu else None)
                clients[cfg.backend].connect()
                timing(clients[cfg.backend], phases)
                kept[cfg.backend] = allocated() - base
                s = time.perf_counter() - t0
            else:
                method = msg["method"]
                phases.clear()
                sync()
                t0 = time.perf_counter()
                if method == "floor":
                    dst.copy_(src)
                elif method == "floor_per_tensor":
                    for v, t in zip(views, tensors.values(), strict=True):
                        v.copy_(t)
                elif method == "raw_gloo":
                    clients["gloo"].transport.broadcast(src).wait()
                elif method in PLANE:
                    sent = tensors.items() if method == "ours_packed" else tensors  # a stream packs
                    push = clients[PLANE[method]].push
                    if profiler is not None and method == COMPARE["gpu" if gpu else "cpu"][0]:
                        with profiler:
                            push(sent, version=msg["version"])
                    else:
                        push(sent, version=msg["version"])
                else:
                    vllm_send(client, tensors, method)
                sync()
                s = time.perf_counter() - t0
                if gpu:
                    peak[method] = max(peak.get(method, 0),
                                       torch.cuda.max_memory_allocated() - base)
        except Exception as e:  # noqa: BLE001 - reported to the driver
            traceback.print_exc()
            sock.send_json({"ok": False, "error": text(e), "s": time.perf_counter() - t0})
            continue
        sock.send_json({"ok": True, "s": s, "phases": dict(phases)})
    for c in clients.values():
        c.close()
    if profiler is not None:
        profiler.dump_stats(args.profile + ".trainer")
    sock.close(linger=5000)  # the last reply goes out before the process ends
    ctx.term()


def timing(client: Any, into: dict[str, float]) -> None:
    """Add the time `client.push` spends in each of its phases to `into` (the bench's own
    instrument): planning, the wait for the device before the plan, plan to every Ready (and,
    read in place, the checksums queued meanwhile), posting, the drain, Seal to Commit."""
    for owner, names in ((client.lane, ("layout", "at", "settle", "post", "drain")),
                         (client.rounds, ("open", "commit"))):
        for name in names:
            real = getattr(owner, name)

            def timed(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return _real(*a, **k)
                finally:
                    into[_name] = into.get(_name, 0.0) + time.perf_counter() - t

            setattr(owner, name, timed)


# --------------------------------------------------------------------------- driver + engine


class Colocated(bvg.Driver):
    """`bench_vllm_gpu.Driver` for these methods: each plane in its engine session, the floor on
    the trainer's clock, a failing method recorded (with the engine's state after it)."""

    def __init__(self, args: argparse.Namespace, sock: Any) -> None:
        super().__init__(args, None, sock, {})
        self.plane = ""
        self.errors: dict[str, str] = {}
        self.after: dict[str, dict] = {}
        self.failed = ""  # an engine-side failure of the update in flight
        self.profiler = cProfile.Profile() if args.profile else None
        self.profiled = COMPARE["cpu" if args.cpu_smoke else "gpu"][0]

    def use(self, plane: str) -> None:
        """Make `plane`'s engine session the current one."""
        if plane != self.plane:
            self.llm.collective_rpc("bench_session", args=(plane,))
            self.plane = plane

    def join(self, plane: str, bucket: int) -> None:
        """This project's sender and the engine's `plane` session join over `plane`; a failure
        is recorded for every method on it."""
        from vllm_nccl_sync.trainer.sync import free_port

        self.use(plane)
        cfg = {"backend": plane, "control_port": free_port(), "group_port": free_port(),
               "world_size": 2, "bucket_bytes": bucket, "timeout_s": 120.0}
        before = self.allocated()
        self.sock.send_json({"cmd": "join", "cfg": cfg})
        error = ""
        try:
            self.llm.collective_rpc("nccl_sync_join", args=(cfg, 1))
        except Exception as e:  # noqa: BLE001 - recorded; the trainer's reply still comes
            error = text(e)
        reply = self.wait()
        error = error or ("" if reply["ok"] else f"trainer: {reply['error']}")
        if error:
            for m, p in PLANE.items():
                if p == plane:
                    self.errors[m] = f"join {plane}: {error}"
            return
        self.persistent[plane] = self.allocated() - before

    def engine_side(self, method: str, bucket: int) -> dict:
        if method in FLOORS:
            return {}
        if method in VLLM_BUFFER:  # the trainer makes vLLM's calls; they are made here
            self.serve("finish_weight_update")
            return {}
        try:
            if self.profiler is not None and method == self.profiled:
                with self.profiler:
                    return super().engine_side("ours", bucket)
            return super().engine_side("raw" if method == "raw_gloo" else "ours", bucket)
        except Exception as e:  # noqa: BLE001 - the trainer's reply is still to come: `run`
            self.failed = text(e)
            return {}

    def run(self, method: str, bucket: int) -> dict:
        """`Driver.run`; a failure (recorded) and a method that failed before give `s` NaN."""
        if method in self.errors:
            return {"s": math.nan}
        if method in PLANE:
            self.use(PLANE[method])
        self.failed = ""
        try:
            r = super().run(method, bucket)
        except TimeoutError:  # the trainer is gone or stuck: nothing more can be measured
            raise
        except Exception as e:  # noqa: BLE001 - recorded
            self.fail(method, self.failed or text(e))
            return {"s": math.nan}
        if self.failed:
            self.fail(method, self.failed)
            return {"s": math.nan}
        if method in FLOORS:
            r["s"] = r["trainer_s"]
        return r

    def fail(self, method: str, error: str) -> None:
        """Record `method`'s failure (and, for vLLM's, the engine's state after it)."""
        print(f"{method} failed: {error}", flush=True)
        self.errors[method] = error
        if method in VLLM_BUFFER:
            self.after[method] = self.aftermath()

    def meta(self) -> dict:
        """How many engine parameters are on the meta device (the first few named)."""
        try:
            [names] = self.llm.collective_rpc("bench_meta")
        except Exception as e:  # noqa: BLE001 - reported
            return {"error": text(e)}
        return {"count": len(names), "first": names[:5]}

    def aftermath(self) -> dict:
        """The engine after a failed vLLM update as it was left, then after
        `finish_weight_update`: parameters on the meta device, whether it generates."""
        out = {"meta_params": self.meta(), "generate": generate(self.llm)}
        try:
            self.llm.finish_weight_update()
            out["finish_weight_update"] = "ok"
        except Exception as e:  # noqa: BLE001 - reported
            out["finish_weight_update"] = text(e)
        out["meta_params_after_finish"] = self.meta()
        out["generate_after_finish"] = generate(self.llm)
        print(f"the engine after it: {after_text(out)}", flush=True)
        return out


def rows_of(drv: Colocated, methods: list[tuple[str, int]], runs: dict, checks: dict,
            memory: dict) -> list[dict]:
    """One result row per method: timings, memory, check, error, ratio to the floor."""
    rows = []
    for m in methods:
        name, bucket = m
        plane = PLANE.get(name, "") if name.startswith("ours") else ""
        row: dict[str, Any] = {
            "method": name, "bucket": bucket, "kept_bytes": drv.persistent.get(plane, 0),
            "trainer_kept_bytes": memory.get("kept", {}).get(plane, 0),
            "trainer_peak_bytes": memory.get("peak", {}).get(name, 0)}
        done = [r for r in runs.get(m, []) if not math.isnan(r["s"])]
        if done:
            row.update(bvg.stats(done))
        if m in checks:
            row.update(exact=checks[m]["exact"], check=checks[m])
        if name in drv.errors:
            row["error"] = drv.errors[name]
        if name in drv.after:
            row["after_failure"] = drv.after[name]
        rows.append(row)
    floor = next((r.get("median_s") for r in rows if r["method"] == "floor"), None)
    for r in rows:
        r["ratio_to_floor"] = r["median_s"] / floor if floor and "median_s" in r else None
    return rows


def summary(rows: list[dict], mode: str) -> str:
    """This project's method against the floor and its best timed alternative."""
    by = {r["method"]: r for r in rows if "median_s" in r}
    ours, others = COMPARE[mode]
    if ours not in by or "floor" not in by:
        return f"{ours}: no timing"
    line = f"{ours}: {by[ours]['ratio_to_floor']:.2f}x the floor's time"
    alive = [by[m] for m in others if m in by]
    if alive:
        best = min(alive, key=lambda r: r["median_s"])
        speedup = best["median_s"] / by[ours]["median_s"]
        line += (f"; {best['method']} (best of {', '.join(others)}): "
                 f"{best['ratio_to_floor']:.2f}x; {ours} is {speedup:.2f}x as fast as it")
    line += "."
    phases = by[ours].get("trainer_phases_s_median")
    if phases:  # where the trainer's push spent its time, and the receiver's part of it
        rx = by[ours].get("rx_s_median")
        line += (" Its push, median ms by phase: "
                 + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items())
                 + (f"; the receiver, Ready to Commit: {rx * 1e3:.1f}" if rx else ""))
        if rx_phases := by[ours].get("rx_phases_s_median"):
            line += (" (from its plan, ms spent reaching each step: "
                     + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rx_phases.items()) + ")")
        if (graphs := by[ours].get("graph_launches")) is not None:
            line += f"; batches launched as CUDA graphs, per push: {graphs}"
        if (loader := by[ours].get("through_loader")) is not None:
            line += f"; tensors through vLLM's loader (not replayed), per push: {loader}"
        line += "."
    return line


def after_text(a: dict) -> str:
    """The engine's state after a failed update, in one line."""
    def meta(m: dict) -> str:
        return m.get("error") or f"{m['count']} parameters on the meta device"

    def gen(g: dict) -> str:
        return "generates" if g["ok"] else f"does not generate ({g['error'][:160]})"

    return (f"{meta(a['meta_params'])}, {gen(a['generate'])}; finish_weight_update: "
            f"{a['finish_weight_update'][:160]}; then {meta(a['meta_params_after_finish'])}, "
            f"{gen(a['generate_after_finish'])}")


def table(rep: dict) -> str:
    gpu = rep["mode"] == "gpu"
    gb = rep["model"]["bytes"] / 1e9
    where = "one GPU" if gpu else "the host (vLLM CPU)"
    lines = [(f"Model: {gb:.3g} GB bf16, {rep['model']['tensors']} tensors (Qwen2-7B dims, "
              f"{rep['model']['layers']} layers, untied); trainer and engine on {where}."), "",
             ("| method | bucket | ms (median) | min-max ms | GB/s | x floor "
              "| engine extra GPU mem (kept + peak) | trainer extra GPU mem (kept + peak) "
              "| bit-exact |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def mem(kept: int, peak: int) -> str:
        return f"{(kept + peak) / 2**30:.2f} GiB ({kept / 2**30:.2f} + {peak / 2**30:.2f})"

    for r in rep["rows"]:
        bucket = bvg.size_text(r["bucket"]) if r["bucket"] else "-"
        exact = {True: "yes", False: "NO", None: "-"}[r.get("exact")]
        if "median_s" not in r:
            lines.append(f"| {r['method']} | {bucket} | failed | - | - | - | - | - | {exact} |")
            continue
        ref = r["method"] in REFERENCES
        lines.append(
            f"| {r['method']} | {bucket} | {r['median_s'] * 1e3:.1f} "
            f"| {r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f} | {gb / r['median_s']:.3g} "
            f"| {r['ratio_to_floor']:.2f} "
            f"| {mem(r['kept_bytes'], r['peak_extra_bytes']) if gpu and not ref else '-'} "
            f"| {mem(r['trainer_kept_bytes'], r['trainer_peak_bytes']) if gpu else '-'} "
            f"| {exact} |")
    lines += ["", summary(rep["rows"], rep["mode"])]
    if rep.get("generate_before_last"):
        g = rep["generate_before_last"]
        lines.append(f"- before {LAST} the engine "
                     f"{'generates' if g['ok'] else 'does not generate: ' + g['error']}")
    for r in rep["rows"]:
        if "error" in r:
            lines.append(f"- {r['method']} failed: {r['error']}")
        if "after_failure" in r:
            lines.append(f"  the engine after it: {after_text(r['after_failure'])}")
    return "\n".join(lines)


def driver(args: argparse.Namespace) -> dict:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(args.gpu)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    vllm_methods = [m for m in args.methods if m in VLLM_BUFFER]
    if vllm_methods:  # HandlesClient's pickled IPC handles (the trainer is this bench's own)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import torch
    import zmq

    gpu = not args.cpu_smoke
    sock = zmq.Context().socket(zmq.PAIR)
    sock.setsockopt(zmq.SNDTIMEO, 60_000)  # a send to a trainer that is gone fails (receives poll)
    ctl_port = sock.bind_to_random_port("tcp://127.0.0.1")
    if args.json:  # the trainer's output goes to a file: beside the results, else a temp one
        log = os.path.splitext(args.json)[0] + ".trainer.log"
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    else:
        fd, log = tempfile.mkstemp(prefix="bench-colocated-trainer-", suffix=".log")
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "trainer", "--ctl-port",
           str(ctl_port), "--layers", str(args.layers)]
    cmd += ["--cpu-smoke"] if args.cpu_smoke else []
    cmd += ["--profile", args.profile] if args.profile else []
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([bvg.ROOT, os.environ.get("PYTHONPATH", "")]))
    with os.fdopen(fd, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    print(f"trainer log: {log}", flush=True)
    path = tempfile.mkdtemp(prefix="bench-colocated-")
    drv = Colocated(args, sock)
    done = False
    try:
        bvg.save_config(path, args.layers)
        drv.info = drv.wait(600)  # the trainer holds all it keeps before the engine profiles
        backend, api = None, None
        if vllm_methods:
            try:
                ipc = vllm_ipc()
                backend = "ipc"
                api = ("IPCTrainerWeightTransferEngine.trainer_init + send_weights"
                       if hasattr(ipc, "IPCTrainerWeightTransferEngine")
                       else "IPCWeightTransferEngine.trainer_send_weights")
            except Exception as e:  # noqa: BLE001 - the engine runs without it
                for m in vllm_methods:
                    drv.errors[m] = f"vLLM's ipc backend: {text(e)}"
        t0 = time.perf_counter()
        drv.llm = bvg.start_engine(args, path, backend, ext="bench_colocated.ColocatedExt")
        startup = time.perf_counter() - t0
        if backend:  # once, as vLLM's API asks (0.32's trainer side sends its own too)
            try:
                drv.llm.init_weight_transfer_engine({"init_info": {}})
            except Exception as e:  # noqa: BLE001 - recorded
                for m in vllm_methods:
                    drv.errors[m] = f"init_weight_transfer_engine: {text(e)}"
        bucket = int(args.bucket_mib * bvg.MiB)
        for plane in dict.fromkeys(PLANE[m] for m in args.methods if m in PLANE):
            drv.join(plane, bucket)
        methods = [(m, VLLM_BUFFER.get(m, bucket if m in PLANE else 0)) for m in args.methods]
        main = [m for m in methods if m[0] != LAST]
        runs = bvg.timed(drv, main, args.reps)
        if drv.profiler is not None:
            drv.profiler.dump_stats(args.profile)
            drv.profiler = None  # the checks below are not profiled
        drv.llm.collective_rpc("bench_free_raw")
        if gpu:
            torch.cuda.empty_cache()
        checks = {m: drv.verify(*m) for m in main
                  if m[0] not in REFERENCES and m[0] not in drv.errors}
        before_last = None
        if (LAST, VLLM_BUFFER[LAST]) in methods and LAST not in drv.errors:
            m = (LAST, VLLM_BUFFER[LAST])
            before_last = generate(drv.llm)  # what the engine's state after it is compared with
            runs[m] = [drv.run(*m)]  # once, no warm-up; checked only if it went through
            if LAST not in drv.errors:
                checks[m] = drv.verify(*m)
        memory = drv.ask({"cmd": "memory"})
        try:
            drv.llm.collective_rpc("bench_close")
        except Exception as e:  # noqa: BLE001 - an engine a failed update broke
            print(f"closing the sessions failed: {text(e)}", flush=True)
        drv.ask({"cmd": "quit"})
        done = True
        report = {
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "env": bvg.env_info(), "mode": "gpu" if gpu else "cpu", "gpu": args.gpu,
            "engine_startup_s": startup, "wall_s": time.perf_counter() - bvg.T0,
            "model": {"bytes": drv.info["nbytes"], "tensors": len(drv.info["names"]),
                      "layers": args.layers, "dims": bvg.DIMS},
            "reps": args.reps, "methods": args.methods, "bucket": bucket, "vllm_ipc_api": api,
            "rows": rows_of(drv, methods, runs, checks, memory),
            "generate_before_last": before_last, "trainer_log": log,
        }
        report["table"] = table(report)
        return report
    finally:
        shutil.rmtree(path, ignore_errors=True)
        try:  # a trainer left mid-call by a failure is not waited for
            proc.wait(timeout=30 if done else 1)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if not done:
            print(f"the run failed; the trainer's log: {log}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", default="driver", choices=["driver", "trainer"])
    ap.add_argument("--layers", type=int, default=14, help="Qwen2-7B layers (14: 8.71 GB)")
    ap.add_argument("--bucket-mib", type=float, default=1024,
                    help="this project's bucket (fractions for --cpu-smoke)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--gpu", type=int, default=0, help="the GPU trainer and engine share")
    ap.add_argument("--gpu-mem", type=float, default=None,
                    help="vLLM gpu_memory_utilization (default 0.35; 0.15 with --cpu-smoke)")
    ap.add_argument("--ctl-port", type=int, default=0)
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="")
    ap.add_argument("--methods", default="",
                    help=f"comma list (default: all; floor always runs): GPU "
                         f"{', '.join(GPU_METHODS)}; --cpu-smoke {', '.join(CPU_METHODS)}")
    ap.add_argument("--profile", default="",
                    help="write a cProfile of the engine's side of this project's updates "
                         "(ours, or ours_shm: the receive RPCs of the timed reps, this "
                         "process) to this file, and of the trainer's pushes to FILE.trainer")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="script check on a CPU vLLM: tiny dims, floor, raw_gloo, ours_gloo, "
                         "ours_shm")
    args = ap.parse_args()
    if args.cpu_smoke:
        bvg.use_smoke_dims()
    modes = CPU_METHODS if args.cpu_smoke else GPU_METHODS
    chosen = [m for m in args.methods.split(",") if m] or list(modes)
    unknown = sorted(set(chosen) - set(modes))
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {', '.join(modes)}")
    args.methods = [m for m in modes if m == "floor" or m in chosen]
    args.compile = not args.cpu_smoke  # bench_vllm_gpu.start_engine: CUDA graphs on the GPU
    if args.gpu_mem is None:
        args.gpu_mem = 0.15 if args.cpu_smoke else 0.35
    if args.role == "trainer":
        trainer(args)
        os._exit(0)
    report = driver(args)
    bvg.write_report(report, args.json, args.md)
    bad = [r["method"] for r in report["rows"] if r.get("exact") is False]
    failed = [r["method"] for r in report["rows"] if "error" in r and r["method"] != LAST]
    if bad:
        print(f"not bit-exact: {bad}", flush=True)
    if failed:
        print(f"FAILED {failed}", flush=True)
    sys.stdout.flush()
    os._exit(1 if bad or failed else 0)  # skip interpreter teardown (vLLM atexit hooks can hang)


if __name__ == "__main__":
    main()
