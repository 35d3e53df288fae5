"""Shard to shard against broadcast: one push of a TP=2 engine's update, in one run, side by side.

A trainer process pushes a synthetic Qwen2-7B-like state dict (the 7B's proportions, its hidden
size scaled so the model is about `--mib`) to the two workers of one TP=2 engine (ranks 1 and 2,
replica 0, tp_rank 0 and 1), each in a process of its own; real ZeroMQ control, gloo data plane,
no vLLM. Each worker reads of every checkpoint tensor what a TP=2 vLLM engine's loaders read:

  rows     half the rows: q/k/v weights and biases, gate/up, the embedding and the LM head
           (column- and vocab-parallel)
  cols     half the columns: o_proj, down_proj (row-parallel)
  whole    the norms

Two modes, one after the other, each with fresh processes and ports, joined once, then
`--warmup` + `--pushes` pushes of the whole state dict:

  shard      `SyncConfig(shard=True)`, every worker publishing its read set: each gets only its
             blocks, point to point
  broadcast  `SyncConfig(shard=False)`, no read sets: every worker gets every tensor whole

The workers' loader counts the tensors it is given and keeps nothing (the receiver's
`Reassembler` writes the blocks). Per push: the trainer's `PushResult.seconds` and its wall time
around `push`, the bytes sent to each worker (`PushResult.per_receiver`; broadcast: `bytes` to
each) and what each worker's data plane received (its `Ack.bytes`); these must agree, and in
shard mode equal the worker's read set plus alignment padding.

    python benchmarks/bench_shard.py --mib 256 --pushes 5 --json out.json --md out.md
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from vllm_nccl_sync import PushClient, SyncConfig
from vllm_nccl_sync.engine.receiver import Receiver
from vllm_nccl_sync.wire.packing import ALIGN, DTYPES
from vllm_nccl_sync.wire.protocol import Block, Read, ReadSet
from vllm_nccl_sync.wire.reads import nbytes

MiB = 1 << 20
TP = 2
RANKS = (1, 2)  # the TP=2 engine's workers; tp_rank = rank - 1
MODES = ("shard", "broadcast")
# Qwen2-7B: hidden 3584 = 28 heads x 128, 4 KV heads, intermediate 18944, vocab 152064, 28 layers.
HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 28, 4, 128, 18944, 152064, 28
PER_LAYER = (2 * HEADS + 2 * KV_HEADS + 3 * INTER / HEAD_DIM) / HEADS  # layer params / hidden^2

Spec = dict[str, tuple[list[int], str]]
"""Checkpoint name -> (shape, what each worker reads: "rows", "cols" or "whole")."""


def layout(mib: float, layers: int, dtype: str) -> Spec:
    """A Qwen2-7B-like stack of `layers` layers of about `mib` MiB: head_dim scaled down, the
    vocabulary scaled so the embedding and LM head keep their 7B share of the model."""
    per_h2 = layers * PER_LAYER + 2 * VOCAB / (HEADS * HEAD_DIM) * layers / LAYERS
    hidden_est = (mib * MiB / DTYPES[dtype].itemsize / per_h2) ** 0.5
    hd = max(1, round(hidden_est / HEADS))
    h, kv, inter = HEADS * hd, KV_HEADS * hd, INTER * hd // HEAD_DIM
    vocab = 2 * round(VOCAB * hd / HEAD_DIM * layers / LAYERS / 2)
    spec: Spec = {"model.embed_tokens.weight": ([vocab, h], "rows")}
    for i in range(layers):
        p = f"model.layers.{i}."
        spec[p + "input_layernorm.weight"] = ([h], "whole")
        for name, rows in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
            spec[f"{p}self_attn.{name}.weight"] = ([rows, h], "rows")
            spec[f"{p}self_attn.{name}.bias"] = ([rows], "rows")
        spec[p + "self_attn.o_proj.weight"] = ([h, h], "cols")
        spec[p + "post_attention_layernorm.weight"] = ([h], "whole")
        spec[p + "mlp.gate_proj.weight"] = ([inter, h], "rows")
        spec[p + "mlp.up_proj.weight"] = ([inter, h], "rows")
        spec[p + "mlp.down_proj.weight"] = ([h, inter], "cols")
    spec["model.norm.weight"] = ([h], "whole")
    spec["lm_head.weight"] = ([vocab, h], "rows")
    return spec


def model_bytes(spec: Spec, dtype: str) -> int:
    item = DTYPES[dtype].itemsize
    return sum(item * torch.Size(shape).numel() for shape, _ in spec.values())


def read_set(spec: Spec, dtype: str, tp_rank: int) -> ReadSet:
    """What worker `tp_rank` of a TP=2 vLLM engine reads: half the rows of column-parallel
    tensors, half the columns of row-parallel ones, norms whole."""
    out = {}
    for name, (shape, kind) in spec.items():
        start, stop = [0] * len(shape), list(shape)
        if kind != "whole":
            d = 0 if kind == "rows" else 1
            start[d], stop[d] = tp_rank * shape[d] // TP, (tp_rank + 1) * shape[d] // TP
        out[name] = Read(dtype, list(shape), [Block(start, stop)])
    return ReadSet(tp_rank, out)


class Count:
    """A loader that counts the tensors it is given and keeps nothing."""

    def __init__(self) -> None:
        self.tensors = 0

    def begin(self) -> None:
        pass

    def load(self, named: list[tuple[str, torch.Tensor]]) -> set[str]:
        self.tensors += len(named)
        return {n for n, _ in named}

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass


def trainer(cfg: dict, spec: Spec, dtype: str, updates: int) -> list[dict]:
    """Joins once, then pushes the state dict `updates` times; what each push moved and took."""
    torch.set_num_threads(1)  # three processes share the cores
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(shape, generator=g).to(DTYPES[dtype])
               for n, (shape, _) in spec.items()}
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    out = []
    try:
        for v in range(1, updates + 1):
            t0 = time.perf_counter()
            r = client.push(tensors, v)
            wall = time.perf_counter() - t0
            out.append({"seconds": r.seconds, "wall_s": wall, "bytes": r.bytes,
                        "buckets": r.buckets, "tensors": r.tensors,
                        "per_receiver": {str(k): b for k, b in r.per_receiver.items()},
                        "acks": {str(a.rank): a.bytes for a in r.acks if a.phase == 1}})
    finally:
        client.close()
    return out


def worker(cfg: dict, spec: Spec, dtype: str, rank: int, updates: int) -> list[dict]:
    """One TP=2 worker: publishes its read set when `cfg` says shard; receives `updates` pushes."""
    torch.set_num_threads(1)
    reads = read_set(spec, dtype, rank - 1) if cfg["shard"] else None
    rx = Receiver(SyncConfig(**cfg), rank, replica=0, tp_rank=rank - 1, tp_size=TP, reads=reads)
    out = []
    try:
        for _ in range(updates):
            loader = Count()
            s = rx.run(loader, timeout_s=cfg["timeout_s"])
            if not s.ok:
                raise RuntimeError(f"rank {rank}: {s.error}")
            out.append({"bytes": s.bytes, "tensors": loader.tensors, "seconds": s.seconds,
                        "steps_ms": s.extra.get("steps_ms", {})})
    finally:
        rx.close()
    return out


def _entry(q: Any, idx: int, fn: Callable, args: tuple) -> None:
    try:
        q.put((idx, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        q.put((idx, False, traceback.format_exc()))


def spawn(calls: list[tuple[Callable, tuple]], deadline_s: float) -> list[Any]:
    """Each `fn(*args)` in a spawned process; their results in order. Raises RuntimeError with
    the remote traceback if one failed, or once `deadline_s` passed (the rest are killed)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(q, i, fn, a), daemon=True)
             for i, (fn, a) in enumerate(calls)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    end = time.monotonic() + deadline_s
    try:
        while len(results) < len(procs):
            try:
                idx, ok, val = q.get(timeout=max(end - time.monotonic(), 0.01))
            except queue.Empty:
                raise RuntimeError(f"processes still running after {deadline_s} s") from None
            if not ok:
                raise RuntimeError(f"process {idx} failed:\n{val}")
            results[idx] = val
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    return [results[i] for i in range(len(procs))]


def run_mode(mode: str, spec: Spec, args: argparse.Namespace) -> dict:
    """One mode: fresh processes and ports, joined once, `warmup` + `pushes` pushes."""
    cfg = msgspec.structs.asdict(SyncConfig.build(
        world_size=1 + len(RANKS), bucket_bytes=int(args.bucket_mib * MiB), timeout_s=60.0,
        shard=mode == "shard"))
    updates = args.warmup + args.pushes
    t0 = time.perf_counter()
    pushes, *workers = spawn([(trainer, (cfg, spec, args.dtype, updates))]
                             + [(worker, (cfg, spec, args.dtype, r, updates)) for r in RANKS],
                             args.deadline)
    return {"mode": mode, "run_s": time.perf_counter() - t0, "pushes": pushes,
            "workers": {str(r): w for r, w in zip(RANKS, workers, strict=True)}}


def check_bytes(run: dict, spec: Spec, dtype: str, warmup: int) -> dict[str, dict]:
    """Per worker: the bytes sent to it, checked against its ack, its receiver's count and, in
    shard mode, its read set (+ under `ALIGN` of padding per slot); raises AssertionError."""
    out: dict[str, dict] = {}
    for r in map(str, RANKS):
        sent = set()
        for p, w in zip(run["pushes"][warmup:], run["workers"][r][warmup:], strict=True):
            got = p["per_receiver"][r] if run["mode"] == "shard" else p["bytes"]
            assert got == p["acks"][r] == w["bytes"], (run["mode"], r, got, p["acks"], w)
            assert w["tensors"] == len(spec), (run["mode"], r, w["tensors"])
            sent.add(got)
        assert len(sent) == 1, (run["mode"], r, sent)  # every push moves the same bytes
        got = sent.pop()
        want = (nbytes(read_set(spec, dtype, int(r) - 1)) if run["mode"] == "shard"
                else model_bytes(spec, dtype))
        slots = len(spec) + run["pushes"][-1]["buckets"]  # a slot per tensor or chunk of one
        assert want <= got < want + ALIGN * slots, (run["mode"], r, got, want)
        out[r] = {"bytes": got, "expected": want, "padding": got - want}
    return out


def summarize(run: dict, spec: Spec, dtype: str, warmup: int) -> dict:
    """Times after the warm-up (min/median/max) and the checked bytes per worker."""
    timed = run["pushes"][warmup:]
    stats = {}
    for key in ("seconds", "wall_s"):
        xs = [p[key] for p in timed]
        stats[key] = {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}
    workers = check_bytes(run, spec, dtype, warmup)
    for r, w in workers.items():  # the receiver's clock: plan answered to commit
        w["seconds_median"] = statistics.median(u["seconds"] for u in run["workers"][r][warmup:])
    return {"mode": run["mode"], **stats, "workers": workers,
            "trainer_bytes_out": sum(w["bytes"] for w in workers.values()),
            "buckets": timed[-1]["buckets"]}


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    """Shard over broadcast, from the same run."""
    s, b = rows["shard"], rows["broadcast"]
    out = {f"seconds_{k}": s["seconds"][k] / b["seconds"][k] for k in ("min", "median", "max")}
    out["wall_median"] = s["wall_s"]["median"] / b["wall_s"]["median"]
    for r in map(str, RANKS):
        out[f"bytes_rank{r}"] = s["workers"][r]["bytes"] / b["workers"][r]["bytes"]
    out["trainer_bytes_out"] = s["trainer_bytes_out"] / b["trainer_bytes_out"]
    return out


def to_markdown(rows: dict[str, dict], meta: dict) -> str:
    """The side-by-side table, and the ratios when both modes ran."""
    title = (f"Model: {meta['model_bytes']} bytes ({meta['model_bytes'] / MiB:.1f} MiB, "
             f"{meta['tensors']} tensors, {meta['layers']} layers, hidden {meta['hidden']}, "
             f"{meta['dtype']}); {meta['bucket_mib']} MiB buckets; {meta['pushes']} pushes "
             f"after {meta['warmup']} warm-up; TP=2, ranks 1 and 2.")
    head = ("| mode | push s min / median / max | wall s median | bytes per worker (rank 1, "
            "rank 2) | expected: read set / model (+ padding) | trainer bytes out | buckets | "
            "worker s median (rank 1, rank 2) |")
    lines = [title, "", head, "|" + " --- |" * 8]
    for m, r in rows.items():
        s, w = r["seconds"], r["workers"]
        per = ", ".join(str(w[k]["bytes"]) for k in map(str, RANKS))
        exp = ", ".join(f"{w[k]['expected']} (+{w[k]['padding']})" for k in map(str, RANKS))
        lines.append(f"| {m} | {s['min']:.3f} / {s['median']:.3f} / {s['max']:.3f} | "
                     f"{r['wall_s']['median']:.3f} | {per} | {exp} | {r['trainer_bytes_out']} | "
                     f"{r['buckets']} | "
                     + ", ".join(f"{w[k]['seconds_median']:.3f}" for k in map(str, RANKS)) + " |")
    if set(MODES) <= set(rows):
        q = ratios(rows)
        lines += ["", "shard / broadcast: push time min {seconds_min:.3f}, median "
                  "{seconds_median:.3f}, max {seconds_max:.3f} (wall median {wall_median:.3f}); "
                  "bytes per worker {bytes_rank1:.4f} (rank 1), {bytes_rank2:.4f} (rank 2); "
                  "trainer bytes out {trainer_bytes_out:.4f}.".format(**q)]
    return "\n".join(lines) + "\n"


def machine() -> dict:
    """What ran it: cores, CPU model, torch, load."""
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                         model)
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "torch": torch.__version__,
            "plane": "CPU only, gloo over loopback", "load_avg": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=256, help="model size, about")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--pushes", type=int, default=5, help="timed pushes per mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed pushes before them")
    p.add_argument("--bucket-mib", type=float, default=64)
    p.add_argument("--modes", default=",".join(MODES), help="run in this order")
    p.add_argument("--deadline", type=float, default=150.0, help="seconds per mode")
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES) or args.pushes < 1:
        p.error(f"--modes: some of {MODES}; --pushes >= 1")
    spec = layout(args.mib, args.layers, args.dtype)
    meta = {"mib": args.mib, "layers": args.layers, "dtype": args.dtype, "pushes": args.pushes,
            "warmup": args.warmup, "bucket_mib": args.bucket_mib, "modes": modes,
            "hidden": spec["model.norm.weight"][0][0], "tensors": len(spec),
            "model_bytes": model_bytes(spec, args.dtype), "machine": machine()}
    runs = [run_mode(m, spec, args) for m in modes]
    rows = {r["mode"]: summarize(r, spec, args.dtype, args.warmup) for r in runs}
    meta["load_avg_end"] = list(os.getloadavg())
    md = to_markdown(rows, meta)
    print(md)
    report = {"meta": meta, "rows": rows, "runs": runs,
              "ratios": ratios(rows) if set(MODES) <= set(rows) else {}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
