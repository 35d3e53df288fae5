"""The shm plane against gloo on one host, no vLLM: a trainer process pushes a synthetic model to a
receiver process, which copies it into tensors of its own (`ModuleLoader`), in one run:

  memcpy     one host copy of a contiguous buffer of the payload's size (the floor)
  summing_copy  the same copy through `integrity.copies_summed_host` (each 4 KiB row's words
             summed on the way, as a load read in place sums them: native where built)
  raw_gloo   one gloo broadcast of that buffer between the two processes
  push_gloo  `PushClient(backend="gloo")` -> `Receiver` (checksums, commit round: everything)
  push_shm   the same over `backend="shm"`
  push_shm_in_place  the same, the trainer's tensors in shared memory (`share_memory_()`): read
             where they lie, one copy per byte (the receiver's load)

Pushes alternate by repetition (drift hits both); median after a warm-up. Before each repetition,
untimed, the trainer changes every byte of its tensors; the receiver keeps one set of tensors per
plane and checks them bit for bit only after the last push (nothing it does between pushes may
delay the next one: a timed push starts with the receivers' answer to its plan).

    python benchmarks/shm_plane.py --size-mib 256 --bucket-mib 64 --reps 5 [--torch-copy]
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
from vllm_nccl_sync.bench import _Params, join_receivers, synthetic_tensors, write_report  # noqa: E402
from vllm_nccl_sync.trainer.sync import free_port  # noqa: E402

MiB = 1 << 20


def _cfg(backend: str, bucket: int) -> dict:
    return dict(control_port=free_port(), group_port=free_port(), world_size=2, backend=backend,
                bucket_bytes=bucket, timeout_s=120.0)


def _summing_copy(native: bool) -> None:
    """One torch thread; the host's summing copy native (where built) or torch's (`--torch-copy`)."""
    from vllm_nccl_sync.wire import integrity

    torch.set_num_threads(1)
    if not native:
        integrity._copy_many = None
    elif integrity._copy_many is None:
        raise SystemExit("the native summing copy was not built here: pip install -e . with a C "
                         "compiler, or pass --torch-copy")


def trainer(cfgs: dict[str, dict], raw_cfg: dict, size: int, reps: int, native: bool) -> dict:
    """memcpy, the summing copy and raw gloo, then the pushes of every plane, alternating."""
    from vllm_nccl_sync import PushClient, SyncConfig
    from vllm_nccl_sync.planes.registry import open_transport
    from vllm_nccl_sync.verify import digest
    from vllm_nccl_sync.wire.integrity import copy_summed_host

    _summing_copy(native)
    tensors = synthetic_tensors(size, seed=1, device=torch.device("cpu"))
    payload = sum(t.nbytes for t in tensors.values())
    src, dst = torch.empty(payload, dtype=torch.uint8).random_(0, 256), torch.empty(payload,
                                                                                   dtype=torch.uint8)
    out: dict[str, list[float]] = {"memcpy": [], "summing_copy": [], "raw_gloo": []}
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        out["memcpy"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        copy_summed_host(dst, src)
        out["summing_copy"].append(time.perf_counter() - t0)
    raw = open_transport(SyncConfig(**raw_cfg), 0)
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        raw.broadcast(src).wait()
        raw.broadcast(torch.ones(1, dtype=torch.uint8), src=1).wait()  # "all in place"
        out["raw_gloo"].append(time.perf_counter() - t0)
    raw.close()
    clients = {}
    shared = {n: t.clone().share_memory_() for n, t in tensors.items()}
    sent = {name: shared if name.endswith("in_place") else tensors for name in cfgs}
    for name, cfg in cfgs.items():
        clients[name] = PushClient(SyncConfig(**cfg))
        clients[name].connect()
        out[f"push_{name}"] = []
    for rep in range(reps + 1):
        for t in (*tensors.values(), *shared.values()):  # every byte changes: the last push
            t.view(torch.uint8).add_(1)  # must write them all
        for name, client in clients.items():
            t0 = time.perf_counter()
            client.push(sent[name], version=rep + 1)
            out[f"push_{name}"].append(time.perf_counter() - t0)
    for client in clients.values():
        client.close()
    return {"times": {k: v[1:] for k, v in out.items()}, "payload": payload,
            "digests": {n: digest(t) for n, t in tensors.items()}}


def receiver(cfgs: dict[str, dict], raw_cfg: dict, size: int, reps: int, native: bool) -> dict:
    """Joins every group; receives each push into tensors of its own."""
    from vllm_nccl_sync import SyncConfig
    from vllm_nccl_sync.engine.loaders import ModuleLoader
    from vllm_nccl_sync.planes.registry import open_transport
    from vllm_nccl_sync.verify import digest

    _summing_copy(native)
    model = synthetic_tensors(size, seed=1, device=torch.device("cpu"))
    payload = sum(t.nbytes for t in model.values())
    tensors = {name: {n: torch.zeros_like(t) for n, t in model.items()} for name in cfgs}
    buf = torch.empty(payload + 8, dtype=torch.uint8)
    raw = open_transport(SyncConfig(**raw_cfg), 1)
    for _ in range(reps + 1):
        raw.broadcast(buf, length=payload).wait()
        raw.broadcast(torch.ones(1, dtype=torch.uint8), src=1).wait()
    raw.close()
    rxs = join_receivers(cfgs)
    steps: dict[str, list[dict[str, float]]] = {name: [] for name in cfgs}
    for rep in range(reps + 1):
        for name in cfgs:
            s = rxs[name].receive(ModuleLoader(_Params(tensors[name])), timeout_s=300)
            if not s["ok"]:
                raise RuntimeError(f"{name}: {s['error']}")
            if rep:  # after the warm-up
                steps[name].append(s["steps_ms"])
    for rx in rxs.values():
        rx.close()
    return {"digests": {name: {n: digest(t) for n, t in ts.items()}
                        for name, ts in tensors.items()},
            "steps_ms": {name: {k: round(statistics.median(u.get(k, 0.0) for u in ups), 2)
                                for k in ups[0]} for name, ups in steps.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=float, default=256)
    ap.add_argument("--bucket-mib", type=float, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--torch-copy", action="store_true",
                    help="the host's summing copy by torch, chunk by chunk, not the native one")
    args = ap.parse_args()
    size, bucket = int(args.size_mib * MiB), int(args.bucket_mib * MiB) // 256 * 256
    cfgs = {name: _cfg(name.split("_")[0], bucket) for name in ("gloo", "shm", "shm_in_place")}
    raw_cfg = _cfg("gloo", bucket)
    tr, rx = run_procs([(trainer, (cfgs, raw_cfg, size, args.reps, not args.torch_copy)),
                        (receiver, (cfgs, raw_cfg, size, args.reps, not args.torch_copy))], 1800)
    med = {k: statistics.median(v) for k, v in tr["times"].items()}
    report = {"payload_bytes": tr["payload"], "bucket_bytes": bucket, "reps": args.reps,
              "summing_copy": "torch" if args.torch_copy else "native",
              "median_s": med, "times_s": tr["times"],
              "gbps": {k: tr["payload"] / v / 1e9 for k, v in med.items()},
              "of_raw_gloo": {k: med["raw_gloo"] / v for k, v in med.items()},
              "of_memcpy": {k: med["memcpy"] / v for k, v in med.items()},
              "x_memcpy": {k: v / med["memcpy"] for k, v in med.items()},
              "bit_exact": {n: d == tr["digests"] for n, d in rx["digests"].items()},
              "receiver_steps_ms": rx["steps_ms"]}
    for k in med:
        print(f"{k:17s} {med[k] * 1e3:9.1f} ms  {report['gbps'][k]:6.2f} GB/s  "
              f"{report['of_raw_gloo'][k]:5.2f} of raw gloo  {report['x_memcpy'][k]:5.2f}x memcpy's time")
    print("bit-exact:", report["bit_exact"])
    for name, steps in rx["steps_ms"].items():
        print(f"receiver steps, {name} (median ms):", steps)
    write_report(report, args.json, all(report["bit_exact"].values()))


if __name__ == "__main__":
    main()
