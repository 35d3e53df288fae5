"""The vLLM head-to-head, run several times as separate invocations, and summarised.

    python benchmarks/robustness.py --models 8.7,15.2 --buckets 512,256 --invocations 3 \
        --out robustness.json --md robustness.md --log robustness.log      # 2 GPUs
    python benchmarks/robustness.py --merge a.json b.json --out all.json --md all.md
    python benchmarks/robustness.py --cpu-smoke --invocations 2 --out smoke.json  # gloo, CPU vLLM

One invocation = one run of `bench_vllm_gpu.py` in a fresh process: its own trainer process, its
own vLLM engine (started for it), every bucket size of `--buckets` as a block of its own (this
project's sender and receivers joined afresh per block; raw, ours and vLLM's packed path
interleaved in rotating order; median of `--reps` updates after one warm-up; each method checked
bit for bit), ratios against the raw broadcast of the same block. The order of the blocks rotates
from one invocation of a model to the next, so neither size always runs first. Invocations of the
models alternate (model A, model B, model A, ...), so a drift of the machine's state over the run
touches both.

The JSON (`--out`) holds every invocation (its rows, wall time, engine start-up, command, machine)
and, per (model, bucket), the per-invocation ratios of ours and of vLLM's packed path to raw, their
minimum and median, raw's GB/s and the engine's extra GPU memory (flagged when ours exceeds two
buckets); `--md` is the same as a table.
An existing `--out` is appended to, so a grid can be split over several calls (each one bounded by
`--deadline-s`: no invocation is started that its estimate says would not finish in time), and
`--merge` combines the files of calls made elsewhere. The file is rewritten after every invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "bench_vllm_gpu.py")
MiB = 1 << 20
MODELS = {"8.7": 14, "15.2": 28}
"""Model (GB of bf16 weights, Qwen2-7B dims) -> `bench_vllm_gpu.py --layers`."""
SMOKE_MODEL = ("smoke", 2)
ESTIMATE_S = {"8.7": 110.0, "15.2": 140.0, "smoke": 40.0}
"""Wall time of one invocation before one was measured in this call (engine start-up dominates);
afterwards the slowest measured invocation of that model is the estimate."""
TARGETS = {512 * MiB: 0.95, 256 * MiB: 0.90}
"""Ratio to raw that the minimum over invocations must reach, per bucket size."""
ROW_KEYS = ("method", "bucket", "series", "median_s", "min_s", "max_s", "times_s", "ratio_to_raw",
            "vs_vllm_packed", "kept_bytes", "peak_extra_bytes", "trainer_s_median", "rx_s_median",
            "buckets", "exact")


def size_text(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes % MiB == 0 else f"{nbytes // 1024} KiB"


def label(model: str) -> str:
    return f"{model} GB" if model in MODELS else model


def public(argv: list[str]) -> str:
    """A command line without the machine's directories (absolute paths reduced to file names)."""
    out = []
    for a in argv:
        key, eq, val = a.partition("=") if a.startswith("--") and "=" in a else ("", "", a)
        out.append(key + eq + (os.path.basename(val) if os.path.isabs(val) else val))
    return " ".join(out)


# ----------------------------------------------------------------------------- one invocation


def invoke(model: str, layers: int, buckets: list[float], args, log, timeout_s: float) -> dict:
    """Run `bench_vllm_gpu.py` once in its own process session; its compact record."""
    fd, path = tempfile.mkstemp(prefix="robustness-", suffix=".json")
    os.close(fd)
    os.unlink(path)
    cmd = [sys.executable, BENCH, "--layers", str(layers),
           "--bucket-mib", ",".join(f"{b:g}" for b in buckets), "--extra-ours-mib=",
           "--methods", args.methods, "--reps", str(args.reps), "--json", path]
    cmd += ["--cpu-smoke"] if args.cpu_smoke else []
    cmd += ["--compile"] if args.compile else []
    cmd += ["--gpu-mem", str(args.gpu_mem)] if args.gpu_mem else []
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    log.write(f"\n===== {started} {label(model)}, buckets {buckets} MiB: {public(cmd)}\n")
    log.flush()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        rc = proc.wait(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the bench, its trainer and engine processes
        proc.wait()
        rc = None
    wall = time.perf_counter() - t0
    rec = {"id": f"{started}-{model}-{os.getpid()}-{int(t0 * 1e6) % 10**9}", "model": model,
           "layers": layers, "bucket_order": [int(b * MiB) for b in buckets], "started": started,
           "command": public(["python3", "benchmarks/bench_vllm_gpu.py"] + cmd[2:]),
           "reps": args.reps, "rc": rc, "wall_s": wall}
    if rc is None:
        rec["error"] = f"killed after {timeout_s:.0f} s"
    if os.path.exists(path):
        with open(path) as f:
            rep = json.load(f)
        os.unlink(path)
        rec.update(env=rep["env"], bytes=rep["model"]["bytes"], tensors=rep["model"]["tensors"],
                   engine_startup_s=rep["engine_startup_s"], bench_wall_s=rep.get("wall_s"),
                   rows=[compact(r) for r in rep["rows"]])
        if rep.get("error"):
            rec["error"] = rep["error"]
    elif "error" not in rec:
        rec["error"] = f"exited with {rc} before writing its results (see the log)"
    log.write(f"===== done in {wall:.1f} s, rc {rc}\n")
    log.flush()
    return rec


def compact(row: dict) -> dict:
    out = {k: row[k] for k in ROW_KEYS if k in row}
    if row.get("exact") is False:
        out["check"] = row.get("check")
    return out


# ----------------------------------------------------------------------------- summary


def summary(invocations: list[dict]) -> list[dict]:
    """Per (model, bucket), over the invocations that measured it."""
    cells: dict[tuple[str, int], list[tuple[dict, dict, dict | None, dict]]] = {}
    for inv in invocations:
        rows = inv.get("rows", [])
        for ours in (r for r in rows if r["method"] == "ours"):
            same = [r for r in rows if r.get("series") == ours.get("series")]
            raw = next(r for r in same if r["method"] == "raw")
            vp = next((r for r in same if r["method"] == "vllm_packed"), None)
            cells.setdefault((inv["model"], ours["bucket"]), []).append((ours, raw, vp, inv))
    out = []
    for (model, bucket), got in cells.items():
        ours = [o["ratio_to_raw"] for o, _, _, _ in got]
        vps = [v["ratio_to_raw"] for _, _, v, _ in got if v is not None]
        nbytes = got[0][3]["bytes"]
        cell = {
            "model": model, "bytes": nbytes, "bucket": bucket, "invocations": len(got),
            "ours_ratio_to_raw": ours, "ours_min": min(ours),
            "ours_median": statistics.median(ours), "ours_max": max(ours),
            "ours_ms": [o["median_s"] * 1e3 for o, _, _, _ in got],
            "raw_gbps": [nbytes / r["median_s"] / 1e9 for _, r, _, _ in got],
            "vllm_packed_ratio_to_raw": vps,
            "ours_over_vllm_packed": [o["vs_vllm_packed"] for o, _, v, _ in got if v is not None],
            "engine_extra_bytes_ours": max(o["kept_bytes"] + o["peak_extra_bytes"]
                                           for o, _, _, _ in got),
            "engine_extra_bytes_vllm_packed": max((v["kept_bytes"] + v["peak_extra_bytes"]
                                                   for _, _, v, _ in got if v is not None),
                                                  default=None),
            "bit_exact": all(o.get("exact") is True and (v is None or v.get("exact") is True)
                             for o, _, v, _ in got),
        }
        cell["ours_extra_within_two_buckets"] = cell["engine_extra_bytes_ours"] <= 2 * bucket
        if bucket in TARGETS:
            cell["target_min_ratio"] = TARGETS[bucket]
            cell["target_met"] = cell["ours_min"] >= TARGETS[bucket]
        out.append(cell)
    order = {m: i for i, m in enumerate(list(MODELS) + [SMOKE_MODEL[0]])}
    return sorted(out, key=lambda c: (order.get(c["model"], 99), -c["bucket"]))


def machine(env: dict) -> str:
    """"2x NVIDIA H200 (driver ...), torch ..., ..." from an invocation's `env`."""
    smi = [x for x in env.get("nvidia_smi", "").splitlines() if x.strip()]
    where = (f"{len(smi)}x {smi[0].split(',')[0]} (driver {smi[0].split(',')[-1].strip()})"
             if smi else env.get("gpu", "CPU (gloo)"))
    return (f"{where}; torch {env.get('torch', '-')}, CUDA {env.get('cuda', '-')}, "
            f"NCCL {env.get('nccl', '-')}, vLLM {env.get('vllm', '-')}")


def markdown(doc: dict) -> str:
    invs = doc["invocations"]
    ok = [i for i in invs if i.get("rows")]
    reps = "/".join(str(r) for r in sorted({i["reps"] for i in ok})) or "-"
    lines = ["# The vLLM head-to-head over separate invocations", "",
             f"Machine: {doc['machine'] or '-'}.", "",
             "Commands:", "", "```bash", *doc["commands"], "```", "",
             f"{len(invs)} invocations ({len(ok)} with results). Each: a fresh trainer and engine "
             "process pair; per bucket a block with this project's sender and receivers joined "
             f"afresh, raw / ours / vLLM packed interleaved, median of {reps} updates after a "
             "warm-up, ratios against the same block's raw broadcast.", "",
             "| model | bucket | n | ours / raw, per invocation | min | median "
             "| vLLM packed / raw, per invocation | ours / vLLM packed | raw GB/s "
             "| engine extra GPU mem: ours (vLLM packed) | bit-exact | target (min) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in doc["summary"]:
        per = ", ".join(f"{x:.3f}" for x in c["ours_ratio_to_raw"])
        vp = ", ".join(f"{x:.3f}" for x in c["vllm_packed_ratio_to_raw"]) or "-"
        vs = (f"{min(c['ours_over_vllm_packed']):.2f}-{max(c['ours_over_vllm_packed']):.2f}x"
              if c["ours_over_vllm_packed"] else "-")
        raw = f"{min(c['raw_gbps']):.0f}-{max(c['raw_gbps']):.0f}"
        mem = (f"{c['engine_extra_bytes_ours'] / 2**30:.2f} GiB"
               f"{'' if c['ours_extra_within_two_buckets'] else ' (over 2 buckets)'}")
        if c["engine_extra_bytes_vllm_packed"] is not None:
            mem += f" ({c['engine_extra_bytes_vllm_packed'] / 2**30:.2f} GiB)"
        target = "-" if "target_min_ratio" not in c else (
            f"{'met' if c['target_met'] else 'NOT met'} (>= {c['target_min_ratio']:.2f})")
        lines.append(f"| {label(c['model'])} | {size_text(c['bucket'])} | {c['invocations']} "
                     f"| {per} | **{c['ours_min']:.3f}** | {c['ours_median']:.3f} | {vp} | {vs} "
                     f"| {raw} | {mem} | {'yes' if c['bit_exact'] else 'NO'} | {target} |")
    walls = {}
    for i in ok:
        walls.setdefault(i["model"], []).append(i["wall_s"])
    lines += ["", "Wall time per invocation (engine start-up included): " + "; ".join(
        f"{label(m)} {min(w):.0f}-{max(w):.0f} s" for m, w in walls.items()) + "."]
    bad = [i for i in invs if i.get("error")]
    if bad:
        lines += ["", "Invocations without full results:"]
        lines += [f"- {i['started']} {label(i['model'])}: {i['error']}" for i in bad]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- files


def load(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    if "invocations" not in doc:
        raise SystemExit(f"{path}: not a robustness file (no 'invocations')")
    return doc


def save(doc: dict, out: str, md: str) -> None:
    env = next((i["env"] for i in doc["invocations"] if i.get("env")), None)
    doc["machine"] = machine(env) if env else None
    doc["summary"] = summary(doc["invocations"])
    doc["table"] = markdown(doc)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, out)  # a call killed mid-write leaves the last complete file
    if md:
        with open(md, "w") as f:
            f.write(doc["table"])


def merge(paths: list[str]) -> dict:
    doc: dict = {"invocations": [], "commands": []}
    seen = set()
    for p in paths:
        d = load(p)
        doc["commands"] += [c for c in d["commands"] if c not in doc["commands"]]
        for inv in d["invocations"]:
            if inv["id"] not in seen:
                seen.add(inv["id"])
                doc["invocations"].append(inv)
    return doc


# ----------------------------------------------------------------------------- main


def run(args) -> dict:
    doc = load(args.out) if os.path.exists(args.out) else {"invocations": [], "commands": []}
    doc["commands"].append(public(["python3", "benchmarks/robustness.py"] + sys.argv[1:]))
    models = [SMOKE_MODEL] if args.cpu_smoke else [(m, MODELS[m]) for m in args.models]
    done = {m: sum(i["model"] == m for i in doc["invocations"]) for m, _ in models}
    t0, walls = time.perf_counter(), {}
    log = open(args.log, "a") if args.log else sys.stdout
    try:
        for k in range(args.invocations):
            for model, layers in models:
                n = done[model] + k  # rotate the block order: invocation n starts at bucket n
                order = args.buckets[n % len(args.buckets):] + args.buckets[:n % len(args.buckets)]
                left = args.deadline_s - (time.perf_counter() - t0)
                est = max(walls.get(model, [ESTIMATE_S.get(model, 120.0)]))
                if est > left:
                    print(f"stopping: {left:.0f} s left, an invocation of {label(model)} takes "
                          f"~{est:.0f} s", flush=True)
                    return doc
                rec = invoke(model, layers, order, args, log, min(args.invocation_timeout_s, left))
                walls.setdefault(model, []).append(rec["wall_s"])
                doc["invocations"].append(rec)
                save(doc, args.out, args.md)
                ratios = ", ".join(f"ours@{size_text(r['bucket'])} {r['ratio_to_raw']:.3f}"
                                   for r in rec.get("rows", []) if r["method"] != "raw")
                print(f"{label(model)} invocation {n + 1}: {rec['wall_s']:.0f} s, rc {rec['rc']}"
                      f"{', ' + ratios if ratios else ''}"
                      f"{', ERROR ' + rec['error'] if rec.get('error') else ''}", flush=True)
    finally:
        if log is not sys.stdout:
            log.close()
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma list of {', '.join(MODELS)} (GB; Qwen2-7B dims)")
    ap.add_argument("--buckets", default="512,256", help="bucket sizes in MiB (comma)")
    ap.add_argument("--invocations", type=int, default=3, help="per model, in this call")
    ap.add_argument("--reps", type=int, default=7, help="timed updates per method and block")
    ap.add_argument("--methods", default="ours,vllm_packed",
                    help="bench_vllm_gpu.py --methods (raw always runs)")
    ap.add_argument("--compile", action="store_true", help="engines with torch.compile + graphs")
    ap.add_argument("--gpu-mem", type=float, default=0.0, help="vLLM gpu_memory_utilization")
    ap.add_argument("--deadline-s", type=float, default=570.0,
                    help="start no invocation that would end later than this after the start")
    ap.add_argument("--invocation-timeout-s", type=float, default=300.0)
    ap.add_argument("--out", required=True, help="JSON; appended to if it exists")
    ap.add_argument("--md", default="", help="Markdown summary")
    ap.add_argument("--log", default="", help="the invocations' output (default: stdout)")
    ap.add_argument("--merge", nargs="+", default=[], help="combine these files into --out")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="script check on a CPU vLLM: 2 layers, gloo, KiB buckets, ours only")
    args = ap.parse_args()
    if args.cpu_smoke:
        if args.buckets == ap.get_default("buckets"):
            args.buckets = "0.0625,0.125"
        args.methods = "ours"
    args.buckets = [float(b) for b in args.buckets.split(",") if b]
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    if not args.buckets or args.invocations < 1:
        ap.error("needs at least one bucket size and one invocation")
    if args.merge:
        doc = merge(args.merge)
    else:
        doc = run(args)
    save(doc, args.out, args.md)
    print(doc["table"], flush=True)
    failed = [i for i in doc["invocations"] if i.get("error")]
    inexact = [c for c in doc["summary"] if not c["bit_exact"]]
    sys.exit(1 if failed or inexact else 0)


if __name__ == "__main__":
    main()
