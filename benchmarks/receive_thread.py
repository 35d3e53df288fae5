"""Does a receive running in a thread of the engine's process hold up the engine's own thread
more than the same receive in a process of its own? Side by side, round after round.

A stand-in for the engine's launch-bound step (a prefill outside the CUDA graphs): the main
thread of one process runs steps of 300 tiny torch ops, each op letting go of Python's lock as
vLLM's kernel launches do, and records every step's wall time and CPU time. A trainer process
pushes 6 updates of 64 MiB (16 float32 tensors, 16 MiB buckets) over gloo to a receiver that
copies them into tensors of its own (`ModuleLoader`): in a thread of the stepping process
(`thread`, as `receive beside` runs in vLLM's worker), or in a process of its own (`process`).
Timed only from the receiver's join to its last update. A step's wall time over its CPU time is
time the thread was ready but did not run: waiting for Python's lock or for a core. Every
process runs one torch thread.

    python benchmarks/receive_thread.py --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from tests.procs import run_procs  # noqa: E402
from vllm_nccl_sync.bench import _Params, join_receivers, write_report  # noqa: E402
from vllm_nccl_sync.engine.loaders import ModuleLoader  # noqa: E402
from vllm_nccl_sync.trainer.sync import free_port  # noqa: E402

TENSORS, UPDATES, OPS = 16, 6, 300


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(TENSORS)}


def trainer(cfg: dict) -> bool:
    from vllm_nccl_sync import PushClient, SyncConfig

    torch.set_num_threads(1)
    named = _state(1)
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    for v in range(UPDATES):
        client.push(named, version=v + 1)
    client.close()
    return True


def receiver(cfg: dict, go: Any, joined: Any, done: Any) -> bool:
    """Join once `go` is set, say so (`joined`), receive every update, then set `done`."""
    torch.set_num_threads(1)
    mine = {n: torch.zeros_like(t) for n, t in _state(0).items()}
    go.wait(60)
    rx = join_receivers({"x": cfg})["x"]
    joined.set()
    exact = True
    for _ in range(UPDATES):
        s = rx.receive(ModuleLoader(_Params(mine)), timeout_s=120)
        exact = exact and s["ok"]
    rx.close()
    exact = exact and all(torch.equal(mine[n], t) for n, t in _state(1).items())
    done.set()
    return exact


def _steps(until: Any) -> list[tuple[float, float]]:
    """Steps of `OPS` tiny ops, at least one, until `until()`: (wall s, CPU s) each."""
    x = torch.zeros(64)
    out: list[tuple[float, float]] = []
    while not out or not until():
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(OPS):
            x.add_(1.0)
        out.append((time.perf_counter() - t0, time.thread_time() - c0))
    return out


def stepper(cfg: dict, mode: str, go: Any, joined: Any, done: Any) -> dict:
    """Steps while the update is received: in a thread here (`thread`), or elsewhere."""
    torch.set_num_threads(1)
    exact, result, th = None, [], None
    if mode == "thread":
        th = threading.Thread(target=lambda: result.append(receiver(cfg, go, joined, done)),
                              daemon=True)
        th.start()
    go.set()
    joined.wait(60)
    steps = _steps(lambda: done.is_set() or (th is not None and not th.is_alive()))
    if th is not None:
        th.join(60)
        exact = bool(result and result[0])
    waits = sorted(max(w - c, 0.0) * 1e3 for w, c in steps)
    return {"steps": len(steps), "wait_ms": sum(waits), "p99_ms": waits[int(0.99 * len(waits))],
            "max_ms": waits[-1], "step_ms": sorted(w * 1e3 for w, _ in steps)[len(steps) // 2],
            "exact": exact}


def one(mode: str) -> dict:
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2, backend="gloo",
               bucket_bytes=16 << 20, timeout_s=120.0)
    ctx = mp.get_context("spawn")
    go, joined, done = ctx.Event(), ctx.Event(), ctx.Event()
    calls: list = [(trainer, (cfg,)), (stepper, (cfg, mode, go, joined, done))]
    if mode == "process":
        calls.append((receiver, (cfg, go, joined, done)))
    got = run_procs(calls, 300)
    r = got[1]
    if mode == "process":
        r["exact"] = got[2]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rounds = []
    for k in range(args.rounds):
        r = {mode: one(mode) for mode in ("thread", "process")}
        rounds.append(r)
        for mode, x in r.items():
            print(f"round {k + 1} {mode:7s}: {x['steps']:4d} steps (median {x['step_ms']:.2f} ms), "
                  f"waited {x['wait_ms']:6.1f} ms in all, p99 {x['p99_ms']:.2f} ms, "
                  f"longest {x['max_ms']:.2f} ms; bit-exact {x['exact']}")
        print(f"round {k + 1} thread / process: waited "
              f"{r['thread']['wait_ms'] / max(r['process']['wait_ms'], 1e-3):.2f}x, longest "
              f"{r['thread']['max_ms'] / max(r['process']['max_ms'], 1e-3):.2f}x")
    exact = all(x["exact"] for r in rounds for x in r.values())
    write_report({"ops_per_step": OPS, "updates": UPDATES, "bytes": TENSORS << 22,
                  "rounds": rounds}, args.json, exact)


if __name__ == "__main__":
    main()
