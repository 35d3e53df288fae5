"""`vllm-nccl-sync bench`: this project's push vs a raw broadcast of the same bytes, in one run.

Two processes on whatever this machine has: with 2+ GPUs a trainer on cuda:0 and a receiver on
cuda:1 over NCCL, else both on CPU over gloo. Both join one transfer group (`PushClient` /
`Receiver`); each repetition times, on the trainer's clock, from a barrier to the receiver's
confirmation that everything is in place:

  raw   one broadcast of a contiguous buffer of the payload's size (the link's ceiling here)
  push  `PushClient.push` of the synthetic model's tensors -> `Receiver.receive` into
        preallocated tensors (`ModuleLoader`): the plan and its agreement, every bucket's
        checksum on both sides, the loads and the commit round included

With `lora_rank`, the payload is a LoRA adapter of that rank on every matrix of the synthetic
model, pushed as an adapter update (`Plan.adapter`) into the receiver's adapter loader; the report
then also gives the full model's bytes, which a full push would move instead.

Raw and push alternate, so drift hits both. After the last push, every received tensor is
checked bit for bit (sha256) against the trainer's. `benchmarks/bench_nccl.py` is the full
benchmark (several models, baselines, memory); this is the compact check for any machine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import time
import traceback
from typing import Any

import torch

MiB = 1024 * 1024


def synthetic_tensors(total_bytes: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A transformer-like mix of about `total_bytes`: bf16 matrices (one embedding of ~1/8,
    layers of two matrices) with fp32 norm vectors and bf16 biases between them."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = 256 if total_bytes < 64 * MiB else 2048
    out: dict[str, torch.Tensor] = {}

    def add(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        out[name] = torch.randn(shape, generator=g).to(dtype).to(device)

    add("embed.weight", (max(total_bytes // 8 // (2 * hidden), 1), hidden), torch.bfloat16)
    left = total_bytes - out["embed.weight"].nbytes
    layers = 8
    rows = max(left // layers // 2 // (2 * hidden), 1)
    for i in range(layers):
        add(f"layers.{i}.norm.weight", (hidden,), torch.float32)
        add(f"layers.{i}.attn.weight", (rows, hidden), torch.bfloat16)
        add(f"layers.{i}.attn.bias", (rows,), torch.bfloat16)
        add(f"layers.{i}.mlp.weight", (rows, hidden), torch.bfloat16)
    return out


def lora_tensors(base: dict[str, torch.Tensor], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """PEFT-named `lora_A` (rank x in) and `lora_B` (out x rank) for every matrix of `base`."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, t in base.items():
        if t.dim() != 2:
            continue
        stem = "base_model.model." + name.removesuffix(".weight")
        for part, shape in (("lora_A", (rank, t.shape[1])), ("lora_B", (t.shape[0], rank))):
            out[f"{stem}.{part}.weight"] = torch.randn(shape, generator=g).to(t.dtype).to(t.device)
    return out


class _Params:
    """The two methods `ModuleLoader` reads, over a dict of preallocated tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def named_parameters(self, **kw):
        return iter(self.tensors.items())

    def named_buffers(self, **kw):
        return iter(())


def join_receivers(cfgs: dict[str, dict], rank: int = 1) -> dict[str, Any]:
    """One `Receiver` of rank `rank` per config (`SyncConfig` fields), all joining at once: a
    trainer joins its groups one after the other."""
    import threading

    from vllm_nccl_sync.engine.receiver import Receiver
    from vllm_nccl_sync.wire.config import SyncConfig

    rxs: dict[str, Receiver] = {}
    joins = [threading.Thread(target=lambda n=n, c=c: rxs.__setitem__(
        n, Receiver(SyncConfig(**c), rank))) for n, c in cfgs.items()]
    for j in joins:
        j.start()
    for j in joins:
        j.join(300)
    return rxs


def write_report(report: dict, path: str, exact: bool) -> None:
    """Keep `report` as JSON at `path` (if given); exit 1 unless everything arrived `exact`."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    if not exact:
        raise SystemExit(1)


class _Side:
    """One process of the benchmark: the trainer (role 0) or the engine (role 1), its device,
    its tensors and the data plane the raw broadcasts share with the pushes."""

    def __init__(self, role: int, args: dict) -> None:
        from vllm_nccl_sync.engine.loaders import ModuleLoader
        from vllm_nccl_sync.engine.receiver import Receiver
        from vllm_nccl_sync.trainer.push import PushClient
        from vllm_nccl_sync.wire.config import SyncConfig
        from vllm_nccl_sync.wire.protocol import AdapterSpec

        self.role, self.args, self.gpu = role, args, args["backend"] == "nccl"
        if self.gpu:
            torch.cuda.set_device(role)
            self.dev = torch.device("cuda", role)
        else:
            self.dev = torch.device("cpu")
            torch.set_num_threads(args["threads"])  # two processes share the cores
        self.cfg = SyncConfig(**args["cfg"])
        self.tensors = synthetic_tensors(args["size"], seed=1 + role, device=self.dev)
        self.model_bytes = sum(t.nbytes for t in self.tensors.values())
        self.adapter = None
        if args["lora_rank"]:
            rank = args["lora_rank"]
            self.tensors = lora_tensors(self.tensors, rank, seed=11 + role)
            self.adapter = AdapterSpec("bench", 1, rank, 2.0 * rank, ["attn", "mlp"])
        self.loader = lambda: ModuleLoader(_Params(self.tensors))
        if role == 0:
            self.client = PushClient(self.cfg, device=self.dev)
            self.client.connect()
            self.tr = self.client.transport
        else:
            self.rx = Receiver(self.cfg, 1, device=self.dev, adapters=lambda spec: self.loader())
            self.tr = self.rx.transport
        self.payload = sum(t.nbytes for t in self.tensors.values())
        self.big = torch.empty(self.payload, dtype=torch.uint8, device=self.dev)
        if role == 0:
            self.big.random_(0, 256)
        self.one = torch.ones(1, dtype=torch.uint8, device=self.dev)

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.current_stream(self.dev).synchronize()

    def barrier(self) -> None:
        self.tr.broadcast(self.one, src=0).wait()
        self.tr.broadcast(self.one, src=1).wait()
        self.sync()

    def raw(self) -> float:
        """One broadcast of the payload's bytes, until the receiver says all is in place."""
        self.barrier()
        t0 = time.perf_counter()
        self.tr.broadcast(self.big).wait()
        self.tr.broadcast(self.one, src=1).wait()  # queued after the receiver's copies
        self.sync()
        return time.perf_counter() - t0

    def push(self, rep: int) -> tuple[float, Any]:
        """One update of version `rep + 1`: its seconds and, on the trainer, its PushResult."""
        from vllm_nccl_sync.engine.metrics import ProgressPrinter

        self.barrier()
        t0, res = time.perf_counter(), None
        if self.role == 0:
            show = self.args["progress"] and rep == self.args["reps"]
            printer = ProgressPrinter(self.payload, label="push") if show else None
            res = self.client.push(self.tensors, version=rep + 1, progress=printer,
                                   adapter=self.adapter)
            if printer:
                printer.finish(res)
        else:
            summary = self.rx.receive(self.loader(), timeout_s=self.cfg.timeout_s)
            if not summary["ok"]:
                raise RuntimeError(f"receive failed: {summary}")
        return time.perf_counter() - t0, res


def _role(role: int, args: dict) -> dict:
    from vllm_nccl_sync.verify import digest

    side = _Side(role, args)
    raw, push, last = [], [], None
    for rep in range(args["reps"] + 1):  # the first of each is a warm-up
        raw.append(side.raw())
        seconds, last = side.push(rep)
        push.append(seconds)
    side.sync()
    out: dict[str, Any] = {"role": role, "digests": {n: digest(t) for n, t in side.tensors.items()}}
    if role == 0:
        out.update(raw=raw[1:], push=push[1:], payload=side.payload, tensors=len(side.tensors),
                   buckets=last.buckets, wire=last.bytes, model_bytes=side.model_bytes)
        side.client.close()
    else:
        side.rx.close()
    return out


def _entry(q: Any, role: int, args: dict) -> None:
    try:
        q.put((role, True, _role(role, args)))
    except BaseException:
        q.put((role, False, traceback.format_exc()))


def _run_pair(args: dict, deadline_s: float) -> list[dict]:
    """Both roles in spawned processes; the remote traceback or a deadline raises RuntimeError."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(q, r, args), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    end = time.monotonic() + deadline_s
    try:
        while len(got) < 2:
            if time.monotonic() > end:
                raise RuntimeError(f"benchmark still running after {deadline_s:.0f} s")
            try:
                role, ok, val = q.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a benchmark process died (exit codes {dead})") from None
                continue
            if not ok:
                raise RuntimeError(f"benchmark process {role} failed:\n{val}")
            got[role] = val
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    return [got[0], got[1]]


def run(*, size_bytes: int, bucket_bytes: int, reps: int = 5, backend: str = "auto",
        timeout_s: float = 120.0, deadline_s: float = 600.0, progress: bool = False,
        lora_rank: int = 0) -> dict:
    """Run the benchmark; returns medians, GB/s, their ratio and whether the bytes are exact.
    `lora_rank` > 0: push a LoRA adapter of that rank of the synthetic model instead of it."""
    from vllm_nccl_sync.trainer.sync import free_port
    from vllm_nccl_sync.wire.config import SyncConfig

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < 2:
        raise ValueError("the nccl backend needs 2 GPUs here")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
    cfg = SyncConfig(control_port=free_port(), group_port=free_port(), world_size=2,
                     backend=backend, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    threads = max((os.cpu_count() or 2) // 2, 1)
    args = {"cfg": cfg.to_dict(), "backend": backend, "size": size_bytes, "reps": reps,
            "progress": progress, "threads": threads, "lora_rank": lora_rank}
    trainer, receiver = _run_pair(args, deadline_s)
    raw_s, push_s = statistics.median(trainer["raw"]), statistics.median(trainer["push"])
    n = trainer["payload"]
    where = "cuda:0 -> cuda:1" if backend == "nccl" else "cpu -> cpu (2 processes)"
    return {"backend": backend, "where": where, "payload_bytes": n, "tensors": trainer["tensors"],
            "bucket_bytes": bucket_bytes, "buckets": trainer["buckets"],
            "wire_bytes": trainer["wire"], "reps": reps, "lora_rank": lora_rank,
            "model_bytes": trainer["model_bytes"],
            "raw_s": raw_s, "push_s": push_s, "raw_gbps": n / raw_s / 1e9,
            "push_gbps": n / push_s / 1e9, "ratio": raw_s / push_s,
            "raw_times_s": trainer["raw"], "push_times_s": trainer["push"],
            "bit_exact": trainer["digests"] == receiver["digests"]}


def format_report(r: dict) -> str:
    what = (f"a rank-{r['lora_rank']} LoRA adapter ({r['payload_bytes'] / r['model_bytes']:.4f} x "
            f"the model's {r['model_bytes'] / MiB:.1f} MiB)" if r.get("lora_rank") else "")
    return "\n".join([
        (f"bench: {r['backend']} {r['where']}; {r['payload_bytes'] / MiB:.1f} MiB in "
         f"{r['tensors']} tensors{'; ' + what if what else ''}; bucket "
         f"{r['bucket_bytes'] / MiB:g} MiB; median of {r['reps']}"),
        f"  raw broadcast   {r['raw_gbps']:8.2f} GB/s  {r['raw_s'] * 1e3:9.2f} ms",
        (f"  vllm-nccl-sync  {r['push_gbps']:8.2f} GB/s  {r['push_s'] * 1e3:9.2f} ms  "
         f"({r['buckets']} buckets, wire {r['wire_bytes'] / r['payload_bytes']:.3f} x payload)"),
        f"  push / raw      {r['ratio']:8.3f}",
        f"  bit-exact       {'yes' if r['bit_exact'] else 'NO'}",
    ])
