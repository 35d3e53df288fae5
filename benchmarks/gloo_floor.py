"""The floor of a verify-before-load push over gloo on this machine, beside a raw broadcast.

    python benchmarks/gloo_floor.py --size-mib 256 --chunk-mib 16 --reps 5 --json out.json
    python benchmarks/gloo_floor.py --smoke                                  # script check

Two processes (one torch thread each, as `vllm-nccl-sync bench` runs them) join a gloo group and
time, alternating, on the sender's clock from a handshake to the receiver's confirmation:

  raw            one point-to-point send of the whole payload (the link's ceiling)
  chunked        the same bytes in chunks of `--chunk-mib`, two in flight: what bucketing costs
  chunked+verify the same, and the work any design that checks bytes before loading them must do:
                 the sender checksums each chunk while it flies, the receiver checksums each chunk
                 and copies it into its destination (`integrity.checksum`, one `copy_`)

No control messages, no loaders: nothing of this project's pipeline but its checksum. On a small
machine the transfer itself keeps the cores busy (loopback TCP copies on both sides), so the
verify work adds to it rather than hiding under it; `chunked+verify / raw` bounds what a push with
integrity checking can reach here. `vllm-nccl-sync bench` reports this project's push beside raw.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MiB = 1 << 20
MODES = ("raw", "chunked", "chunked+verify")


def _role(rank: int, port: int, size: int, chunk: int, reps: int, q: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from vllm_nccl_sync.wire.integrity import checksum

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
    tag = 0

    def p2p(t: torch.Tensor):
        nonlocal tag
        tag += 1
        return pg.send([t], 1, tag) if rank == 0 else pg.recv([t], 0, tag)

    payload = torch.empty(size, dtype=torch.uint8)
    if rank == 0:
        payload.random_(0, 256, generator=torch.Generator().manual_seed(7))
    dest = torch.empty(size, dtype=torch.uint8)
    bufs = [torch.empty(chunk, dtype=torch.uint8) for _ in range(2)]
    one = torch.ones(1, dtype=torch.uint8)
    spans = [(o, min(o + chunk, size)) for o in range(0, size, chunk)]

    def chunked(verify: bool) -> None:
        works: list = [None, None]
        if rank == 0:
            for i, (a, b) in enumerate(spans):
                if works[i % 2] is not None:
                    works[i % 2].wait()
                works[i % 2] = p2p(payload[a:b])
                if verify:
                    checksum(payload[a:b])
            for w in works:
                if w is not None:
                    w.wait()
            return
        works[0] = p2p(bufs[0][: spans[0][1] - spans[0][0]])
        for i, (a, b) in enumerate(spans):
            if i + 1 < len(spans):
                n = spans[i + 1][1] - spans[i + 1][0]
                works[(i + 1) % 2] = p2p(bufs[(i + 1) % 2][:n])
            works[i % 2].wait()
            if verify:
                got = bufs[i % 2][: b - a]
                checksum(got)
                dest[a:b].copy_(got)

    run = {"raw": lambda: p2p(payload if rank == 0 else dest).wait(),
           "chunked": lambda: chunked(False), "chunked+verify": lambda: chunked(True)}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(reps + 1):  # the first round warms up
        for mode in MODES:
            p2p(one).wait()
            t0 = time.perf_counter()
            run[mode]()
            p2p(one).wait()  # the receiver is done
            if rep:
                times[mode].append(time.perf_counter() - t0)
    if rank == 1:  # the last round's chunked+verify copied every chunk into `dest`
        q.put({"checksum": checksum(dest)})
    else:
        q.put({"times": times, "checksum": checksum(payload)})


def run(size_mib: float, chunk_mib: float, reps: int, deadline_s: float = 600.0) -> dict:
    """Both roles in spawned processes; the medians, minima and ratios to raw."""
    from vllm_nccl_sync.trainer.sync import free_port

    size, chunk = int(size_mib * MiB), int(chunk_mib * MiB)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_role, args=(r, port, size, chunk, reps, q), daemon=True)
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=deadline_s) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    sender = next(g for g in got if "times" in g)
    receiver = next(g for g in got if "times" not in g)
    med = {m: statistics.median(v) for m, v in sender["times"].items()}
    return {"size_bytes": size, "chunk_bytes": chunk, "reps": reps, "cpus": os.cpu_count(),
            "median_s": med, "min_s": {m: min(v) for m, v in sender["times"].items()},
            "times_s": sender["times"],
            "ratio_to_raw": {m: med["raw"] / med[m] for m in MODES},
            "bytes_equal": receiver["checksum"] == sender["checksum"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=float, default=256.0)
    ap.add_argument("--chunk-mib", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true", help="8 MiB in 1 MiB chunks, 2 reps")
    args = ap.parse_args()
    if args.smoke:
        args.size_mib, args.chunk_mib, args.reps = 8.0, 1.0, 2
    r = run(args.size_mib, args.chunk_mib, args.reps)
    print(f"gloo floor: {r['size_bytes'] / MiB:g} MiB in {r['chunk_bytes'] / MiB:g} MiB chunks, "
          f"{r['cpus']} CPUs, median of {r['reps']}")
    for m in MODES:
        print(f"  {m:15s} {r['median_s'][m] * 1e3:9.2f} ms  {r['ratio_to_raw'][m]:6.3f} of raw")
    print(f"  bytes equal     {'yes' if r['bytes_equal'] else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
