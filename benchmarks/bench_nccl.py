"""NCCL data-plane benchmark: trainer on cuda:0 -> receiver on cuda:1, side by side in one run.

    python benchmarks/bench_nccl.py --sizes 1,8,16 --json out.json

For each synthetic Qwen2-style bf16 model (fp32 norms, q/k/v biases, untied embedding and LM head;
~1, ~8, ~16 GB) the trainer's tensors live on GPU 0 and the receiver loads into preallocated model
tensors on GPU 1 (`ModuleLoader`: in-place `copy_`). All modes share one NCCL communicator per
bucket size and are timed the same way on the trainer's host: both sides meet at a barrier, the
clock starts, the mode runs, and the clock stops when the receiver has confirmed that everything
it received is in place (for `e2e` the last `Ack`; for the others a 1-byte broadcast from the
receiver queued after its loads).

  raw          one broadcast of a contiguous buffer of the model's total size: the ceiling
  e2e          this project: `PushClient.push` -> `Receiver.receive` (plan and agreement,
               exact-length buckets, loads), first plan to last ack; swept over bucket sizes
  packed       the same packed, double-buffered, exact-length broadcasts without the control plane
               (both sides cut the same plan): what the ZeroMQ round trips cost
  full_bucket  as `packed`, but every bucket is broadcast at the buffer's full capacity (the old
               verl behaviour): what exact lengths save
  per_tensor   one broadcast per tensor straight into the parameter, back to back (no control
               plane, no synchronisation): the best any per-tensor scheme can do
  per_tensor_rpc  per tensor: a control round trip with its name/dtype/shape, the broadcast, then a
               stream synchronize on both sides (TRL-style per-parameter update)

Each mode: 1 warm-up, `--reps` timed repetitions, median reported, and one extra untimed run after
the receiver's tensors were scrambled, checked bit for bit (exact position-weighted integer
checksums of every tensor on both sides).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts

import torch  # noqa: E402

from vllm_nccl_sync.trainer.sync import free_port  # noqa: E402

MiB = 1024 * 1024
GiB = 1024 * MiB

# Qwen2-style dimensions: hidden, intermediate, layers, kv dim (heads * head_dim), vocab.
PRESETS = {
    1: dict(hidden=896, inter=4864, layers=24, kv=128, vocab=151936),  # Qwen2.5-0.5B dims, untied
    8: dict(hidden=3584, inter=18944, layers=12, kv=512, vocab=152064),  # Qwen2-7B dims, 12 layers
    16: dict(hidden=3584, inter=18944, layers=28, kv=512, vocab=152064),  # Qwen2-7B, untied
    0: dict(hidden=64, inter=160, layers=2, kv=16, vocab=20000),  # tiny: `--cpu-smoke` only
}


def model_spec(size: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """HF names, shapes and dtypes, in checkpoint order."""
    p = PRESETS[size]
    h, i, kv, v = p["hidden"], p["inter"], p["kv"], p["vocab"]
    bf, f32 = torch.bfloat16, torch.float32
    out = [("model.embed_tokens.weight", (v, h), bf)]
    for layer in range(p["layers"]):
        pre = f"model.layers.{layer}."
        out += [
            (pre + "self_attn.q_proj.weight", (h, h), bf),
            (pre + "self_attn.q_proj.bias", (h,), bf),
            (pre + "self_attn.k_proj.weight", (kv, h), bf),
            (pre + "self_attn.k_proj.bias", (kv,), bf),
            (pre + "self_attn.v_proj.weight", (kv, h), bf),
            (pre + "self_attn.v_proj.bias", (kv,), bf),
            (pre + "self_attn.o_proj.weight", (h, h), bf),
            (pre + "mlp.gate_proj.weight", (i, h), bf), (pre + "mlp.up_proj.weight", (i, h), bf),
            (pre + "mlp.down_proj.weight", (h, i), bf),
            (pre + "input_layernorm.weight", (h,), f32),
            (pre + "post_attention_layernorm.weight", (h,), f32),
        ]
    out += [("model.norm.weight", (h,), f32), ("lm_head.weight", (v, h), bf)]
    return out


def make_model(size: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return {n: torch.empty(s, dtype=d, device=device).normal_(generator=g)
            for n, s, d in model_spec(size)}


class FlatModel:
    """The two methods `ModuleLoader` reads, over a dict of preallocated tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        return iter(self.tensors.items())

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True):
        return iter(())


_CH = 1 << 25


def checksum(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact and position-sensitive: [sum x, sum x * (pos % 65521 + 1)] over int16 words, int64."""
    x = t.reshape(-1).view(torch.uint8)
    x = x.view(torch.int16) if x.numel() % 2 == 0 else x.to(torch.int16)
    acc = torch.zeros(2, dtype=torch.int64, device=t.device)
    for lo in range(0, x.numel(), _CH):
        c = x[lo:lo + _CH].to(torch.int64)
        acc[0] += c.sum()
        acc[1] += (c * ((w[: c.numel()] + lo) % 65521 + 1)).sum()
    return acc


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    dev = next(iter(tensors.values())).device
    w = torch.arange(_CH, device=dev, dtype=torch.int64)
    sums = torch.stack([checksum(t, w) for t in tensors.values()]).tolist()
    return dict(zip(tensors, sums, strict=True))


def stats(times: list[float], nbytes: int, ceiling_s: float | None) -> dict:
    med = statistics.median(times)
    return {"median_s": med, "min_s": min(times), "max_s": max(times), "times_s": times,
            "gbps": nbytes / med / 1e9, "ratio_to_raw": (ceiling_s / med) if ceiling_s else 1.0}


# --------------------------------------------------------------------------- one process per GPU


class PlainNccl:
    """A bench-local NCCL group (own store), to compare stream priorities on the same loop."""

    def __init__(self, port: int, rank: int, dev: torch.device, high_priority: bool) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self.dist = dist
        self.store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                                   timeout=timedelta(seconds=120), wait_for_workers=False)
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = high_priority
        self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("bench", self.store), rank, 2, opts)
        with torch.cuda.device(dev):
            self.broadcast(torch.zeros(1, dtype=torch.uint8, device=dev)).wait()
            torch.cuda.current_stream(dev).synchronize()

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        o = self.dist.BroadcastOptions()
        o.rootRank, o.rootTensor = src, 0
        return self.pg.broadcast([tensor], o)


class _NoStream:
    """Stands in for CUDA streams, events and stream contexts on CPU."""

    def synchronize(self) -> None:
        pass

    def record(self, *a) -> None:
        pass

    def wait_event(self, *a) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a) -> None:
        pass


def _empty_cache(gpu: bool) -> None:
    if gpu:
        torch.cuda.empty_cache()


def rpc_socket(ctx: Any, tr: Any, role: int, dev: torch.device) -> Any:
    """The TRL-style round trip's ZeroMQ socket: the sender binds a port the OS picks and tells
    the receiver over the group (a port picked before the group formed may be taken meanwhile
    by the group's own connections)."""
    import zmq

    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    port = torch.zeros(1, dtype=torch.int64, device=dev)
    if role == 0:
        port.fill_(sock.bind_to_random_port("tcp://127.0.0.1"))
    tr.broadcast(port.view(torch.uint8), src=0).wait()
    if role != 0:
        sock.connect(f"tcp://127.0.0.1:{int(port.item())}")
    return sock


def worker(role: int, args: dict, ports: dict) -> dict:
    """role 0: trainer on cuda:0; role 1: receiver on cuda:1. Both walk the same plan."""
    import msgspec
    import zmq

    from vllm_nccl_sync import PushClient, SyncConfig
    from vllm_nccl_sync.engine.loaders import ModuleLoader
    from vllm_nccl_sync.engine.receiver import Receiver
    from vllm_nccl_sync.wire.packing import Reassembler, as_bytes, pack, plan_buckets

    gpu = args["backend"] == "nccl"
    if gpu:
        torch.cuda.set_device(role)
        dev = torch.device("cuda", role)
        cur = torch.cuda.current_stream(dev)
    else:  # `--cpu-smoke`: the same code paths over gloo, to check this script without GPUs
        dev, cur = torch.device("cpu"), _NoStream()
    one = torch.ones(1, dtype=torch.uint8, device=dev)
    ctx = zmq.Context.instance()
    results: list[dict] = []

    def barrier(tr) -> None:
        tr.broadcast(one, src=0).wait()
        tr.broadcast(one, src=1).wait()
        cur.synchronize()

    def confirm(tr) -> None:
        """Receiver: 'all in place' (queued after its loads); trainer: wait for it."""
        tr.broadcast(one, src=1).wait()
        cur.synchronize()

    def timed(tr, body, reps: int, scramble=None, verify=None) -> list[float]:
        times = []
        for r in range(reps + 2):  # warm-up, reps, then one checked run
            last = r == reps + 1
            if last and scramble is not None:
                scramble()
            barrier(tr)
            t0 = time.perf_counter()
            body()
            confirm_or_ack = time.perf_counter() - t0
            if 0 < r <= reps:
                times.append(confirm_or_ack)
            if last and verify is not None:
                verify()
        return times

    for size in args["sizes"]:
        tensors = make_model(size, dev, seed=1000 * size + role)
        payload = sum(t.numel() * t.element_size() for t in tensors.values())
        items = list(tensors.items())
        cur.synchronize()
        base_mem = torch.cuda.memory_allocated(dev) if gpu else 0
        want = checksums(tensors) if role == 0 else None
        info = {"size": size, "payload": payload, "tensors": len(items),
                "largest": max(t.numel() * t.element_size() for t in tensors.values())}
        if role == 0:
            results.append({"kind": "model", **info})

        def scramble() -> None:
            if role == 1:
                for t in tensors.values():
                    t.normal_()

        checks: dict[str, dict] = {}

        def verify_as(mode: str):
            def verify() -> None:
                checks[mode] = want if role == 0 else checksums(tensors)
            return verify

        sweep = args["buckets"] if size >= args["sweep_min_gb"] else [args["buckets"][0]]
        ceiling_s = None
        for bucket in sweep:
            pp = ports[f"{size}:{bucket}"]
            cfg = SyncConfig(backend=args["backend"], control_port=pp[0], group_port=pp[1],
                             world_size=2, bucket_bytes=bucket, timeout_s=120.0)
            if role == 0:
                client = PushClient(cfg, device=dev)
                client.connect()
                tr, bufs = client.transport, client.lane.buffers
            else:
                rx = Receiver(cfg, 1, device=dev)
                tr, bufs = rx.transport, rx.buffers
            reps = args["reps"]

            def record(mode: str, times: list[float], wire: int, extra: dict | None = None):
                if role == 0:
                    results.append({"kind": "run", "size": size, "mode": mode, "bucket": bucket,
                                    "payload": payload, "wire_bytes": wire,
                                    "wire_over_payload": wire / payload,
                                    **stats(times, payload, ceiling_s), **(extra or {})})

            if bucket == args["buckets"][0]:
                # (a) raw: one contiguous buffer of the model's size -------------------------
                big = torch.empty(payload, dtype=torch.uint8, device=dev)
                if role == 0:
                    big.random_(0, 256)

                def raw() -> None:
                    tr.broadcast(big).wait()
                    confirm(tr)

                times = timed(tr, raw, reps)
                del big
                _empty_cache(gpu)
                ceiling_s = statistics.median(times)
                record("raw", times, payload)

                # (c) per tensor, back to back, straight into the parameter ------------------
                def per_tensor() -> None:
                    works = [tr.broadcast(as_bytes(t)) for _, t in items]
                    if not gpu:  # gloo: point-to-point sends/recvs, each completes on its wait
                        for w in works:  # (NCCL: the stream orders `confirm` after them)
                            w.wait()
                    confirm(tr)

                times = timed(tr, per_tensor, reps, scramble, verify_as("per_tensor"))
                record("per_tensor", times, payload, {"collectives": len(items)})

                # (c') per tensor with a control round trip and a synchronize (TRL-style) -----
                sock = rpc_socket(ctx, tr, role, dev)
                enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()

                def per_tensor_rpc() -> None:
                    for name, t in items:
                        if role == 0:
                            sock.send(enc.encode([name, str(t.dtype), list(t.shape)]))
                            assert sock.recv() == b"ok"
                            tr.broadcast(as_bytes(t)).wait()
                        else:
                            n, d, s = dec.decode(sock.recv())
                            target = tensors[n]
                            assert str(target.dtype) == d and list(target.shape) == s
                            sock.send(b"ok")
                            tr.broadcast(as_bytes(target)).wait()
                        cur.synchronize()
                    confirm(tr)

                times = timed(tr, per_tensor_rpc, reps, scramble, verify_as("per_tensor_rpc"))
                sock.close()
                record("per_tensor_rpc", times, payload, {"collectives": len(items)})

                # (b0)/(d) packed pipeline without control plane: exact or full-size buckets --
                plan = list(plan_buckets(items, bucket))
                headers = [b.header(0, k, k == len(plan) - 1, 1) for k, b in enumerate(plan)]
                issue = torch.cuda.Stream(dev) if gpu else _NoStream()
                free = [torch.cuda.Event(), torch.cuda.Event()] if gpu else [_NoStream()] * 2
                loader = ModuleLoader(FlatModel(tensors))

                def packed(full: bool, t) -> int:
                    wire = 0
                    if role == 0:
                        works = [None, None]
                        for k, b in enumerate(plan):
                            if works[k % 2] is not None:
                                works[k % 2].wait()  # the broadcast that last read this buffer
                            if len(b.slots) == 1 and not full:  # as PushClient: zero copy
                                s0 = b.slots[0]
                                data = as_bytes(b.sources[0])[s0.start:s0.start + s0.nbytes]
                                works[k % 2] = t.broadcast(data)
                                wire += s0.nbytes
                                continue
                            pack(b, bufs[k % 2])
                            n = bucket if full else b.length
                            works[k % 2] = t.broadcast(bufs[k % 2][:n])
                            wire += n
                        if not gpu:  # gloo: settle the last sends (NCCL orders `confirm` after)
                            for w in works:
                                if w is not None:
                                    w.wait()
                    else:
                        re = Reassembler()
                        for ev in free:
                            ev.record(cur)
                        for k, h in enumerate(headers):
                            i = k % 2
                            n = bucket if full else h.length
                            with torch.cuda.stream(issue) if gpu else _NoStream():
                                issue.wait_event(free[i])  # loads of bucket k-2 are done
                                work = t.broadcast(bufs[i][:n])
                            work.wait()
                            loader.load(re.unpack(h, bufs[i]))
                            free[i].record(cur)
                            wire += n
                        re.finish()
                    confirm(t)
                    return wire

                variants = [("packed", False, tr), ("full_bucket", True, tr)]
                if gpu:  # A/B: the same loop over a group whose NCCL stream has normal priority
                    variants.append(("packed_normal_prio", False,
                                     PlainNccl(pp[2], role, dev, high_priority=False)))
                for mode, full, t in variants:
                    wires: list[int] = []
                    times = timed(t, lambda f=full, t=t: wires.append(packed(f, t)), reps,
                                  scramble, verify_as(mode))
                    record(mode, times, wires[0], {"buckets": len(plan)})
                if gpu:
                    try:
                        variants[-1][2].pg.abort()
                    except (AttributeError, RuntimeError):
                        pass
                del plan, headers, loader, variants, t  # they hold the model's tensors

            # (b)/(e) this project's end-to-end update -----------------------------------------
            _empty_cache(gpu)
            if gpu:
                torch.cuda.reset_peak_memory_stats(dev)
            host: list[float] = []
            pushes: list = []
            rx_seconds: list[float] = []
            peaks: list[int] = []
            version = [0]

            def e2e() -> None:
                version[0] += 1
                if role == 0:
                    moved = tr.bytes_moved
                    r = client.push(items, version=version[0],
                                    progress=lambda k, n, s: host.append(s))
                    pushes.append((r, tr.bytes_moved - moved))
                else:
                    s = rx.receive(ModuleLoader(FlatModel(tensors)), timeout_s=120)
                    assert s["ok"], s
                    rx_seconds.append(s["seconds"])
                    peaks.append(torch.cuda.max_memory_allocated(dev) - base_mem if gpu else 0)

            mode = "e2e"
            times = timed(tr, e2e, reps, scramble, verify_as(f"e2e@{bucket // MiB}MiB"))
            if role == 0:
                r, wire = pushes[0]
                nb = r.buckets
                record(mode, times, wire, {
                    "buckets": nb,
                    "push_seconds_median": statistics.median(p.seconds for p, _ in pushes[1:-1]),
                    # host time until the last bucket's broadcast was queued (after progress()).
                    "host_enqueue_s_median": statistics.median(host[k * nb - 1]
                                                               for k in range(2, reps + 2)),
                })
            else:
                results.append({"kind": "rx", "size": size, "bucket": bucket,
                                "rx_peak_extra_bytes": max(peaks),
                                "rx_receive_seconds_median": statistics.median(rx_seconds[1:-1])})
            if role == 0:
                client.close()
            else:
                rx.close()
                del rx
            del tr, bufs
            _empty_cache(gpu)
        results.append({"kind": "checks", "size": size, "role": role, "checks": checks})
        del tensors, items
        _empty_cache(gpu)
    return {"role": role, "results": results}


# --------------------------------------------------------------------------- parent


def env_info() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # pragma: no cover
        pass
    return info


def table(report: dict) -> str:
    rx = {(r["size"], r["bucket"]): r for r in report["receiver"]}
    lines = ["| model | mode | bucket | GB/s | ratio to raw | ms (median) | wire/payload | "
             "rx extra GPU mem | bit-exact |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in report["models"]:
        size = m["size"]
        runs = [r for r in report["runs"] if r["size"] == size]
        per_tensor = next((r for r in runs if r["mode"] == "per_tensor"), None)
        for r in runs:
            mode, b = r["mode"], r["bucket"]
            bucket = "-" if mode.startswith(("raw", "per_tensor")) else f"{b // MiB} MiB"
            extra = "0 (in place)" if mode.startswith("per_tensor") else "-"
            if mode == "e2e":
                extra = f"{rx[(size, b)]['rx_peak_extra_bytes'] / GiB:.2f} GiB"
            key = f"e2e@{b // MiB}MiB" if mode == "e2e" else mode
            exact = report["exact"].get(f"{size}:{key}", "-")
            lines.append(
                f"| {m['payload'] / 1e9:.2f} GB ({m['tensors']} tensors) | {mode} | {bucket} | "
                f"{r['gbps']:.0f} | {r['ratio_to_raw']:.3f} | {r['median_s'] * 1e3:.1f} | "
                f"{r['wire_over_payload']:.3f} | {extra} | {exact} |")
        if per_tensor:
            best = max((r for r in runs if r["mode"] == "e2e"), key=lambda r: r["gbps"])
            ratio = best["gbps"] / per_tensor["gbps"]
            lines.append(f"| | e2e best / per_tensor | | {ratio:.2f}x | | | | | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,8,16", help=f"model sizes in GB, from {list(PRESETS)}")
    ap.add_argument("--buckets-mib", default="256,64,512,1024",
                    help="bucket sizes; the first is the default used for the baselines")
    ap.add_argument("--sweep-min-gb", type=int, default=None,
                    help="sweep every bucket size for models of at least this size "
                         "(default 1; 0 with --cpu-smoke, so the smoke sweeps too)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--deadline", type=float, default=540.0)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="check this script over gloo on CPU (use --sizes 0 --buckets-mib 1,2)")
    a = ap.parse_args()
    if not a.cpu_smoke and torch.cuda.device_count() < 2:
        sys.exit("needs 2 CUDA GPUs")
    from tests.procs import run_procs

    args = {"sizes": [int(s) for s in a.sizes.split(",")],
            "buckets": [int(b) * MiB for b in a.buckets_mib.split(",")],
            "sweep_min_gb": (a.sweep_min_gb if a.sweep_min_gb is not None
                             else 0 if a.cpu_smoke else 1), "reps": a.reps,
            "backend": "gloo" if a.cpu_smoke else "nccl"}
    ports = {f"{s}:{b}": [free_port(), free_port(), free_port()]
             for s in args["sizes"] for b in args["buckets"]}
    t0 = time.time()
    out = run_procs([(worker, (0, args, ports)), (worker, (1, args, ports))], a.deadline)
    res0 = out[0]["results"]
    res1 = out[1]["results"]
    report = {"command": " ".join(sys.argv), "env": env_info(), "args": args,
              "models": [r for r in res0 if r["kind"] == "model"],
              "runs": [r for r in res0 if r["kind"] == "run"],
              "receiver": [r for r in res1 if r["kind"] == "rx"],
              "exact": {}, "wall_s": time.time() - t0}
    c0 = {r["size"]: r["checks"] for r in res0 if r["kind"] == "checks"}
    c1 = {r["size"]: r["checks"] for r in res1 if r["kind"] == "checks"}
    for size, modes in c1.items():
        for mode, got in modes.items():
            report["exact"][f"{size}:{mode}"] = "yes" if got == c0[size].get(mode) else "NO"
    text = table(report)
    report["table"] = text
    print(text)
    print(f"\n{report['env']}  wall {report['wall_s']:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    if "NO" in report["exact"].values():
        sys.exit("a mode did not deliver bit-identical tensors")
    unchecked = [f"{r['size']}:{r['mode']}@{r['bucket'] // MiB}MiB" for r in report["runs"]
                 if r["mode"] != "raw" and report["exact"].get(
                     f"{r['size']}:" + (f"e2e@{r['bucket'] // MiB}MiB" if r["mode"] == "e2e"
                                        else r["mode"])) != "yes"]
    if unchecked:
        sys.exit(f"modes without a bit-exact check: {unchecked}")


if __name__ == "__main__":
    main()
