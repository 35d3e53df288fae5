"""Weight updates of a real vLLM engine, head to head: trainer process (GPU 0) -> engine (GPU 1).

    python benchmarks/bench_vllm_gpu.py --layers 14 --bucket-mib 1024 --reps 7 --json out.json

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
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MiB = 1 << 20
DIMS = dict(hidden=3584, inter=18944, heads=28, kv_heads=4, vocab=152064)  # Qwen2-7B
SMOKE_DIMS = dict(hidden=64, inter=160, heads=4, kv_heads=2, vocab=1000)  # `--cpu-smoke` only
_CH = 1 << 24

try:  # the engine imports this module as its worker extension
    from vllm_nccl_sync.ext import Ext
except ImportError:  # pragma: no cover
    Ext = object


class BenchExt(Ext):
    """`vllm_nccl_sync.Ext` plus the benchmark's engine-side probes (prefixed `bench_`)."""

    def bench_raw(self, nbytes: int) -> None:
        """Receive one broadcast of `nbytes` over the joined group into a preallocated buffer."""
        import torch

        buf = getattr(self, "_bench_buf", None)
        if buf is None or buf.numel() != nbytes:
            buf = self._bench_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._nccl_sync[0].transport.broadcast(buf).wait()
        if buf.is_cuda:
            torch.cuda.current_stream().synchronize()

    def bench_free_raw(self) -> None:
        self._bench_buf = None

    def bench_zero(self) -> None:
        import torch

        with torch.no_grad():
            for p in self.model_runner.model.parameters():
                p.zero_()

    def bench_checksums(self) -> dict[str, list[int]]:
        return checksums(dict(self.model_runner.model.named_parameters()))


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
    g = torch.Generator(device=dev).manual_seed(1234)
    tensors = {n: torch.empty(s, dtype=torch.bfloat16, device=dev).normal_(generator=g)
               for n, s in model_spec(args.layers)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    expected = checksums(vllm_layout(tensors))
    sock.send_json({"nbytes": nbytes, "expected": expected,
                    "names": list(tensors), "shapes": [list(t.shape) for t in tensors.values()]})
    clients: dict[int, object] = {}
    group, flat = None, None
    while True:
        msg = sock.recv_json()
        cmd, t0 = msg["cmd"], time.perf_counter()
        if cmd == "quit":
            sock.send_json({"ok": True, "s": 0.0})
            break
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
        from vllm_nccl_sync.sync import free_port

        cfg = dict(backend="nccl" if self.gpu else "gloo", control_port=free_port(), group_port=free_port(),
                   world_size=2, bucket_bytes=bucket, timeout_s=120.0)
        self.llm.collective_rpc("nccl_sync_close")  # free an earlier group's buffers first
        before = self.allocated()
        self.sock.send_json({"cmd": "join_ours", "cfg": cfg})
        self.llm.collective_rpc("nccl_sync_join", args=(cfg, 1))
        self.wait()
        self.persistent[f"ours@{bucket}"] = self.allocated() - before

    def join_vllm(self) -> None:
        from vllm_nccl_sync.sync import free_port

        init = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2}
        before = self.allocated()
        self.sock.send_json({"cmd": "join_vllm", "init": init})
        self.llm.init_weight_transfer_engine({"init_info": {**init, "rank_offset": 1}})
        self.wait()
        self.persistent["vllm"] = self.allocated() - before

    def engine_side(self, method: str, bucket: int) -> dict:
        llm = self.llm
        if method == "ours":
            [s] = llm.collective_rpc("nccl_sync_receive", args=(120.0,))
            if not s.get("ok"):
                raise RuntimeError(f"receive failed: {s}")
            return {"rx_s": s["seconds"], "buckets": s["buckets"]}
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
        peak = torch.cuda.max_memory_allocated() - base if self.gpu else 0
        return {"s": seconds, "trainer_s": reply["s"], "peak_extra": peak, **extra}

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
                "buckets": runs[0]["buckets"]} if "rx_s" in runs[0] else {})}


def timed(drv: Driver, methods: list[tuple[str, int]], reps: int) -> dict:
    runs: dict[tuple[str, int], list[dict]] = {m: [] for m in methods}
    for rep in range(1 + reps):
        k = rep % len(methods)
        for m in methods[k:] + methods[:k]:  # rotate the order: no method always goes first
            r = drv.run(*m)
            if rep:  # rep 0 is the warm-up
                runs[m].append(r)
            print(f"rep {rep} {m[0]}@{m[1] // MiB}MiB: {r['s'] * 1e3:.1f} ms", flush=True)
    return runs


def table(rep: dict) -> str:
    raw = next(r for r in rep["rows"] if r["method"] == "raw")["median_s"]
    vp = next((r["median_s"] for r in rep["rows"] if r["method"] == "vllm_packed"), None)
    gb = rep["model"]["bytes"] / 1e9
    lines = [f"Model: {gb:.2f} GB bf16, {rep['model']['tensors']} tensors "
             f"(Qwen2-7B dims, {rep['model']['layers']} layers, untied).", "",
             "| method | bucket | ms (median) | min-max ms | GB/s | ratio to raw | vs vllm_packed "
             "| engine extra GPU mem (kept + peak in update) | bit-exact |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rep["rows"]:
        vs = f"{vp / r['median_s']:.2f}x" if vp else "-"
        kept, peak = r["kept_bytes"], r["peak_extra_bytes"]
        mem = "-" if r["method"] == "raw" else (
            f"{(kept + peak) / 2**30:.2f} GiB ({kept / 2**30:.2f} + {peak / 2**30:.2f})")
        bucket = "-" if r["method"] in ("raw", "vllm_per_tensor") else f"{r['bucket'] // MiB} MiB"
        exact = {True: "yes", False: "NO", None: "-"}[r.get("exact")]
        lines.append(
            f"| {r['method']}{' (separate block)' if r.get('block') else ''} | {bucket} "
            f"| {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f} "
            f"| {gb / r['median_s']:.0f} | {raw / r['median_s']:.3f} "
            f"| {vs} | {mem} | {exact} |")
    return "\n".join(lines)


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
    try:
        from vllm import LLM

        path = save_config(tempfile.mkdtemp(prefix="bench-vllm-"), args.layers)
        t0 = time.perf_counter()
        gpu_only = {} if args.cpu_smoke else {"weight_transfer_config": {"backend": "nccl"}}
        llm = LLM(model=path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  enforce_eager=not args.compile, gpu_memory_utilization=args.gpu_mem,
                  max_model_len=2048, max_num_seqs=16, seed=0,
                  worker_extension_cls="bench_vllm_gpu.BenchExt", **gpu_only)
        startup = time.perf_counter() - t0
        bucket = args.bucket_mib * MiB
        drv = Driver(args, llm, sock, {})
        drv.info = drv.wait(600)  # the trainer's weights and expected checksums
        drv.names, drv.shapes = drv.info["names"], drv.info["shapes"]
        drv.join_ours(bucket)
        main = [("raw", bucket), ("ours", bucket)]
        if not args.cpu_smoke:  # vLLM's NCCL transfer needs CUDA
            drv.join_vllm()
            main += [("vllm_packed", bucket), ("vllm_per_tensor", bucket)]
        runs = timed(drv, main, args.reps)
        llm.collective_rpc("bench_free_raw")
        if not args.cpu_smoke:
            torch.cuda.empty_cache()
        checks = {m: drv.verify(*m) for m in main if m[0] != "raw"}
        rows = []
        for m in main:
            kept = drv.persistent[f"ours@{bucket}"] if m[0] == "ours" else (
                drv.persistent["vllm"] if m[0].startswith("vllm") else 0)
            rows.append({"method": m[0], "bucket": m[1], "kept_bytes": kept, **stats(runs[m]),
                         **({"exact": checks[m]["exact"], "check": checks[m]} if m in checks
                            else {})})
        for mib in args.extra_ours_mib:  # other bucket sizes for ours, after the main block
            b = mib * MiB
            drv.join_ours(b)
            extra = timed(drv, [("ours", b)], args.reps)[("ours", b)]
            chk = drv.verify("ours", b)
            rows.append({"method": "ours", "bucket": b, "block": True,
                         "kept_bytes": drv.persistent[f"ours@{b}"], **stats(extra),
                         "exact": chk["exact"], "check": chk})
        drv.ask({"cmd": "quit"})
        llm.collective_rpc("nccl_sync_close")
        specs = drv.info
        report = {
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "env": env_info(), "engine_startup_s": startup,
            "model": {"bytes": specs["nbytes"], "tensors": len(specs["names"]),
                      "layers": args.layers, "dims": DIMS},
            "reps": args.reps, "rows": rows,
        }
        report["table"] = table(report)
        return report
    finally:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", default="driver", choices=["driver", "trainer"])
    ap.add_argument("--layers", type=int, default=14, help="Qwen2-7B layers (14: 8.7 GB)")
    ap.add_argument("--bucket-mib", type=int, default=1024, help="bucket of ours and vllm_packed")
    ap.add_argument("--extra-ours-mib", default="512", help="more bucket sizes for ours (comma)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--compile", action="store_true", help="engine with torch.compile + graphs")
    ap.add_argument("--gpu-mem", type=float, default=0.35, help="vLLM gpu_memory_utilization")
    ap.add_argument("--engine-gpu", default="1")
    ap.add_argument("--trainer-gpu", default="0")
    ap.add_argument("--ctl-port", type=int, default=0)
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="script check on a CPU vLLM: tiny dims, gloo, raw and ours only")
    args = ap.parse_args()
    if args.cpu_smoke:
        DIMS.update(SMOKE_DIMS)
        for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():
            os.environ.setdefault(k, v)
    args.extra_ours_mib = [int(x) for x in args.extra_ours_mib.split(",") if x]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
    if args.role == "trainer":
        trainer(args)
        os._exit(0)
    report = driver(args)
    print(report["table"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(report["table"] + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (vLLM/NCCL atexit hooks can hang)


if __name__ == "__main__":
    main()
