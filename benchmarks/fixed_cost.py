"""The fixed cost of an update: a push of 171 tiny tensors (a Qwen2-7B-shaped state dict, 14
layers, bf16, every tensor at most a few KB: 349 KB), repeated with the same layout, from a trainer
process to a receiver process that copies them into tensors of its own (`ModuleLoader`), over
`shm` (packed, and read where it lies in shared memory) and over gloo, alternating. The bytes cost nothing here: what is left is the host time of
the plan, its checks, the rounds and the per-tensor loads, on both sides.

Per plane it prints the median over the pushes after a warm-up of: the trainer's push (wall),
the receiver's update from its answer to the plan to the commit (`WorkerSummary.seconds`; after
the first push each update opens with a `Repeat` of the first one's layout: `plans`), and
the receiver's steps (`steps_ms`: from the plan's answer to the `Go`, the buckets' arrival and
loads, the `Seal` and its check, the commit round).

    python benchmarks/fixed_cost.py --reps 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from tests.procs import run_procs  # noqa: E402
from vllm_nccl_sync.bench import _Params, join_receivers, write_report  # noqa: E402
from vllm_nccl_sync.trainer.sync import free_port  # noqa: E402

PLANES = {"shm": "shm", "gloo": "gloo", "shm_in_place": "shm"}
"""Per mode, its plane; `shm_in_place`: the trainer's tensors in shared memory, read where they
lie (no bucket is packed)."""


def tiny_qwen2(seed: int) -> dict[str, torch.Tensor]:
    """171 tensors named and shaped like Qwen2-7B's, each dimension divided down to a few."""
    g = torch.Generator().manual_seed(seed)
    h, kv, inter, vocab = 32, 8, 96, 128
    out = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(14):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    out |= {"model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in out.items()}


def _cfg(mode: str) -> dict:
    return dict(control_port=free_port(), group_port=free_port(), world_size=2, backend=PLANES[mode],
                bucket_bytes=4 << 20, timeout_s=120.0)


def trainer(cfgs: dict[str, dict], reps: int) -> dict:
    from vllm_nccl_sync import PushClient, SyncConfig

    torch.set_num_threads(1)
    named = tiny_qwen2(1)
    shared = {n: t.clone().share_memory_() for n, t in named.items()}
    clients = {}
    for name, cfg in cfgs.items():
        clients[name] = PushClient(SyncConfig(**cfg))
        clients[name].connect()
    times: dict[str, list[float]] = {name: [] for name in cfgs}
    for rep in range(reps + 1):
        for name, client in clients.items():
            t0 = time.perf_counter()
            client.push(shared if name == "shm_in_place" else named, version=rep + 1)
            times[name].append(time.perf_counter() - t0)
    for client in clients.values():
        client.close()
    return {"push_s": {k: v[1:] for k, v in times.items()}}


def receiver(cfgs: dict[str, dict], reps: int) -> dict:
    from vllm_nccl_sync.engine.loaders import ModuleLoader

    torch.set_num_threads(1)
    mine = {name: {n: torch.zeros_like(t) for n, t in tiny_qwen2(0).items()} for name in cfgs}
    rxs = join_receivers(cfgs)
    out: dict[str, list[dict]] = {name: [] for name in cfgs}
    for _ in range(reps + 1):
        for name in cfgs:
            s = rxs[name].receive(ModuleLoader(_Params(mine[name])), timeout_s=300)
            if not s["ok"]:
                raise RuntimeError(f"{name}: {s['error']}")
            out[name].append({"seconds": s["seconds"], "steps_ms": s["steps_ms"],
                              "plan": s.get("plan", "")})
    for rx in rxs.values():
        rx.close()
    sent = tiny_qwen2(1)
    exact = {name: all(torch.equal(ts[n], sent[n]) for n in sent) for name, ts in mine.items()}
    return {"updates": {k: v[1:] for k, v in out.items()}, "bit_exact": exact}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    cfgs = {name: _cfg(name) for name in PLANES}
    tr, rx = run_procs([(trainer, (cfgs, args.reps)), (receiver, (cfgs, args.reps))], 1800)
    report: dict = {"tensors": len(tiny_qwen2(0)),
                    "bytes": sum(t.nbytes for t in tiny_qwen2(0).values()), "reps": args.reps,
                    "bit_exact": rx["bit_exact"], "planes": {}}
    for name in cfgs:
        ups = rx["updates"][name]
        steps = {k: statistics.median(u["steps_ms"].get(k, 0.0) for u in ups)
                 for k in ups[0]["steps_ms"]}
        report["planes"][name] = {
            "plans": sorted({u["plan"] for u in ups}),
            "push_ms": statistics.median(tr["push_s"][name]) * 1e3,
            "receiver_ms": statistics.median(u["seconds"] for u in ups) * 1e3,
            "steps_ms": steps}
        r = report["planes"][name]
        shown = ", ".join(f"{k} {v:.2f}" for k, v in steps.items())
        print(f"{name:12s} push {r['push_ms']:6.2f} ms  receiver {r['receiver_ms']:6.2f} ms  "
              f"plans {'/'.join(r['plans'])}  steps (ms, median): {shown}")
    print(f"{report['tensors']} tensors, {report['bytes']} bytes; bit-exact: {report['bit_exact']}")
    write_report(report, args.json, all(report["bit_exact"].values()))


if __name__ == "__main__":
    main()
