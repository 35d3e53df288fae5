"""Every benchmark script's CPU smoke mode, run as CI runs it: the scripts cannot rot unnoticed.

Each script runs as a subprocess (its own session, killed whole at the deadline: an upper bound
for a loaded machine, not an expectation) and must exit 0 and print its result lines, with every
mode that it checks bit for bit reported exact. Typical times on a 2-core machine: bench_nccl
~15 s, bench_vllm_gpu ~30 s (two engines), fault_matrix (one scenario) ~2 min.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM (the CPU build in CI)")


def run_script(args: list[str], deadline_s: float) -> str:
    """Run `python benchmarks/<args>` from the repo root; its combined output, asserting exit 0."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        out, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{args[0]} still running after {deadline_s} s:\n{out[-6000:]}")
    assert proc.returncode == 0, f"{args[0]} exited with {proc.returncode}:\n{out[-6000:]}"
    return out


def table_rows(out: str, first: str, key: slice) -> dict[str, list[str]]:
    """Markdown table rows of `out` whose first cell starts with `first`, as lists of cells,
    keyed by the cells in `key` (mode/method and bucket) joined by a space."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0].startswith(first):
                rows[" ".join(cells[key])] = cells
    return rows


@pytest.mark.multiproc
def test_bench_nccl_cpu_smoke(tmp_path):
    path = tmp_path / "bench.json"
    out = run_script(["benchmarks/bench_nccl.py", "--cpu-smoke", "--sizes", "0",
                      "--buckets-mib", "1,2", "--reps", "2", "--deadline", "200",
                      "--json", str(path)], deadline_s=260)
    rows = table_rows(out, "0.01 GB (27 tensors)", slice(1, 3))
    want = {"raw -", "per_tensor -", "per_tensor_rpc -", "packed 1 MiB", "full_bucket 1 MiB",
            "e2e 1 MiB", "e2e 2 MiB"}  # the smoke sweeps both bucket sizes
    assert set(rows) == want, out
    for key, cells in rows.items():
        assert cells[-1] == ("-" if key == "raw -" else "yes"), (key, cells)
    r = json.loads(path.read_text())
    assert r["args"]["backend"] == "gloo" and r["args"]["sweep_min_gb"] == 0
    assert r["exact"] == {f"0:{m}": "yes" for m in ("per_tensor", "per_tensor_rpc", "packed",
                                                    "full_bucket", "e2e@1MiB", "e2e@2MiB")}
    runs = {(x["mode"], x["bucket"] >> 20): x for x in r["runs"]}
    assert len(runs) == 7 and all(len(x["times_s"]) == 2 for x in runs.values())
    for key in (("packed", 1), ("e2e", 1), ("e2e", 2), ("per_tensor", 1), ("raw", 1)):
        assert runs[key]["wire_over_payload"] < 1.001, key  # exact lengths (+ slot alignment)
    assert runs[("full_bucket", 1)]["wire_over_payload"] > 1.1  # every bucket at capacity
    assert runs[("e2e", 1)]["buckets"] > runs[("e2e", 2)]["buckets"] > 1


@pytest.mark.vllm
@needs_vllm
def test_bench_vllm_gpu_cpu_smoke(tmp_path):
    path = tmp_path / "vllm.json"
    out = run_script(["benchmarks/bench_vllm_gpu.py", "--cpu-smoke", "--layers", "2",
                      "--bucket-mib", "0.0625", "--extra-ours-mib", "0.125", "--reps", "2",
                      "--json", str(path)], deadline_s=420)
    rows = table_rows(out, "", slice(0, 2))
    checked = {"ours 64 KiB", "ours (separate block) 128 KiB", "ours_vllm_api (2nd engine) 64 KiB"}
    assert set(rows) == {"method bucket", "raw -"} | checked, out
    assert all(rows[k][-1] == "yes" for k in checked), out
    assert "not bit-exact" not in out and "FAILED" not in out
    r = json.loads(path.read_text())
    assert "error" not in r and r["engine2_startup_s"] > 0
    ours = [x for x in r["rows"] if x["method"].startswith("ours")]
    assert [(x["method"], x["bucket"]) for x in ours] == [
        ("ours", 64 << 10), ("ours", 128 << 10), ("ours_vllm_api", 64 << 10)]
    for x in ours:  # several buckets each; every engine parameter (packed linears too) exact
        assert x["exact"] and x["buckets"] > 1 and len(x["times_s"]) == 2, x
        assert not (x["check"]["mismatched"] or x["check"]["missing"]
                    or x["check"]["unexpected"]), x["check"]
    assert r["model"]["tensors"] == 27


@pytest.mark.vllm
@needs_vllm
def test_fault_matrix_cpu_smoke(tmp_path):
    """One scenario (trainer SIGKILLed after its last collective, staged): ~2 min, one engine."""
    out = run_script(["benchmarks/fault_matrix.py", "--cpu", "--scenarios", "c-staged",
                      "--alive-s", "5", "--every-s", "2", "--start-s", "300",
                      "--deadline-s", "420", "--out", str(tmp_path / "fm")], deadline_s=480)
    assert re.search(r"^\[c-staged\] PASS in [\d.]+ s$", out, re.M), out[-4000:]
    assert "Result: **PASS**" in out
    r = json.loads((tmp_path / "fm" / "fault_matrix.json").read_text())
    assert r["passed"] and [s["name"] for s in r["scenarios"]] == ["c-staged"]
    [sc] = r["scenarios"]
    checks = sc["checks"]
    assert all(checks.values()) and "exception" not in sc, checks
    for check in ("v1: push ok", "v1: output == transformers", "fault injected (trainer SIGKILLed)",
                  "v3: push ok", "v3: output == transformers"):
        assert checks.get(check) is True, (check, checks)
    assert any(k.startswith("engine served for 5 s") for k in checks)
