"""Per-link costs of the host path (gloo over TCP), the inputs of the cost model in docs/scaling.md.

Measures, with plain gloo point-to-point transfers between processes (no project code on the
data path, so the numbers describe the link, not the protocol):

* `pair`: one sender -> one receiver: bandwidth per message size, and the one-way latency of a
  64-byte message (half a round trip).
* `fanout2`: one sender -> two receivers at once (what the gloo data plane does per bucket): the
  sender's link is shared, so each receiver gets about half.
* `two_senders`: two sender -> receiver pairs at once (the multi-sender layout): aggregate.

`--where loopback` runs every process in this network namespace over 127.0.0.1. `--where veth`
(root and iproute2) makes two namespaces joined by a veth pair, each standing for a host; in
`pair` and `fanout2` the sender is in one and the receivers in the other; in `two_senders` each
namespace holds one sender and the other pair's receiver, so both directions of the link carry
one stream. Each process runs under a deadline; namespaces are deleted in a `finally`.

    python benchmarks/link_costs.py --where loopback,veth --sizes-mib 1,16,64 --reps 5 \
        --json benchmarks/results/link_costs_cpu.json --md benchmarks/results/link_costs_cpu.md

Every time is the median of `--reps` after one warm-up; a transfer is timed from a barrier to the
receiver's 1-byte acknowledgement, so it ends only once the receiver holds every byte.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta

LAT_BYTES = 64
LAT_ITERS = 200

# Per scenario: each process is (namespace index, role, peers); a sender's peers are its receivers.
SCENARIOS: dict[str, list[tuple[int, str, list[int]]]] = {
    "pair": [(0, "send", [1]), (1, "recv", [0])],
    "fanout2": [(0, "send", [1, 2]), (1, "recv", [0]), (1, "recv", [0])],
    "two_senders": [(0, "send", [1]), (1, "recv", [0]), (1, "send", [3]), (0, "recv", [2])],
}


def _local_address(peer: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


def worker(a: dict) -> dict:
    """One process of a scenario: join the gloo group, run the transfers, return timings."""
    import torch
    import torch.distributed as dist

    rank, world, host, port = a["rank"], a["world"], a["host"], a["port"]
    timeout = timedelta(seconds=a["timeout_s"])
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    me = host if rank == 0 else _local_address(host)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=me)]
    pg = dist.ProcessGroupGloo(dist.PrefixStore("links", store), rank, world, opts)
    role, peers = a["role"], a["peers"]
    one = torch.zeros(1, dtype=torch.uint8)

    def barrier() -> None:
        pg.barrier().wait()

    out: dict = {"rank": rank, "role": role, "addr": me, "sizes": {}}
    # Latency: 64 B there and back, each pair in turn (others wait at the barrier).
    small = torch.zeros(LAT_BYTES, dtype=torch.uint8)
    for r in range(world):
        barrier()
        sender, sender_peers = r, a["layout"][r][2]
        if a["layout"][r][1] != "send":
            continue
        dst = sender_peers[0]
        if rank not in (sender, dst):
            continue
        rtts = []
        for _ in range(LAT_ITERS):
            t = time.perf_counter()
            if rank == sender:
                pg.send([small], dst, 0).wait()
                pg.recv([small], dst, 1).wait()
            else:
                pg.recv([small], sender, 0).wait()
                pg.send([small], sender, 1).wait()
            rtts.append(time.perf_counter() - t)
        if rank == sender:
            out["latency_s"] = statistics.median(rtts) / 2
    for mib in a["sizes_mib"]:
        buf = torch.ones(mib << 20, dtype=torch.uint8)
        times = []
        for rep in range(a["reps"] + 1):
            barrier()
            t = time.perf_counter()
            if role == "send":
                works = [pg.send([buf], p, 2) for p in peers]
                for w in works:
                    w.wait()
                for p in peers:
                    pg.recv([one], p, 3).wait()
            else:
                pg.recv([buf], peers[0], 2).wait()
                pg.send([one], peers[0], 3).wait()
            if rep:  # the first is a warm-up
                times.append(time.perf_counter() - t)
        if role == "send":
            s = statistics.median(times)
            out["sizes"][str(mib)] = {"seconds": s, "bytes_out": (mib << 20) * len(peers),
                                      "gbps_out": (mib << 20) * len(peers) / s / 1e9}
        del buf
    barrier()
    return out


# ---------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


class Veth:
    """Two namespaces joined by one veth pair (10.79.0.1 and 10.79.0.2), removed on exit."""

    def __enter__(self) -> Veth:
        tag = secrets.token_hex(3)
        self.ns = [f"lnk-{tag}-a", f"lnk-{tag}-b"]
        self.addr = ["10.79.0.1", "10.79.0.2"]
        self.made: list[str] = []
        dev = [f"lnk{tag}a", f"lnk{tag}b"]
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
                self.made.append(ns)
            _ip("link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
            for ns, d, ip in zip(self.ns, dev, self.addr, strict=True):
                _ip("link", "set", d, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", d)
                _ip("-n", ns, "link", "set", d, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.made:
            _ip("netns", "del", ns, check=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_scenario(name: str, where: str, args: argparse.Namespace, veth: Veth | None) -> dict:
    layout = SCENARIOS[name]
    ns = veth.ns if veth else [None, None]
    addr = veth.addr if veth else ["127.0.0.1", "127.0.0.1"]
    host, port = addr[layout[0][0]], _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    for rank, (side, role, peers) in enumerate(layout):
        spec = {"rank": rank, "world": len(layout), "host": host, "port": port, "role": role,
                "peers": peers, "layout": layout, "sizes_mib": args.sizes_mib, "reps": args.reps,
                "timeout_s": args.deadline}
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
        if ns[side]:
            cmd = ["ip", "netns", "exec", ns[side], *cmd]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True,
                                      start_new_session=True))
    end = time.monotonic() + args.deadline
    try:
        outs = [p.communicate(timeout=max(end - time.monotonic(), 1))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(timeout=10)
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"{name} on {where}: processes {bad} failed")
    results = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    senders = [r for r in results if r["role"] == "send"]
    row: dict = {"scenario": name, "where": where, "senders": len(senders),
                 "latency_us": [round(s["latency_s"] * 1e6, 1) for s in senders], "sizes": {}}
    for mib in map(str, args.sizes_mib):
        per = [s["sizes"][mib] for s in senders]
        row["sizes"][mib] = {
            "per_sender_gbps": [round(x["gbps_out"], 3) for x in per],
            "aggregate_gbps": round(sum(x["bytes_out"] for x in per)
                                    / max(x["seconds"] for x in per) / 1e9, 3),
        }
    return row


def to_markdown(rows: list[dict], sizes: list[int]) -> str:
    head = " | ".join(f"{m} MiB: per sender / aggregate GB/s" for m in sizes)
    lines = [f"| where | scenario | senders | 64 B one-way latency (us) | {head} |",
             "|" + " --- |" * (4 + len(sizes))]
    for r in rows:
        cells = [" + ".join(f"{g:.2f}" for g in r["sizes"][str(m)]["per_sender_gbps"])
                 + f" / {r['sizes'][str(m)]['aggregate_gbps']:.2f}" for m in sizes]
        lines.append(f"| {r['where']} | {r['scenario']} | {r['senders']} | "
                     f"{', '.join(map(str, r['latency_us']))} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--where", default="loopback", help="loopback, veth, or both (comma-separated)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--sizes-mib", default="1,16,64",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--deadline", type=float, default=300.0, help="seconds per scenario")
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    rows = []
    for where in args.where.split(","):
        if where == "veth":
            with Veth() as veth:
                rows += [run_scenario(s, where, args, veth) for s in args.scenarios.split(",")]
        elif where == "loopback":
            rows += [run_scenario(s, where, args, None) for s in args.scenarios.split(",")]
        else:
            p.error(f"unknown --where {where!r}: loopback or veth")
    md = to_markdown(rows, args.sizes_mib)
    print(md)
    meta = {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "sizes_mib": args.sizes_mib,
            "reps": args.reps}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
