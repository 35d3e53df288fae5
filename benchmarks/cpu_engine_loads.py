"""The loads of repeat updates into a real vLLM CPU engine: which tensors went through vLLM's
loader, which were replayed as recorded copies, and the receiver's steps.

A tiny local model (`tiny.make_model`) in one CPU engine; a trainer process pushes `--updates`
state dicts of the same layout (each drawn anew) over `--backend`. Printed per update: the
loader's counters (`replayed`, `through_loader`: tensors that ran through `load_weights`,
`loaded`: linears re-packed) and the receiver's steps (ms); then the medians of the updates
after the first four. Timing only: that such updates are bit-exact is the engine tests' part
(`tests/engine/test_vllm_engine.py`).

    python benchmarks/cpu_engine_loads.py --updates 20 --json loads.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def trainer(cfg: dict, arch: str, updates: int) -> None:
    from vllm_nccl_sync import PushClient, SyncConfig
    from vllm_nccl_sync.tiny import build_model

    client = PushClient(SyncConfig(**cfg))
    client.connect()
    for version in range(2, 2 + updates):
        client.push(build_model(arch, version).state_dict(), version=version)
    client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen2")
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--backend", default="shm", choices=["shm", "gloo"])
    ap.add_argument("--json")
    args = ap.parse_args()

    from vllm import LLM

    from vllm_nccl_sync.tiny import engine_kwargs, make_model
    from vllm_nccl_sync.trainer.sync import free_port

    path = make_model(tempfile.mkdtemp(), args.arch, seed=1)
    llm = LLM(model=path, worker_extension_cls="vllm_nccl_sync.Ext", **engine_kwargs())
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2,
               backend=args.backend, timeout_s=60.0)
    proc = mp.get_context("spawn").Process(target=trainer, args=(cfg, args.arch, args.updates))
    proc.start()
    llm.collective_rpc("nccl_sync_join", timeout=90, args=(cfg, 1))
    rows = []
    for _ in range(args.updates):
        [s] = llm.collective_rpc("nccl_sync_receive", timeout=120, args=(60.0,))
        if not s["ok"]:
            raise SystemExit(f"update failed: {s['error']}")
        row = {"version": s["version"], **{k: s["load"].get(k) for k in
                                           ("replayed", "through_loader", "loaded")},
               "steps_ms": s["steps_ms"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    proc.join(60)
    llm.collective_rpc("nccl_sync_close", timeout=30)
    later = rows[4:] or rows
    medians = {k: round(statistics.median(r["steps_ms"].get(k, 0.0) for r in later), 2)
               for k in later[0]["steps_ms"]}
    print(f"medians of updates 5-{len(rows)}, ms: {medians}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": sys.argv, "updates": rows,
                                               "medians_ms": medians}, indent=1))


if __name__ == "__main__":
    main()
