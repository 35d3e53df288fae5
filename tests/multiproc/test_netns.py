"""Across hosts on one machine: the trainer and a receiver in two network namespaces.

Two namespaces joined by a veth pair stand for two hosts: the trainer runs in `a` (10.77.0.1/24)
under `ip netns exec`, a receiver in `b` (10.77.0.2/24). Neither can use loopback to reach the
other, so the ZeroMQ control plane, the TCPStore rendezvous and the gloo group must all work with
real interface addresses (the receiver's gloo device binds the address of `b` that routes to the
trainer, not the trainer's address), and every wait must be bounded.

Checks: every tensor arrives bit-identical (digests), the bytes broadcast equal the payload, a
receiver pointed at an address where no trainer listens (or no host exists) fails with an error
naming that address within its timeout, a trainer nobody joins does too, and when the receiver's
link goes down mid-update (a second veth pair, 10.78.0.0/24) both ends fail within about their
timeout. The throughput of a ~128 MB push over the link is printed next to a raw gloo broadcast of
the same bytes over the same group in the same run.

Needs root and iproute2 (`ip netns`); skips with the reason otherwise. Namespaces have unique
names per run and are deleted in a `finally`, failure or not; each process has a hard deadline.

This file is also the program both processes run: `python tests/multiproc/test_netns.py ROLE ARGS OUT`.
Knobs for measurements (not needed for the test): NETNS_PAYLOAD_MB (128), NETNS_BUCKET_MB (32),
NETNS_REPS (3), NETNS_CFG (JSON of further SyncConfig fields, e.g. '{"bucket_checksums": false}').
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.procs import record_broadcasts  # noqa: E402

pytestmark = pytest.mark.multiproc

TRAINER_IP, RECEIVER_IP, NOBODY_IP = "10.77.0.1", "10.77.0.2", "10.77.0.3"
CUT_TRAINER_IP, CUT_RECEIVER_IP = "10.78.0.1", "10.78.0.2"  # a second link, cut mid-update
PAYLOAD_MB = int(os.environ.get("NETNS_PAYLOAD_MB", "128"))
BUCKET_MB = int(os.environ.get("NETNS_BUCKET_MB", "32"))
REPS = int(os.environ.get("NETNS_REPS", "3"))
EXTRA_CFG = json.loads(os.environ.get("NETNS_CFG", "{}"))  # more SyncConfig fields, for measuring
DEADLINE_S = 50.0  # hard bound on each process of a test
NEG_TIMEOUT_S = 4.0  # SyncConfig.timeout_s of the negative cases
NEG_SLACK_S = 2.5  # how much later than its timeout a failure may be reported


# ----------------------------------------------------------------------------------------------
# The model: ~PAYLOAD_MB of mixed dtypes, every tensor a multiple of 64 bytes (so the wire carries
# exactly the payload, no alignment padding), one tensor cut across buckets, an empty one.
# ----------------------------------------------------------------------------------------------


def model_spec(payload_mb: int = PAYLOAD_MB) -> list[tuple[str, str, list[int]]]:
    spec = [
        ("meta.ids", "int32", [16]),
        ("embed.weight", "bfloat16", [24576, 1024]),  # 48 MiB: cut over buckets below that
        ("head.weight", "float8_e4m3fn", [16384, 1024]),  # 16 MiB
        ("head.empty", "float32", [0, 4]),
    ]
    for i in range(max(1, (payload_mb - 64) // 16)):  # 16 MiB (+4 KiB +128 B) per layer
        spec += [
            (f"layers.{i}.qkv.weight", "float16", [3072, 1024]),
            (f"layers.{i}.o.weight", "bfloat16", [1024, 1024]),
            (f"layers.{i}.mlp.weight", "float32", [2048, 1024]),
            (f"layers.{i}.norm.weight", "float32", [1024]),
            (f"layers.{i}.steps", "int64", [8]),
            (f"layers.{i}.mask", "bool", [64]),
        ]
    return spec


def model_tensors(seed: int, payload_mb: int = PAYLOAD_MB):
    """Deterministic, position-dependent bytes (any misplaced or stale word changes a digest)."""
    import torch

    from vllm_nccl_sync.wire.packing import DTYPES

    out = {}
    base = seed << 40
    for name, dtype, shape in model_spec(payload_mb):
        dt = DTYPES[dtype]
        nbytes = dt.itemsize * (0 if 0 in shape else _prod(shape))
        words = torch.arange(base, base + (nbytes + 7) // 8, dtype=torch.int64)
        base += words.numel() + 1
        raw = (words * -7046029254386353131 + seed).view(torch.uint8)[:nbytes]  # wraps: a hash
        if dt == torch.bool:
            raw = raw & 1
        out[name] = raw.view(dt).reshape(shape)
    return out


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def digest(t) -> str:
    import torch

    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


class DigestLoader:
    def __init__(self):
        self.digests: dict[str, str] = {}

    def begin(self):
        pass

    def load(self, named):
        for n, t in named:
            self.digests[n] = digest(t)
        return {n for n, _ in named}

    def finish(self):
        pass

    def abort(self):
        pass


class CopyLoader(DigestLoader):
    """Copies into preallocated tensors, like a model's parameters."""

    def __init__(self, dest):
        self.dest = dest

    def load(self, named):
        for n, t in named:
            self.dest[n].copy_(t)
        return {n for n, _ in named}


# ----------------------------------------------------------------------------------------------
# The processes (run as `ip netns exec NS python tests/multiproc/test_netns.py ROLE ARGS OUT`).
# ----------------------------------------------------------------------------------------------


def role_trainer(a: dict) -> dict:
    import torch

    from vllm_nccl_sync import PushClient, SyncConfig

    sizes = record_broadcasts()
    client = PushClient(SyncConfig(**a["cfg"]))
    t = time.perf_counter()
    client.connect()
    connect_s = time.perf_counter() - t
    tensors = model_tensors(1, a["payload_mb"])
    payload = sum(x.numel() * x.element_size() for x in tensors.values())
    r = client.push(tensors, version=1)
    first = {"bytes": r.bytes, "buckets": r.buckets, "tensors": r.tensors, "seconds": r.seconds,
             "wire": list(sizes), "acks": [x.rank for x in r.acks]}
    tr = client.transport
    one = torch.zeros(1, dtype=torch.uint8)
    raw_buf = torch.ones(payload, dtype=torch.uint8)

    def sync():  # the receiver says it is ready: times start when both sides are
        tr.broadcast(one, src=1).wait()

    pushes, raws, wires = [], [], []
    for i in range(a["reps"]):
        sync()
        mark = len(sizes)
        r = client.push(tensors, version=2 + i)
        pushes.append(r.seconds)  # first header sent -> every Ack received
        wires.append(sum(sizes[mark:]))
        sync()
        t = time.perf_counter()
        tr.broadcast(raw_buf).wait()
        tr.broadcast(one, src=1).wait()  # ... until the receiver has all of it
        raws.append(time.perf_counter() - t)
    client.close()
    return {"first": first, "payload": payload, "connect_s": connect_s, "push_s": pushes,
            "raw_s": raws, "wire_per_push": wires}


def role_receiver(a: dict) -> dict:
    import torch

    from vllm_nccl_sync import SyncConfig
    from vllm_nccl_sync.engine.receiver import Receiver
    from vllm_nccl_sync.wire.packing import DTYPES

    sizes = record_broadcasts()
    rx = Receiver(SyncConfig(**a["cfg"]), 1)
    first = DigestLoader()
    s1 = rx.receive(first, timeout_s=a["cfg"]["timeout_s"])
    wire1 = list(sizes)
    dest = {n: torch.empty(shape, dtype=DTYPES[d]) for n, d, shape in model_spec(a["payload_mb"])}
    one = torch.zeros(1, dtype=torch.uint8)
    raw_buf = torch.zeros(sum(t.numel() * t.element_size() for t in dest.values()),
                          dtype=torch.uint8)  # touched now, not in the first timed broadcast
    tr = rx.transport
    summaries = []
    for _ in range(a["reps"]):
        for t in dest.values():
            t.zero_()
        tr.broadcast(one, src=1).wait()
        summaries.append(rx.receive(CopyLoader(dest), timeout_s=a["cfg"]["timeout_s"]))
        tr.broadcast(one, src=1).wait()
        tr.broadcast(raw_buf).wait()
        tr.broadcast(one, src=1).wait()
    digests = {n: digest(t) for n, t in dest.items()}  # the last update, in the "model"
    rx.close()
    return {"first_summary": s1, "first_digests": first.digests, "wire": wire1,
            "summaries": summaries, "last_digests": digests}


def role_lonely_receiver(a: dict) -> dict:
    """A receiver whose trainer is not there: must fail, naming the address, within its timeout."""
    from vllm_nccl_sync import SyncConfig
    from vllm_nccl_sync.engine.receiver import Receiver

    cfg = SyncConfig(**a["cfg"])
    t = time.monotonic()
    try:
        Receiver(cfg, 1)
    except Exception as e:  # noqa: BLE001  (reported to the test)
        return {"error": f"{type(e).__name__}: {e}", "elapsed": time.monotonic() - t}
    return {"error": None, "elapsed": time.monotonic() - t}


def role_lonely_trainer(a: dict) -> dict:
    """A trainer nobody joins: `connect()` must fail within its timeout."""
    from vllm_nccl_sync import PushClient, SyncConfig

    client = PushClient(SyncConfig(**a["cfg"]))
    t = time.monotonic()
    try:
        client.connect()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "elapsed": time.monotonic() - t}
    finally:
        client.close()
    return {"error": None, "elapsed": time.monotonic() - t}


def _small_model() -> dict:
    import torch

    return {f"w{i}": torch.full((1 << 20,), i, dtype=torch.float32) for i in range(6)}  # 24 MiB


def role_cut_trainer(a: dict) -> dict:
    """Pushes while the receiver pulls its cable: `push` must fail, within about its timeout."""
    from vllm_nccl_sync import PushClient, SyncConfig

    client = PushClient(SyncConfig(**a["cfg"]))
    client.connect()
    t = time.monotonic()
    try:
        client.push(_small_model(), version=1)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "elapsed": time.monotonic() - t}
    finally:
        client.close()
    return {"error": None, "elapsed": time.monotonic() - t}


def role_cut_receiver(a: dict) -> dict:
    """Takes its own link down once the first bucket has arrived."""
    from vllm_nccl_sync import SyncConfig
    from vllm_nccl_sync.engine.receiver import Receiver

    rx = Receiver(SyncConfig(**a["cfg"]), 1)
    cut: list[float] = []

    class Cutter(DigestLoader):
        def load(self, named):
            if not cut:
                subprocess.run(["ip", "link", "set", "dev", a["dev"], "down"], check=True)
                cut.append(time.monotonic())
            return {n for n, _ in named}

    summary = rx.receive(Cutter(), timeout_s=a["cfg"]["timeout_s"] * 3)
    elapsed = time.monotonic() - cut[0] if cut else None
    rx.close()
    return {"summary": summary, "elapsed": elapsed}


def role_ms_sender(a: dict) -> dict:
    """One of several senders: offers every tensor, the coordinator balances them."""
    from vllm_nccl_sync import PushClient, SyncConfig

    sizes = record_broadcasts()
    client = PushClient(SyncConfig(**a["cfg"]), rank=a["rank"])
    client.connect()
    r = client.push(_small_model(), version=1, balance=True)
    client.close()
    return {"bytes": r.bytes, "per_sender": r.per_sender, "wire": sum(sizes),
            "acks": [x.rank for x in r.acks]}


def role_ms_receiver(a: dict) -> dict:
    from vllm_nccl_sync import SyncConfig
    from vllm_nccl_sync.engine.receiver import Receiver

    rx = Receiver(SyncConfig(**a["cfg"]), a["rank"])
    loader = DigestLoader()
    summary = rx.receive(loader, timeout_s=a["cfg"]["timeout_s"])
    rx.close()
    return {"summary": summary, "digests": loader.digests}


ROLES = {f.__name__.removeprefix("role_"): f
         for f in (role_trainer, role_receiver, role_lonely_receiver, role_lonely_trainer,
                   role_cut_trainer, role_cut_receiver, role_ms_sender, role_ms_receiver)}


def _main(argv: list[str]) -> int:
    role, args, out = argv
    try:
        result = {"ok": True, "result": ROLES[role](json.loads(args))}
    except BaseException:  # noqa: BLE001
        result = {"ok": False, "traceback": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(result, f)
    return 0 if result["ok"] else 1


# ----------------------------------------------------------------------------------------------
# Namespaces and processes, seen from the test.
# ----------------------------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def _unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (Debian: apt-get install iproute2)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    r = _ip("netns", "list", check=False)
    if r.returncode != 0:
        return f"`ip netns` is unavailable: {r.stderr.strip() or r.stdout.strip()}"
    return None


@dataclass(frozen=True)
class Pair:
    a: str  # the trainer's namespace (TRAINER_IP, CUT_TRAINER_IP)
    b: str  # the receiver's namespace (RECEIVER_IP, CUT_RECEIVER_IP)
    cut_dev: str  # the receiver's end of the second link
    dev_a: str = ""  # the first link's end in `a`
    dev_b: str = ""  # ... and in `b`


@pytest.fixture(scope="module")
def netns():
    why = _unavailable()
    if why:
        pytest.skip(why)
    tag = secrets.token_hex(3)
    va, vb, vc, vd = (f"vns{tag}{x}" for x in "abcd")  # interface names: at most 15 characters
    pair = Pair(f"vnsync-{tag}-a", f"vnsync-{tag}-b", vd, va, vb)
    made: list[str] = []
    try:
        for ns in (pair.a, pair.b):
            r = _ip("netns", "add", ns, check=False)
            if r.returncode != 0:
                pytest.skip(f"`ip netns add` failed (no network namespaces?): {r.stderr.strip()}")
            made.append(ns)
        r = _ip("link", "add", va, "type", "veth", "peer", "name", vb, check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot create a veth pair: {r.stderr.strip()}")
        _ip("link", "add", vc, "type", "veth", "peer", "name", vd)
        for ns, dev, ip in ((pair.a, va, TRAINER_IP), (pair.b, vb, RECEIVER_IP),
                            (pair.a, vc, CUT_TRAINER_IP), (pair.b, vd, CUT_RECEIVER_IP)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield pair
    finally:
        for dev in (va, vc):  # only if it never moved into a namespace
            _ip("link", "del", dev, check=False)
        for ns in made:
            r = _ip("netns", "del", ns, check=False)
            if r.returncode != 0:
                print(f"WARNING: could not delete namespace {ns}: {r.stderr.strip()}")
        left = [ns for ns in made if ns in _ip("netns", "list", check=False).stdout]
        assert not left, f"namespaces left behind: {left}"


def run_in_netns(jobs: list[tuple[str, str, dict]], tmp_path, deadline_s: float) -> list[dict]:
    """Run `(namespace, role, args)` jobs at once under `ip netns exec`; kill all at deadline."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs, outs, logs = [], [], []
    try:
        for i, (ns, role, args) in enumerate(jobs):
            out, log = tmp_path / f"{i}-{role}.json", tmp_path / f"{i}-{role}.log"
            outs.append(out)
            logs.append(log)
            with open(log, "w") as lf:
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__),
                     role, json.dumps(args), str(out)],
                    cwd=ROOT, env=env, stdout=lf, stderr=subprocess.STDOUT,
                    start_new_session=True,
                ))
        end = time.monotonic() + deadline_s
        while any(p.poll() is None for p in procs):
            if time.monotonic() > end:
                raise AssertionError(
                    f"processes still running after the {deadline_s} s deadline:\n"
                    + "\n".join(_tail(log) for log in logs)
                )
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: it and its children
            p.wait(timeout=10)
    results = []
    for (ns, role, _), out, log in zip(jobs, outs, logs, strict=True):
        if not out.exists():
            raise AssertionError(f"{role} in {ns} left no result:\n{_tail(log)}")
        got = json.loads(out.read_text())
        if not got["ok"]:
            raise AssertionError(f"{role} in {ns} failed:\n{got['traceback']}\n{_tail(log)}")
        results.append(got["result"])
    return results


def _tail(path, n: int = 4000) -> str:
    try:
        return f"--- {path.name} ---\n" + path.read_text()[-n:]
    except OSError:
        return f"--- {path.name}: no log ---"


def _ports(k: int) -> list[int]:
    """Distinct ports; each namespace is fresh, so nothing else uses them there."""
    base = 20000 + secrets.randbelow(20000)
    return [base + i for i in range(k)]


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


def test_push_across_namespaces_bit_identical_exact_bytes(netns, tmp_path):
    from vllm_nccl_sync.wire.packing import ALIGN, plan_buckets

    cport, gport = _ports(2)
    cfg = dict(host=TRAINER_IP, control_port=cport, group_port=gport, world_size=2,
               bucket_bytes=BUCKET_MB << 20, timeout_s=20.0, **EXTRA_CFG)
    args = {"cfg": cfg, "payload_mb": PAYLOAD_MB, "reps": REPS}
    trainer, receiver = run_in_netns(
        [(netns.a, "trainer", args), (netns.b, "receiver", args)], tmp_path, DEADLINE_S
    )

    tensors = model_tensors(1, PAYLOAD_MB)
    want = {n: digest(t) for n, t in tensors.items()}
    if BUCKET_MB < 48:  # the plan the sender follows cuts the embedding: reassembly is exercised
        plan = plan_buckets(tensors.items(), BUCKET_MB << 20)
        assert sum(any(s.name == "embed.weight" for s in b.slots) for b in plan) >= 2
    payload = trainer["payload"]
    assert payload == sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(t.numel() * t.element_size() % ALIGN == 0 for t in tensors.values())
    # Bit-identical: the first update as the receiver's loader saw it (views into the receive
    # buffers, chunks reassembled), and the last one as it landed in the preallocated "model".
    assert receiver["first_summary"]["ok"], receiver["first_summary"]
    assert receiver["first_digests"] == want
    assert all(s["ok"] for s in receiver["summaries"]), receiver["summaries"]
    assert receiver["last_digests"] == want
    # Wire bytes == payload, on both ends, for every update; one broadcast per non-empty bucket.
    first = trainer["first"]
    assert first["acks"] == [1]
    assert first["bytes"] == payload == sum(first["wire"])
    assert receiver["wire"] == first["wire"]
    assert len(first["wire"]) == first["buckets"] and max(first["wire"]) <= BUCKET_MB << 20
    assert first["buckets"] >= -(-payload // (BUCKET_MB << 20))  # at least ceil(payload/bucket)
    assert trainer["wire_per_push"] == [payload] * REPS
    assert first["tensors"] == len(want)

    push, raw = statistics.median(trainer["push_s"]), statistics.median(trainer["raw_s"])
    print(
        f"\n[netns] veth {TRAINER_IP} -> {RECEIVER_IP}, gloo, payload {payload / 1e6:.1f} MB, "
        f"bucket {BUCKET_MB} MiB ({first['buckets']} buckets), {REPS} reps (median)"
        f"{', ' + json.dumps(EXTRA_CFG) if EXTRA_CFG else ''}:\n"
        f"[netns]   push (header -> all acks, loads included): {push * 1e3:.1f} ms = "
        f"{payload / push / 1e9:.3f} GB/s  (runs {[round(x * 1e3) for x in trainer['push_s']]} ms)"
        "\n"
        f"[netns]   raw gloo broadcast of the same bytes:      {raw * 1e3:.1f} ms = "
        f"{payload / raw / 1e9:.3f} GB/s  (runs {[round(x * 1e3) for x in trainer['raw_s']]} ms)\n"
        f"[netns]   ratio push/raw throughput: {raw / push:.3f}; "
        f"first push {first['seconds'] * 1e3:.0f}"
        f" ms; connect {trainer['connect_s'] * 1e3:.0f} ms"
    )


def test_unreachable_or_lost_peers_fail_clearly_within_timeout(netns, tmp_path):
    """No hang anywhere: nobody at the address, nobody joining, the link cut mid-update."""
    p = _ports(8)

    def cfg(host, cport, gport, **more):
        return {"cfg": dict(host=host, control_port=cport, group_port=gport, world_size=2,
                            bucket_bytes=4 << 20, timeout_s=NEG_TIMEOUT_S), **more}

    refused, nohost, lonely, cut_tx, cut_rx = run_in_netns(
        [
            (netns.b, "lonely_receiver", cfg(TRAINER_IP, p[0], p[1])),  # host up, port closed
            (netns.b, "lonely_receiver", cfg(NOBODY_IP, p[2], p[3])),  # no such host on the link
            (netns.a, "lonely_trainer", cfg(TRAINER_IP, p[4], p[5])),  # nobody joins
            (netns.a, "cut_trainer", cfg(CUT_TRAINER_IP, p[6], p[7])),
            (netns.b, "cut_receiver", cfg(CUT_TRAINER_IP, p[6], p[7], dev=netns.cut_dev)),
        ],
        tmp_path,
        DEADLINE_S,
    )
    for got, host, port in ((refused, TRAINER_IP, p[1]), (nohost, NOBODY_IP, p[3])):
        print(f"\n[netns] receiver -> {host}:{port}: {got['elapsed']:.2f} s: {got['error'][:300]}")
        assert got["error"], f"a receiver joined a trainer that does not exist at {host}"
        assert f"{host}:{port}" in got["error"], got["error"]
        assert got["elapsed"] <= NEG_TIMEOUT_S + NEG_SLACK_S, got
    print(f"[netns] lonely trainer: {lonely['elapsed']:.2f} s: {lonely['error'][:300]}")
    assert lonely["error"], "a trainer connected with no receiver"
    assert lonely["elapsed"] <= NEG_TIMEOUT_S + NEG_SLACK_S, lonely
    # Link cut after bucket 0 of 6: TCP sees no reset, only silence; the timeouts must end it.
    print(f"[netns] link cut: trainer failed after {cut_tx['elapsed']:.2f} s: "
          f"{cut_tx['error'][:300]}")
    print(f"[netns] link cut: receiver failed {cut_rx['elapsed']:.2f} s after the cut: "
          f"{cut_rx['summary'].get('error', '')[:300]}")
    assert cut_tx["error"] and not cut_rx["summary"]["ok"], (cut_tx, cut_rx)
    assert cut_rx["elapsed"] is not None
    assert cut_tx["elapsed"] <= 2 * NEG_TIMEOUT_S + NEG_SLACK_S, cut_tx
    assert cut_rx["elapsed"] <= 2 * NEG_TIMEOUT_S + NEG_SLACK_S, cut_rx


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


def _tx_bytes(ns: str, dev: str) -> int:
    path = f"/sys/class/net/{dev}/statistics/tx_bytes"
    r = subprocess.run(["ip", "netns", "exec", ns, "cat", path], capture_output=True, text=True,
                       timeout=20, check=True)
    return int(r.stdout)


def test_two_senders_one_per_namespace_each_on_its_own_link(netns, tmp_path):
    """Several senders across hosts: sender 0 (the coordinator) in `a`, sender 1 in `b`, a
    receiver in each. Every tensor arrives bit-identical, and each sender's bytes leave through
    its own host's end of the link (the other receiver's copy comes over loopback)."""
    cport, gport0, gport1 = _ports(3)
    cfg = dict(host=TRAINER_IP, control_port=cport, group_port=gport0, world_size=4,
               bucket_bytes=1 << 20, timeout_s=20.0, senders=[[RECEIVER_IP, gport1]])
    before = {ns: _tx_bytes(ns, dev) for ns, dev in ((netns.a, netns.dev_a),
                                                     (netns.b, netns.dev_b))}
    s0, s1, rx_a, rx_b = run_in_netns(
        [(netns.a, "ms_sender", {"cfg": cfg, "rank": 0}),
         (netns.b, "ms_sender", {"cfg": cfg, "rank": 1}),
         (netns.a, "ms_receiver", {"cfg": cfg, "rank": 2}),
         (netns.b, "ms_receiver", {"cfg": cfg, "rank": 3})], tmp_path, DEADLINE_S)
    tx = {ns: _tx_bytes(ns, dev) - before[ns] for ns, dev in ((netns.a, netns.dev_a),
                                                              (netns.b, netns.dev_b))}
    want = {n: digest(t) for n, t in _small_model().items()}
    for rx in (rx_a, rx_b):
        assert rx["summary"]["ok"], rx["summary"]
        assert rx["digests"] == want
    total = sum(t.numel() * t.element_size() for t in _small_model().values())
    assert sorted(s0["acks"]) == [2, 3] and s0["per_sender"] == {"0": s0["bytes"], "1": s1["bytes"]}
    assert s0["bytes"] + s1["bytes"] == total and s0["bytes"] == s1["bytes"] == total // 2
    assert (s0["wire"], s1["wire"]) == (s0["bytes"], s1["bytes"])  # one copy per group member
    # Each sender's bytes cross the link once (to the receiver on the other side), from its own
    # end: TCP/IP headers and the control plane add a few percent, the other sender adds none.
    for ns, sent in ((netns.a, s0["bytes"]), (netns.b, s1["bytes"])):
        assert sent <= tx[ns] < 1.1 * sent + (1 << 20), (ns, tx[ns], sent)
    print(f"\n[netns] two senders: {s0['bytes']} B out of a ({tx[netns.a]} B on its link), "
          f"{s1['bytes']} B out of b ({tx[netns.b]} B on its link)")
