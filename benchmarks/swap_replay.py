"""The swap's load alone: a 7B-shaped model's tensors copied into the engine's fused parameters.

A Qwen2-7B-shaped bf16 model (14 layers: 8.71 GB, 171 tensors) is loaded from a shadow arena
into parameters laid out as vLLM's are (q/k/v and gate/up stacked) by a loader that copies each
tensor into its slice, the way vLLM's weight loaders do. Side by side in one run, the median
(min) over `--reps` of: host time to queue and device time of

  replay      `CopyPlan.load` replaying the recorded copies (what the swap runs)
  loader      the loader itself (its Python is far cheaper than vLLM's real loaders)
  copies      the replay's copies, views made ahead: one `copy_` each (what replay issues)
  foreach     the same views in one `torch._foreach_copy_` (what replay issued before)
  floor       one device-to-device copy of the model's bytes
  replay_summed  the replay while a receiver taps the tensors (`taps.Tap`): whole copies
              go through one `copy_summed` launch that also computes their checksums
  sums        the integrity checksum of the 171 tensors as one bucket read where they lie
              (`checksum_parts_gpu`: one kernel launch on CUDA where Triton is installed)
  sums_torch  the same values, summed by torch part by part (a few launches per tensor)

and, as ratios, replay's device time over the floor's and the checksum's over the floor's.
Every parameter is checked bit for bit after the replay, and both checksums must agree. No vLLM
needed.

    python benchmarks/swap_replay.py [--layers 14] [--reps 10]
    python benchmarks/swap_replay.py --device cpu --tiny          # script check
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch

from vllm_nccl_sync.integrations.vllm.copyplan import CopyPlan
from vllm_nccl_sync.wire.integrity import Pending, _terms, checksum_parts_gpu, read_back
from vllm_nccl_sync.wire.taps import Tap, tapping

DIMS = {"hidden": 3584, "inter": 18944, "kv": 512, "vocab": 152064}
TINY = {"hidden": 64, "inter": 128, "kv": 16, "vocab": 256}


def model(layers: int, dims: dict, device: torch.device
          ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, slice, tuple[int, ...]]]]:
    """The engine's parameters (zeros), and per checkpoint tensor: its parameter, the slice it
    fills and its shape."""
    h, i, kv, v = dims["hidden"], dims["inter"], dims["kv"], dims["vocab"]
    params: dict[str, torch.Tensor] = {}
    where: dict[str, tuple[str, slice, tuple[int, ...]]] = {}

    def param(name: str, *shape: int) -> None:
        params[name] = torch.nn.Parameter(
            torch.zeros(*shape, dtype=torch.bfloat16, device=device), requires_grad=False)

    every = slice(None)
    for name, shape in (("embed", (v, h)), ("head", (v, h)), ("norm", (h,))):
        param(name, *shape)
        where[name] = (name, every, shape)
    for n in range(layers):
        p = f"l{n}."
        for name, shape in (("qkv", (h + 2 * kv, h)), ("qkv_b", (h + 2 * kv,)), ("o", (h, h)),
                            ("gu", (2 * i, h)), ("down", (h, i)), ("n1", (h,)), ("n2", (h,))):
            param(p + name, *shape)
        q, k, vv = slice(0, h), slice(h, h + kv), slice(h + kv, h + 2 * kv)
        where.update({
            p + "q": (p + "qkv", q, (h, h)), p + "k": (p + "qkv", k, (kv, h)),
            p + "v": (p + "qkv", vv, (kv, h)), p + "qb": (p + "qkv_b", q, (h,)),
            p + "kb": (p + "qkv_b", k, (kv,)), p + "vb": (p + "qkv_b", vv, (kv,)),
            p + "o": (p + "o", every, (h, h)), p + "gate": (p + "gu", slice(0, i), (i, h)),
            p + "up": (p + "gu", slice(i, 2 * i), (i, h)), p + "down": (p + "down", every, (h, i)),
            p + "n1": (p + "n1", every, (h,)), p + "n2": (p + "n2", every, (h,))})
    return params, where


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> tuple[list, list]:
    """Host ms to queue `fn`, device ms to run it (host ms again on a CPU), per rep."""
    host, dev = [], []
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(device)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            if cuda:
                e0.record()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            if cuda:
                e1.record()
        if cuda:
            torch.cuda.synchronize(device)
        host.append((t1 - t0) * 1e3)
        dev.append(e0.elapsed_time(e1) if cuda else host[-1])
    return host, dev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (script check)")
    args = ap.parse_args()
    device = torch.device(args.device)
    params, where = model(args.layers, TINY if args.tiny else DIMS, device)
    sizes = {n: torch.Size(s).numel() for n, (_, _, s) in where.items()}
    arena = torch.empty(sum(sizes.values()), dtype=torch.bfloat16, device=device)
    batch, at = [], 0
    for name, (_, _, shape) in where.items():
        batch.append((name, arena[at:at + sizes[name]].view(shape)))
        at += sizes[name]
    g = torch.Generator(device=device).manual_seed(0)
    arena.copy_(torch.randn(arena.numel(), generator=g, device=device, dtype=torch.bfloat16))

    def loader(weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        done = set()
        for name, t in weights:
            pname, rows, _ = where[name]
            params[pname][rows].copy_(t)
            done.add(pname)
        return done

    plan = CopyPlan()
    plan.refresh(params)
    plan.load(batch, loader)  # records
    for p in params.values():
        p.zero_()
    plan.load(batch, loader)  # replays
    bad = [n for n, t in batch if not torch.equal(params[where[n][0]][where[n][1]], t)]
    assert plan.replayed == len(batch) and not plan.off, (plan.replayed, plan.off)
    out = torch.empty_like(arena)
    dsts, srcs = [], []
    for e, t in plan.split(batch)[0]:
        for op in e.ops:
            dsts.append(params[op.param].as_strided(op.dst[1], op.dst[2], op.dst[0]))
            srcs.append(t.as_strided(op.src[1], op.src[2], t.storage_offset() + op.src[0]))

    def copies() -> None:
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s)

    parts = [t.reshape(-1).view(torch.uint8) for _, t in batch]

    def sums_torch() -> Pending:
        terms = [(t, f * (2 * i + 1)) for i, p in enumerate(parts) for t, f in _terms(p)]
        return Pending(terms, sum(p.numel() for p in parts))

    def replay_summed() -> Tap:
        tap = Tap()
        for p in parts:
            tap.want(p)
        token = tapping.set(tap)
        try:
            plan.load(batch, loader)
        finally:
            tapping.reset(token)
        return tap

    tap = replay_summed()
    bad += [n for n, t in batch if not torch.equal(params[where[n][0]][where[n][1]], t)]
    agree = (read_back([checksum_parts_gpu(parts)]) == read_back([sums_torch()])
             == read_back([checksum_parts_gpu(parts, [tap.take(p) for p in parts])]))
    rows = {"replay": timed(lambda: plan.load(batch, loader), device, args.reps),
            "loader": timed(lambda: loader(batch), device, args.reps),
            "copies": timed(copies, device, args.reps),
            "foreach": timed(lambda: torch._foreach_copy_(dsts, srcs), device, args.reps),
            "floor": timed(lambda: out.copy_(arena), device, args.reps),
            "replay_summed": timed(replay_summed, device, args.reps),
            "sums": timed(lambda: checksum_parts_gpu(parts), device, args.reps),
            "sums_torch": timed(sums_torch, device, args.reps)}
    print(f"{arena.numel() * 2 / 1e9:.2f} GB, {len(batch)} tensors into {len(params)} parameters"
          f" on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch "
          f"{torch.__version__}; median (min) of {args.reps}, ms; bit-exact: {not bad}; checksums "
          f"agree: {agree}")
    for name, (host, dev) in rows.items():
        print(f"  {name:<13} host {statistics.median(host):7.2f} ({min(host):.2f})   device "
              f"{statistics.median(dev):7.2f} ({min(dev):.2f})")
    floor = statistics.median(rows["floor"][1])
    print(f"  replay device / floor: {statistics.median(rows['replay'][1]) / floor:.2f}")
    for name in ("sums", "replay_summed"):
        print(f"  {name} device / floor: {statistics.median(rows[name][1]) / floor:.2f}")
    if bad or not agree:
        raise SystemExit(f"not bit-exact: {bad[:5]}" if bad else "checksums disagree")


if __name__ == "__main__":
    main()
