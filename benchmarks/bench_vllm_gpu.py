"""Weight updates of a real vLLM engine, head to head: trainer process (GPU 0) -> engine (GPU 1).

    python benchmarks/bench_vllm_gpu.py --layers 14 --bucket-mib 1024 --reps 7 --json out.json
    python benchmarks/bench_vllm_gpu.py --cpu-smoke --layers 2 --bucket-mib 0.0625 \
        --extra-ours-mib 0.125 --reps 2   # script check on vLLM CPU: gloo, raw, ours, ours_vllm_api

The engine is a vLLM `LLM` in this process (`CUDA_VISIBLE_DEVICES=1`, in-process engine core,
`load_format="dummy"`, a Qwen2-7B-shaped bf16 model with `--layers` layers, untied embeddings;
14 layers = 171 tensors, 8.7 GB). The trainer is a separate process (`CUDA_VISIBLE_DEVICES=0`)
holding random bf16 weights under the HF names. Methods, in one run, on the same model and bucket:

  raw          one NCCL broadcast of a contiguous buffer of the model's size into a preallocated
               engine buffer: the ceiling
  ours         `PushClient.push` -> `Ext.nccl_sync_receive` (this project: headers, exact-length
               double-buffered buckets, in-place `load_weights`)
  vllm_packed  vLLM's own NCCL weight transfer, packed (`init_weight_transfer_engine`,
               `start_weight_update` / `update_weights` / `finish_weight_update`;
               trainer: `NCCLWeightTransferEngine.trainer_send_weights(packed=True)`), same bucket
  vllm_per_tensor  the same with `packed=False`: one broadcast per tensor
  ours_vllm_api  this project as vLLM's weight-transfer backend `nccl_sync`, driven only through
               vLLM's API: engine `init_weight_transfer_engine` / `start_weight_update` /
               `update_weights` / `finish_weight_update` (`LLM` methods), trainer
               `WeightTransferTrainerFactory.trainer_init(NcclSyncTrainerInitInfo(...))` +
               `send_weights`, its control calls forwarded to the engine process over the bench's
               control socket (as vLLM's HTTP/Ray clients forward them), same bucket. An engine has
               one weight-transfer backend, so this runs on a second engine
               (`weight_transfer_config={"backend": "nccl_sync"}`, otherwise the same settings),
               started after the first one is shut down: a separate block, compared with raw
               from the first engine.

`--methods` picks a subset (raw always runs: it is the ratio's reference). `--bucket-mib 512,256`
runs one block per bucket size, in that order, on the same engine: each block joins this project's
sender and receivers afresh (new groups, new buffers), interleaves raw with the methods at that
size, checks them bit for bit, and reports its ratios against its own raw (rows carry `series`).
`benchmarks/robustness.py` runs this script several times as separate invocations.

Every update is timed on this process's clock, start to finish: from telling the trainer to send
until the engine-side calls returned and the engine's GPU work is done (`torch.cuda.synchronize`).
Methods are interleaved within each repetition (rotating order); median of `--reps` after one
warm-up. "Engine extra GPU memory" = memory the method keeps allocated on the engine GPU between
updates (ours: two bucket buffers) + the peak of what it allocates during an update, both from
torch's allocator. Afterwards every method runs once more into zeroed engine weights and every
engine parameter is checked bit for bit (exact int64 checksums) against the trainer's tensors
stacked the way vLLM stores them (qkv_proj, gate_up_proj).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

T0 = time.perf_counter()  # the run's wall time counts from here (reported as `wall_s`)
MiB = 1 << 20
METHODS = ("raw", "ours", "vllm_packed", "vllm_per_tensor", "ours_vllm_api")


def size_text(nbytes: int) -> str:
    """A bucket size for the table: "1024 MiB", or "64 KiB" below a MiB (`--cpu-smoke`)."""
    return f"{nbytes // MiB} MiB" if nbytes % MiB == 0 else f"{nbytes // 1024} KiB"
DIMS = dict(hidden=3584, inter=18944, heads=28, kv_heads=4, vocab=152064)  # Qwen2-7B
SMOKE_DIMS = dict(hidden=64, inter=160, heads=4, kv_heads=2, vocab=1000)  # `--cpu-smoke` only
_CH = 1 << 24

try:  # the engine imports this module as its worker extension
    from vllm_nccl_sync.integrations.vllm.ext import Ext
except ImportError:  # pragma: no cover
    Ext = object


class Watch:
    """A thread of the engine's process that wakes every half millisecond. When it wakes late,
    the process's other threads held Python's lock (or no core was free) for that long: it keeps
    when, how long, and where `threads` (by name; "main": the process's main thread, whatever its
    name, which a process forked from another thread inherits) were just after. Every `EVERY`-th wake it also
    samples where the first of `threads` is (the last `KEEP` samples), which shows what a
    thread that holds no lock was doing: waiting for the device, or running Python."""

    PERIOD = 0.0005
    LATE = 0.008
    EVERY = 4
    KEEP = 120_000

    def __init__(self, threads: tuple[str, ...] = ("main", "nccl-sync-beside")) -> None:
        self.threads = threads
        self.stalls: list[list] = []
        self.samples: collections.deque = collections.deque(maxlen=self.KEEP)
        threading.Thread(target=self._run, daemon=True, name="bench-watch").start()

    @staticmethod
    def _stack(frame: Any) -> str:
        out = []
        while frame is not None and len(out) < 3:
            code = frame.f_code
            out.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        return " < ".join(out)

    def _run(self) -> None:
        n = 0
        while True:
            t0 = time.perf_counter()
            time.sleep(self.PERIOD)
            took = time.perf_counter() - t0
            n += 1
            late = took - self.PERIOD > self.LATE and len(self.stalls) < 2000
            if not late and (not self.threads or n % self.EVERY):
                continue
            main = threading.main_thread()  # "main": the process's first thread, by identity
            names = {t.ident: "main" if t is main else t.name for t in threading.enumerate()}
            frames = {names.get(i): f for i, f in sys._current_frames().items()}
            if late:
                self.stalls.append([t0, took, {k: self._stack(frames[k]) for k in self.threads
                                               if k in frames}])
            if self.threads and self.threads[0] in frames:
                self.samples.append((t0 + took, self._stack(frames[self.threads[0]])))

    def take(self) -> list[list]:
        out, self.stalls = self.stalls, []
        return out

    def where(self, t0: float, t1: float) -> list[list]:
        """The samples taken in [t0, t1], counted by place (most often first)."""
        got = collections.Counter(w for t, w in list(self.samples) if t0 <= t <= t1)
        return [[w, k] for w, k in got.most_common(8)]


class StepClock:
    """Times every call of the model runner's step methods (`execute_model`, `sample_tokens`):
    start, wall seconds, the calling thread's CPU seconds, and the device's span (CUDA events on
    the current stream around the call). A call whose wall time is far over its CPU time waited
    without running (for Python's lock, or a blocking wait for the device: a spinning one counts
    as CPU); a device span over the undisturbed one's means the device ran the step slower."""

    KEEP = 20_000

    def __init__(self, runner: Any) -> None:
        self.records: collections.deque = collections.deque(maxlen=self.KEEP)
        for name in ("execute_model", "sample_tokens"):
            fn = getattr(runner, name, None)
            if fn is not None:
                setattr(runner, name, self._timed(name, fn))

    def _timed(self, name: str, fn: Any) -> Any:
        import torch

        cuda = torch.cuda.is_available()

        def timed(*args: Any, **kwargs: Any) -> Any:
            e0 = e1 = None
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                if e1 is not None:
                    e1.record()
                self.records.append((name, t0, wall, cpu, e0, e1))

        return timed

    def within(self, t0: float, t1: float) -> list[list]:
        """The calls overlapping [t0, t1]: [name, start - t0, wall ms, CPU ms, device ms (None
        until both events ran)]."""
        out = []
        for name, start, wall, cpu, e0, e1 in list(self.records):
            if start < t1 and start + wall > t0:
                dev = e0.elapsed_time(e1) if e1 is not None and e1.query() else None
                out.append([name, round(start - t0, 4), round(wall * 1e3, 2), round(cpu * 1e3, 2),
                            None if dev is None else round(dev, 2)])
        return out


class BenchExt(Ext):
    """`vllm_nccl_sync.Ext` plus the benchmark's engine-side probes (prefixed `bench_`)."""

    def bench_steps(self, windows: list[list[float]] | None = None) -> list[list[list]]:
        """Per window [t0, t1]: the model runner's calls in it (`StepClock.within`); the first
        call starts timing them."""
        clock = getattr(self, "_bench_steps", None)
        if clock is None:
            self._bench_steps = StepClock(self.model_runner)
            return []
        return [clock.within(t0, t1) for t0, t1 in windows or []]

    def bench_stalls(self) -> list[list]:
        """Since the last call: when this process's threads went without Python's lock for more
        than `Watch.LATE` ([start, seconds, stacks just after]); the first call starts watching."""
        watch = getattr(self, "_bench_watch", None)
        if watch is None:
            self._bench_watch = Watch()
            return []
        return watch.take()

    def bench_where(self, windows: list[list[float]]) -> list[list[list]]:
        """Per window [t0, t1]: where the engine's main thread was sampled in it (`Watch`)."""
        return [self._bench_watch.where(t0, t1) for t0, t1 in windows]

    def bench_raw(self, nbytes: int) -> None:
        """Receive one broadcast of `nbytes` over the joined group into a preallocated buffer."""
        import torch

        buf = getattr(self, "_bench_buf", None)
        if buf is None or buf.numel() != nbytes:
            buf = self._bench_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._nccl_sync.receiver.transport.broadcast(buf).wait()
        if buf.is_cuda:
            torch.cuda.current_stream().synchronize()

    def bench_api_last(self) -> dict:
        """The `nccl_sync` backend's summary of its last update (receive seconds, buckets)."""
        last = self.weight_transfer_engine.last
        return {"rx_s": last["seconds"], "buckets": last["buckets"]}

    def bench_free_raw(self) -> None:
        self._bench_buf = None

    def bench_zero(self) -> None:
        import torch

        model = self.model_runner.model
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
            if self.device.type == "cpu":  # `--cpu-smoke`: vLLM CPU computes from packed copies
                from vllm_nccl_sync.integrations.vllm.patches import cpu_repack as cpu

                for entry in cpu.unpack_linears(model):  # weight-less linears: pack zeros
                    entry.layer.weight.zero_()
                    cpu.repack(entry)
                cpu.repack_kept(model)  # LM head / embeddings: re-pack the zeroed weight

    def bench_checksums(self) -> dict[str, list[int]]:
        model = self.model_runner.model
        tensors = dict(model.named_parameters())
        if self.device.type == "cpu":
            tensors.update(cpu_effective_weights(model))
        return checksums(tensors)


def cpu_effective_weights(model) -> dict:
    """vLLM CPU (`--cpu-smoke`): the weight each packed layer computes with, `cpu_linear(I).T`.

    At start-up vLLM's CPU backend packs every linear weight for its GEMM kernel and leaves a
    size-0 `weight` (LM head/embeddings keep theirs next to a packed copy). Multiplying the packed
    kernel by the identity gives its weight back exactly (one non-zero product per output), so the
    check sees what the engine really uses; a kept weight whose packed copy differs from it is
    reported as a mismatch (NaN, never equal to the trainer's checksum).
    """
    import torch

    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():  # (sgl-kernel path: biases upcast to fp32)
            if p.dtype == torch.float32 and p.numel():  # the bench's model is bf16 throughout
                b = p.to(torch.bfloat16)
                out[name] = b if torch.equal(b.float(), p) else torch.full_like(b, float("nan"))
        for name, m in model.named_modules():
            lin, w = getattr(m, "cpu_linear", None), getattr(m, "weight", None)
            if lin is None or not isinstance(w, torch.Tensor) or w.is_meta:
                continue
            if w.numel():
                n, k = w.shape
            else:
                n, k = sum(m.output_partition_sizes), m.input_size_per_partition
            dtype = w.dtype
            eff = lin(torch.eye(k, dtype=dtype), w, None).t().to(dtype).contiguous()
            assert eff.shape == (n, k), (name, eff.shape, (n, k))
            key = f"{name}.weight"
            if w.numel() == 0:
                out[key] = eff
            elif not torch.equal(eff, w):
                out[key] = torch.full_like(w, float("nan"))
    return out


def checksum(t, w):
    """Exact and position-sensitive: [sum x, sum x * (pos % 65521 + 1)] over int16 words, int64."""
    import torch

    x = t.detach().reshape(-1).view(torch.uint8)
    x = x.view(torch.int16) if x.numel() % 2 == 0 else x.to(torch.int16)
    acc = torch.zeros(2, dtype=torch.int64, device=t.device)
    for lo in range(0, x.numel(), _CH):
        c = x[lo : lo + _CH].to(torch.int64)
        acc[0] += c.sum()
        acc[1] += (c * ((w[: c.numel()] + lo) % 65521 + 1)).sum()
    return acc


def checksums(tensors: dict) -> dict[str, list[int]]:
    import torch

    dev = next(iter(tensors.values())).device
    w = torch.arange(_CH, device=dev, dtype=torch.int64)
    return {n: checksum(t, w).tolist() for n, t in tensors.items()}


def model_spec(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes, in checkpoint order (all bf16)."""
    h, i, v = DIMS["hidden"], DIMS["inter"], DIMS["vocab"]
    kv = h // DIMS["heads"] * DIMS["kv_heads"]
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        out += [
            (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
        ]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def vllm_layout(tensors: dict) -> dict:
    """The trainer's HF tensors stacked the way vLLM's Qwen2 stores them."""
    import torch

    out, stacks = {}, {".q_proj.": ".qkv_proj.", ".gate_proj.": ".gate_up_proj."}
    parts = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
             ".gate_up_proj.": (".gate_proj.", ".up_proj.")}
    for name, t in tensors.items():
        key = next((k for k in stacks if k in name), None)
        if key is not None:
            fused = stacks[key]
            out[name.replace(key, fused)] = torch.cat(
                [tensors[name.replace(key, p)] for p in parts[fused]])
        elif not any(p in name for ps in parts.values() for p in ps):
            out[name] = t
    return out


def save_config(path: str, layers: int) -> str:
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=DIMS["vocab"], hidden_size=DIMS["hidden"],
                intermediate_size=DIMS["inter"], num_hidden_layers=layers,
                num_attention_heads=DIMS["heads"], num_key_value_heads=DIMS["kv_heads"],
                max_position_embeddings=4096, tie_word_embeddings=False).save_pretrained(path)
    return path


# --------------------------------------------------------------------------- trainer process


class RemoteClient:
    """vLLM's `VLLMWeightSyncClient` for the engine in the driver process: each call goes over
    the control socket and the driver makes it on its `LLM` (what `HTTPVLLMWeightSyncClient`
    does over HTTP). Calls come one at a time (`send_weights` makes `update_weights` from a side
    thread while its own thread pushes); the lock orders them."""

    def __init__(self, sock) -> None:
        self.sock, self.lock = sock, threading.Lock()

    def _call(self, name: str, *args, **kwargs) -> None:
        with self.lock:
            self.sock.send_json({"rpc": name, "args": list(args), "kwargs": kwargs})
            reply = self.sock.recv_json()
        if "error" in reply:
            raise RuntimeError(reply["error"])

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update",
                   **({} if weight_version is None else {"weight_version": weight_version}))


def dict_source(tensors: dict):
    """vLLM's `WeightSource` over the trainer's tensors (HF names, checkpoint order)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class DictSource(WeightSource):
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]

        def __iter__(self):
            return iter(tensors.items())

    return DictSource()


def api_trainer(sock, tensors: dict, bucket: int, gpu: bool):
    """This project's trainer engine through vLLM's `WeightTransferTrainerFactory` only."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from vllm_nccl_sync.weight_transfer import BACKEND, SURFACE, NcclSyncTrainerInitInfo

    info = NcclSyncTrainerInitInfo(world_size=2, rank=0, bucket_bytes=bucket, timeout_s=120.0,
                                   transport="nccl" if gpu else "gloo")
    client, source = RemoteClient(sock), dict_source(tensors)
    if SURFACE.trainer_backend_classvar:  # vLLM 0.32: the backend is info's ClassVar
        return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    from vllm.config.weight_transfer import WeightTransferConfig  # vLLM 0.26: by name

    return WeightTransferTrainerFactory.trainer_init(
        BACKEND, WeightTransferConfig(backend=BACKEND), info, client=client, source=source)


def trainer_weights(layers: int, dev) -> tuple[dict, dict]:
    """The trainer's random bf16 weights (HF names, checkpoint order) on `dev`, and what it tells
    the driver: total bytes, the checksums expected in vLLM's layout, names and shapes."""
    import torch

    g = torch.Generator(device=dev).manual_seed(1234)
    tensors = {n: torch.empty(s, dtype=torch.bfloat16, device=dev).normal_(generator=g)
               for n, s in model_spec(layers)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    expected = checksums(vllm_layout(tensors))
    return tensors, {"nbytes": nbytes, "expected": expected, "names": list(tensors),
                     "shapes": [list(t.shape) for t in tensors.values()]}


def trainer(args) -> None:
    """Holds the weights on its GPU; sends them by whichever method the driver asks for."""
    import torch
    import zmq

    gpu = not args.cpu_smoke
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(dev)
    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(f"tcp://127.0.0.1:{args.ctl_port}")
    tensors, info = trainer_weights(args.layers, dev)
    nbytes = info["nbytes"]
    sock.send_json(info)
    clients: dict[int, object] = {}
    group, flat, api = None, None, None
    while True:
        msg = sock.recv_json()
        cmd, t0 = msg["cmd"], time.perf_counter()
        if cmd == "quit":
            sock.send_json({"ok": True, "s": 0.0})
            break
        if cmd in ("join_api", "leave") or msg.get("method") == "ours_vllm_api":
            try:  # a failure is reported to the driver at once (it serves the RPCs meanwhile)
                if cmd == "leave":  # the first engine goes: close what joined it
                    for c in clients.values():
                        c.close()
                    clients, group, flat = {}, None, None
                elif cmd == "join_api":
                    if api is not None:
                        api.shutdown()
                    api = api_trainer(sock, tensors, msg["bucket"], gpu)
                else:
                    api.send_weights(version=msg["version"])
                    if gpu:
                        torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - reported
                import traceback

                traceback.print_exc()
                sock.send_json({"ok": False, "error": repr(e), "s": time.perf_counter() - t0})
                continue
            sock.send_json({"ok": True, "s": time.perf_counter() - t0})
            continue
        if cmd == "join_ours":
            from vllm_nccl_sync import PushClient, SyncConfig

            for c in clients.values():
                c.close()
            clients = {msg["cfg"]["bucket_bytes"]: PushClient(SyncConfig(**msg["cfg"]),
                                                              dev if gpu else None)}
            next(iter(clients.values())).connect()
        elif cmd == "join_vllm":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            group = NCCLWeightTransferEngine.trainer_init(msg["init"])
        elif cmd == "send":
            method = msg["method"]
            if method == "ours":
                clients[msg["bucket"]].push(tensors.items(), version=msg["version"])
            elif method == "raw":
                if flat is None:
                    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                next(iter(clients.values())).transport.broadcast(flat).wait()
            else:
                from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

                NCCLWeightTransferEngine.trainer_send_weights(
                    iter(tensors.items()),
                    {"group": group, "packed": method == "vllm_packed",
                     "packed_buffer_size_bytes": msg["bucket"], "packed_num_buffers": 2})
            if gpu:  # vLLM's packed producer leaves its last buckets on side streams
                torch.cuda.synchronize()
        sock.send_json({"ok": True, "s": time.perf_counter() - t0})
    for c in clients.values():
        c.close()
    if api is not None:
        api.shutdown()


# --------------------------------------------------------------------------- driver + engine


class Driver:
    def __init__(self, args, llm, sock, info: dict) -> None:
        import torch

        self.torch, self.args, self.llm, self.sock, self.info = torch, args, llm, sock, info
        self.gpu = not args.cpu_smoke
        self.version = 0
        self.persistent: dict[str, int] = {}
        self.names, self.shapes = info.get("names", []), info.get("shapes", [])

    def ask(self, msg: dict, timeout_s: float = 300.0) -> dict:
        self.sock.send_json(msg)
        return self.wait(timeout_s)

    def wait(self, timeout_s: float = 300.0) -> dict:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"trainer did not answer within {timeout_s} s")
        return self.sock.recv_json()

    def allocated(self) -> int:
        if not self.gpu:
            return 0
        self.torch.cuda.synchronize()
        return self.torch.cuda.memory_allocated()

    def join_ours(self, bucket: int) -> None:
        from vllm_nccl_sync.trainer.sync import free_port

        cfg = dict(backend="nccl" if self.gpu else "gloo", control_port=free_port(), group_port=free_port(),
                   world_size=2, bucket_bytes=bucket, timeout_s=120.0)
        self.llm.collective_rpc("nccl_sync_close")  # free an earlier group's buffers first
        before = self.allocated()
        self.sock.send_json({"cmd": "join_ours", "cfg": cfg})
        self.llm.collective_rpc("nccl_sync_join", args=(cfg, 1))
        self.wait()
        self.persistent[f"ours@{bucket}"] = self.allocated() - before

    def join_vllm(self) -> None:
        from vllm_nccl_sync.trainer.sync import free_port

        init = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2}
        before = self.allocated()
        self.sock.send_json({"cmd": "join_vllm", "init": init})
        self.llm.init_weight_transfer_engine({"init_info": {**init, "rank_offset": 1}})
        self.wait()
        self.persistent["vllm"] = self.allocated() - before

    def serve(self, last: str, timeout_s: float = 300.0) -> None:
        """Make the trainer's vLLM API calls (`RemoteClient`) on this engine's `LLM` until the
        call `last` was made; a failure on the trainer's side raises here."""
        from vllm_nccl_sync.weight_transfer import OfflineClient

        client = OfflineClient(self.llm)
        while True:
            msg = self.wait(timeout_s)
            if "rpc" not in msg:  # the trainer gave up before its last call
                raise RuntimeError(f"trainer failed: {msg.get('error', msg)}")
            try:
                getattr(client, msg["rpc"])(*msg["args"], **msg["kwargs"])
                self.sock.send_json({"ok": True})
            except Exception as e:  # noqa: BLE001 - the trainer's engine reports it
                self.sock.send_json({"error": f"{type(e).__name__}: {e}"})
            if msg["rpc"] == last:
                return

    def join_api(self, bucket: int) -> None:
        """The trainer joins this engine through vLLM's trainer factory (`nccl_sync`)."""
        before = self.allocated()
        self.sock.send_json({"cmd": "join_api", "bucket": bucket})
        self.serve("init_weight_transfer_engine")
        reply = self.wait()
        if not reply.get("ok"):
            raise RuntimeError(f"trainer failed to join: {reply.get('error')}")
        self.persistent[f"ours_vllm_api@{bucket}"] = self.allocated() - before

    def engine_side(self, method: str, bucket: int) -> dict:
        llm = self.llm
        if method == "ours_vllm_api":
            self.serve("finish_weight_update")
            return {}
        if method == "ours":
            [s] = llm.collective_rpc("nccl_sync_receive", args=(120.0,))
            if not s.get("ok"):
                raise RuntimeError(f"receive failed: {s}")
            return {"rx_s": s["seconds"], "buckets": s["buckets"],
                    "graph_launches": s.get("load", {}).get("graph_launches"),
                    "through_loader": s.get("load", {}).get("through_loader"),
                    **({"rx_phases": {k: v / 1e3 for k, v in s["steps_ms"].items()}}
                       if "steps_ms" in s else {})}
        if method == "raw":
            llm.collective_rpc("bench_raw", args=(self.info["nbytes"],))
            return {}
        llm.start_weight_update()
        llm.update_weights({"update_info": {
            "names": self.names, "dtype_names": ["bfloat16"] * len(self.names),
            "shapes": self.shapes, "packed": method == "vllm_packed",
            "packed_buffer_size_bytes": bucket, "packed_num_buffers": 2}})
        llm.finish_weight_update()
        return {}

    def run(self, method: str, bucket: int) -> dict:
        """One timed update, start to finish, with the engine's peak extra memory."""
        torch = self.torch
        self.version += 1
        base = self.allocated()
        if self.gpu:
            torch.cuda.reset_peak_memory_stats()
        self.sock.send_json({"cmd": "send", "method": method, "bucket": bucket,
                             "version": self.version})
        t0 = time.perf_counter()
        extra = self.engine_side(method, bucket)
        if self.gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        reply = self.wait()
        if not reply.get("ok"):
            raise RuntimeError(f"trainer failed ({method}): {reply.get('error')}")
        peak = torch.cuda.max_memory_allocated() - base if self.gpu else 0
        if method == "ours_vllm_api":  # after the clock: the receiver's own time and buckets
            [extra] = self.llm.collective_rpc("bench_api_last")
        return {"s": seconds, "trainer_s": reply["s"], "peak_extra": peak,
                **({"phases": reply["phases"]} if reply.get("phases") else {}), **extra}

    def verify(self, method: str, bucket: int) -> dict:
        """Zero the engine's weights, update once, compare every parameter bit for bit."""
        self.llm.collective_rpc("bench_zero")
        self.run(method, bucket)
        [got] = self.llm.collective_rpc("bench_checksums")
        want = self.info["expected"]
        bad = sorted(n for n in want if got.get(n) != want[n])
        return {"exact": not bad and set(got) == set(want), "mismatched": bad[:10],
                "missing": sorted(set(want) - set(got))[:10],
                "unexpected": sorted(set(got) - set(want))[:10]}


def stats(runs: list[dict]) -> dict:
    times = [r["s"] for r in runs]
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "times_s": times, "peak_extra_bytes": max(r["peak_extra"] for r in runs),
            "trainer_s_median": statistics.median(r["trainer_s"] for r in runs),
            **({"rx_s_median": statistics.median(r["rx_s"] for r in runs),
                "buckets": runs[0]["buckets"]} if "rx_s" in runs[0] else {}),
            **({key: [r[key] for r in runs]  # per push (copyplan)
                for key in ("graph_launches", "through_loader")
                if all(r.get(key) is not None for r in runs)}),
            **({"trainer_phases_s_median": {k: statistics.median(r["phases"].get(k, 0.0)
                                                                 for r in runs)
                                            for k in runs[0]["phases"]}}
               if all("phases" in r for r in runs) else {}),
            **({"rx_phases_s_median": {k: statistics.median(r["rx_phases"].get(k, 0.0)
                                                            for r in runs)
                                       for k in runs[0]["rx_phases"]}}
               if all("rx_phases" in r for r in runs) else {})}


def timed(drv: Driver, methods: list[tuple[str, int]], reps: int) -> dict:
    runs: dict[tuple[str, int], list[dict]] = {m: [] for m in methods}
    for rep in range(1 + reps):
        k = rep % len(methods)
        for m in methods[k:] + methods[:k]:  # rotate the order: no method always goes first
            r = drv.run(*m)
            if rep:  # rep 0 is the warm-up
                runs[m].append(r)
            print(f"rep {rep} {m[0]}@{size_text(m[1])}: {r['s'] * 1e3:.1f} ms", flush=True)
    return runs


def add_ratios(rows: list[dict]) -> None:
    """Give every row `ratio_to_raw` (raw's median over the row's) and `vs_vllm_packed`, both
    against the rows of its own block (`series`); rows outside a block against the first one."""
    def ref(method: str, series: int | None) -> float | None:
        same = [r for r in rows if r["method"] == method and r.get("series") == series]
        return (same or [r for r in rows if r["method"] == method] or [{}])[0].get("median_s")

    for r in rows:
        raw, vp = ref("raw", r.get("series")), ref("vllm_packed", r.get("series"))
        r["ratio_to_raw"] = raw / r["median_s"]
        r["vs_vllm_packed"] = vp / r["median_s"] if vp else None


def table(rep: dict) -> str:
    add_ratios(rep["rows"])
    gb = rep["model"]["bytes"] / 1e9
    lines = [f"Model: {gb:.2f} GB bf16, {rep['model']['tensors']} tensors "
             f"(Qwen2-7B dims, {rep['model']['layers']} layers, untied).", "",
             "| method | bucket | ms (median) | min-max ms | GB/s | ratio to raw | vs vllm_packed "
             "| engine extra GPU mem (kept + peak in update) | bit-exact |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rep["rows"]:
        vs = f"{r['vs_vllm_packed']:.2f}x" if r["vs_vllm_packed"] else "-"
        kept, peak = r["kept_bytes"], r["peak_extra_bytes"]
        mem = "-" if r["method"] == "raw" else (
            f"{(kept + peak) / 2**30:.2f} GiB ({kept / 2**30:.2f} + {peak / 2**30:.2f})")
        bucket = "-" if r["method"] in ("raw", "vllm_per_tensor") else size_text(r["bucket"])
        if "series" in r and bucket == "-":  # several blocks: say which one
            bucket = f"- ({size_text(r['bucket'])} block)"
        exact = {True: "yes", False: "NO", None: "-"}[r.get("exact")]
        lines.append(
            f"| {r['method']}{' (separate block)' if r.get('block') else ''}"
            f"{' (2nd engine)' if r.get('engine') == 2 else ''} | {bucket} "
            f"| {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f} "
            f"| {gb / r['median_s']:.0f} | {r['ratio_to_raw']:.3f} "
            f"| {vs} | {mem} | {exact} |")
    return "\n".join(lines)


def main_block(drv: Driver, bucket: int, series: int | None) -> list[dict]:
    """raw and the chosen methods at `bucket`, interleaved, after this project's sender and
    receiver joined afresh; then each method's bit-exact check. `series`: the block's index when
    the run has several bucket sizes (each block's ratios are against its own raw)."""
    drv.join_ours(bucket)
    main = [("raw", bucket)] + [(m, bucket) for m in ("ours", "vllm_packed", "vllm_per_tensor")
                                if m in drv.args.methods]
    runs = timed(drv, main, drv.args.reps)
    drv.llm.collective_rpc("bench_free_raw")
    if drv.gpu:
        drv.torch.cuda.empty_cache()
    checks = {m: drv.verify(*m) for m in main if m[0] != "raw"}
    rows = []
    for m in main:
        kept = drv.persistent[f"ours@{bucket}"] if m[0] == "ours" else (
            drv.persistent["vllm"] if m[0].startswith("vllm") else 0)
        rows.append({"method": m[0], "bucket": m[1], "kept_bytes": kept, **stats(runs[m]),
                     **({"series": series} if series is not None else {}),
                     **({"exact": checks[m]["exact"], "check": checks[m]} if m in checks
                        else {})})
    return rows


def env_info() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import vllm

        info["gpu"] = torch.cuda.get_device_name(0)

        info["vllm"] = vllm.__version__
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=False).stdout.strip()
    except Exception as e:  # pragma: no cover
        info["error"] = repr(e)
    return info


def start_engine(args, path: str, backend: str | None, ext: str = "bench_vllm_gpu.BenchExt"):
    """A vLLM `LLM` in this process with the benchmark's settings, this weight-transfer backend
    (None: none, the CPU smoke's first engine) and worker extension `ext`."""
    from vllm import LLM

    wt = {} if backend is None else {"weight_transfer_config": {"backend": backend}}
    return LLM(model=path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
               enforce_eager=not args.compile, gpu_memory_utilization=args.gpu_mem,
               max_model_len=2048, max_num_seqs=16, seed=0,
               worker_extension_cls=ext, **wt)


def stop_engine(llm) -> None:
    """Shut an in-process engine down and free its memory (before starting the next one)."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def driver(args) -> dict:
    os.environ["CUDA_VISIBLE_DEVICES"] = args.engine_gpu
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    import torch
    import zmq

    sock = zmq.Context().socket(zmq.PAIR)
    ctl_port = sock.bind_to_random_port("tcp://127.0.0.1")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=args.trainer_gpu,
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "trainer",
           "--ctl-port", str(ctl_port), "--layers", str(args.layers)]
    cmd += ["--cpu-smoke"] if args.cpu_smoke else []
    proc = subprocess.Popen(cmd, env=env)
    error = None
    path = tempfile.mkdtemp(prefix="bench-vllm-")
    try:
        save_config(path, args.layers)
        t0 = time.perf_counter()
        # vLLM's NCCL transfer needs CUDA: the CPU smoke's first engine has no backend
        llm = start_engine(args, path, None if args.cpu_smoke else "nccl")
        startup = time.perf_counter() - t0
        buckets = [int(mib * MiB) for mib in args.bucket_mib]
        bucket = buckets[0]
        drv = Driver(args, llm, sock, {})
        drv.info = drv.wait(600)  # the trainer's weights and expected checksums
        drv.names, drv.shapes = drv.info["names"], drv.info["shapes"]
        if any(m.startswith("vllm") for m in args.methods):
            drv.join_vllm()
        rows = []
        for series, b in enumerate(buckets):  # one block per bucket size, each a fresh sender
            rows += main_block(drv, b, series if len(buckets) > 1 else None)
        for mib in args.extra_ours_mib if "ours" in args.methods else []:
            b = int(mib * MiB)  # other bucket sizes for ours, after the main block
            drv.join_ours(b)
            extra = timed(drv, [("ours", b)], args.reps)[("ours", b)]
            chk = drv.verify("ours", b)
            rows.append({"method": "ours", "bucket": b, "block": True,
                         "kept_bytes": drv.persistent[f"ours@{b}"], **stats(extra),
                         "exact": chk["exact"], "check": chk})
        llm.collective_rpc("nccl_sync_close")
        startup2 = None
        if "ours_vllm_api" in args.methods:
            # An engine has one weight-transfer backend: a second engine for `nccl_sync`.
            drv.ask({"cmd": "leave"})
            drv.llm = None
            stop_engine(llm)
            del llm
            import vllm_nccl_sync.weight_transfer  # noqa: F401 - registers `nccl_sync` here
            m = ("ours_vllm_api", bucket)
            try:
                t0 = time.perf_counter()
                drv.llm = start_engine(args, path, "nccl_sync")
                startup2 = time.perf_counter() - t0
                drv.join_api(bucket)
                api = timed(drv, [m], args.reps)[m]
                if not args.cpu_smoke:
                    torch.cuda.empty_cache()
                chk = drv.verify(*m)
                rows.append({"method": m[0], "bucket": bucket, "engine": 2,
                             "kept_bytes": drv.persistent[f"ours_vllm_api@{bucket}"],
                             **stats(api), "exact": chk["exact"], "check": chk})
            except Exception as e:  # report the first engine's rows all the same
                import traceback

                traceback.print_exc()
                error = f"ours_vllm_api: {type(e).__name__}: {e}"
        if error is None:
            drv.ask({"cmd": "quit"})
        specs = drv.info
        report = {
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "env": env_info(), "engine_startup_s": startup, "engine2_startup_s": startup2,
            "buckets": buckets, "wall_s": time.perf_counter() - T0,
            "model": {"bytes": specs["nbytes"], "tensors": len(specs["names"]),
                      "layers": args.layers, "dims": DIMS},
            "reps": args.reps, "methods": args.methods, "rows": rows,
            **({"error": error} if error else {}),
        }
        report["table"] = table(report)
        return report
    finally:
        shutil.rmtree(path, ignore_errors=True)
        try:  # a trainer left mid-call by a failure is not waited for
            proc.wait(timeout=30 if error is None else 1)
        except subprocess.TimeoutExpired:
            proc.kill()


def write_report(report: dict, json_path: str, md_path: str) -> None:
    """Print the report's table; write the report as JSON and its table as markdown where asked."""
    print(report["table"], flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    if md_path:
        with open(md_path, "w") as f:
            f.write(report["table"] + "\n")


def use_smoke_dims() -> None:
    """`--cpu-smoke`: the tiny dims, and vLLM CPU's KV cache and thread binding for a small host."""
    DIMS.update(SMOKE_DIMS)
    for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():
        os.environ.setdefault(k, v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", default="driver", choices=["driver", "trainer"])
    ap.add_argument("--layers", type=int, default=14, help="Qwen2-7B layers (14: 8.7 GB)")
    ap.add_argument("--bucket-mib", default="1024",
                    help="bucket of ours and vllm_packed (fractions for --cpu-smoke); a comma "
                         "list runs one block per size, in that order")
    ap.add_argument("--extra-ours-mib", default="512", help="more bucket sizes for ours (comma)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--compile", action="store_true", help="engine with torch.compile + graphs")
    ap.add_argument("--gpu-mem", type=float, default=0.35, help="vLLM gpu_memory_utilization")
    ap.add_argument("--engine-gpu", default="1")
    ap.add_argument("--trainer-gpu", default="0")
    ap.add_argument("--ctl-port", type=int, default=0)
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="")
    ap.add_argument("--methods", default=",".join(METHODS[1:]),
                    help=f"comma list of {', '.join(METHODS[1:])} (raw always runs)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="script check on a CPU vLLM: tiny dims, gloo, raw, ours, ours_vllm_api")
    args = ap.parse_args()
    if args.cpu_smoke:
        use_smoke_dims()
    args.bucket_mib = [float(x) for x in args.bucket_mib.split(",") if x]
    args.extra_ours_mib = [float(x) for x in args.extra_ours_mib.split(",") if x]
    if not args.bucket_mib:
        ap.error("--bucket-mib needs at least one size")
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    if args.cpu_smoke:  # vLLM's NCCL transfer needs CUDA
        args.methods = [m for m in args.methods if not m.startswith("vllm")]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
    if args.role == "trainer":
        trainer(args)
        os._exit(0)
    report = driver(args)
    write_report(report, args.json, args.md)
    bad = [f"{r['method']}@{size_text(r['bucket'])}" for r in report["rows"]
           if r.get("exact") is False]
    if bad:
        print(f"not bit-exact: {bad}", flush=True)
    if report.get("error"):
        print(f"FAILED {report['error']}", flush=True)
    sys.stdout.flush()
    os._exit(1 if bad or report.get("error") else 0)  # skip interpreter teardown (vLLM/NCCL atexit hooks can hang)


if __name__ == "__main__":
    main()
