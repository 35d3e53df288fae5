"""Every benchmark script's CPU smoke mode, run as CI runs it: the scripts cannot rot unnoticed.

Each script runs as a subprocess (its own session, killed whole at the deadline: an upper bound
for a loaded machine, not an expectation) and must exit 0 and print its result lines, with every
mode that it checks bit for bit reported exact. Typical times on a 2-core machine: bench_nccl
~15 s, bench_vllm_gpu ~30 s (two engines), bench_colocated ~15 s (one engine), robustness ~50 s
(two engines, one at a time), bench_pause ~50 s (one AsyncLLM engine), fault_matrix (one
scenario) ~2 min.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pstats
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
def test_bench_colocated_cpu_smoke(tmp_path):
    """Host copies, a raw gloo broadcast, and this project over gloo and over shared memory into
    one CPU engine, both planes joined at once (a session each)."""
    path = tmp_path / "colocated.json"
    out = run_script(["benchmarks/bench_colocated.py", "--cpu-smoke", "--layers", "2",
                      "--bucket-mib", "0.0625", "--reps", "2", "--json", str(path),
                      "--profile", str(tmp_path / "engine.prof")], deadline_s=300)
    rows = table_rows(out, "", slice(0, 2))
    checked = {"ours_gloo 64 KiB", "ours_shm 64 KiB"}
    profiled = pstats.Stats(str(tmp_path / "engine.prof"))  # the receive RPCs of ours_shm
    assert any(fn[2] == "receive" for fn in profiled.stats), out[-2000:]
    pushed = pstats.Stats(str(tmp_path / "engine.prof.trainer"))  # the trainer's pushes of it
    assert any(fn[2] == "push" for fn in pushed.stats), out[-2000:]
    assert re.search(r"Its push, median ms by phase: layout [\d.]+", out), out[-2000:]
    assert set(rows) == {"method bucket", "floor -", "floor_per_tensor -",
                         "raw_gloo 64 KiB"} | checked, out
    assert all(rows[k][-1] == "yes" for k in checked), out
    assert "not bit-exact" not in out and "FAILED" not in out
    r = json.loads(path.read_text())
    assert r["mode"] == "cpu" and r["model"]["tensors"] == 27
    by = {x["method"]: x for x in r["rows"]}
    assert list(by) == ["floor", "floor_per_tensor", "raw_gloo", "ours_gloo", "ours_shm"]
    for x in by.values():  # each timed twice after the warm-up, none failed
        assert "error" not in x and len(x["times_s"]) == 2 and x["median_s"] > 0, x
    assert by["floor"]["ratio_to_floor"] == 1.0
    for m in ("ours_gloo", "ours_shm"):  # several buckets each; every engine parameter exact
        x = by[m]
        assert x["exact"] and x["buckets"] > 1 and x["ratio_to_floor"] > 0, x
        assert not (x["check"]["mismatched"] or x["check"]["missing"]
                    or x["check"]["unexpected"]), x["check"]
        steps = x["rx_phases_s_median"]  # the receiver's own marks, in the order reached
        assert list(steps)[:4] == ["plan", "ready", "bucket", "kept"], steps
        assert {"sealed", "checked", "finished", "committed"} <= set(steps), steps
        assert all(v >= 0 for v in steps.values()) and steps["kept"] > 0, steps
        assert x["graph_launches"] == [0, 0], x  # reported per push; a CPU engine has none
        assert x["through_loader"][-1] == 0, x  # the loader's copies replayed, linears included
    assert os.path.exists(r["trainer_log"])


@pytest.mark.vllm
@needs_vllm
def test_robustness_cpu_smoke(tmp_path):
    """Two calls of one invocation each, the second appending: the split a GPU batch uses."""
    path, md = tmp_path / "rob.json", tmp_path / "rob.md"
    for _ in range(2):
        out = run_script(["benchmarks/robustness.py", "--cpu-smoke", "--invocations", "1",
                          "--reps", "2", "--out", str(path), "--md", str(md),
                          "--log", str(tmp_path / "rob.log")], deadline_s=420)
        assert "invocation" in out and "ERROR" not in out, out[-4000:]
    r = json.loads(path.read_text())
    assert len(r["commands"]) == 2 and len(r["invocations"]) == 2
    # one engine per invocation, both bucket sizes in it, the block order rotated
    assert [i["bucket_order"] for i in r["invocations"]] == [[64 << 10, 128 << 10],
                                                            [128 << 10, 64 << 10]]
    for inv in r["invocations"]:
        assert inv["rc"] == 0 and "error" not in inv and inv["wall_s"] > 0, inv
        raws = [x for x in inv["rows"] if x["method"] == "raw"]
        assert sorted(x["series"] for x in raws) == [0, 1]  # a raw reference in each block
    cells = {c["bucket"]: c for c in r["summary"]}
    assert set(cells) == {64 << 10, 128 << 10}
    for c in cells.values():  # every bucket measured by both invocations, each bit-exact
        assert c["invocations"] == 2 and len(c["ours_ratio_to_raw"]) == 2, c
        assert c["ours_min"] == min(c["ours_ratio_to_raw"]) <= c["ours_median"], c
        assert c["bit_exact"] and c["model"] == "smoke", c
    assert "| smoke | 64 KiB | 2 |" in md.read_text()
    merged = tmp_path / "merged.json"  # merging a file with itself adds nothing
    run_script(["benchmarks/robustness.py", "--merge", str(path), str(path), "--out",
                str(merged)], deadline_s=60)
    assert json.loads(merged.read_text())["summary"] == r["summary"]


@pytest.mark.vllm
@needs_vllm
def test_bench_pause_cpu_smoke(tmp_path):
    """AsyncLLM serving two streaming clients: one update paused with `keep`, two received
    beside serving, swapped with `wait` and with `carry` (no pause)."""
    path = tmp_path / "pause.json"
    out = run_script(["benchmarks/bench_pause.py", "--cpu-smoke", "--updates", "1",
                      "--pause-modes", "keep,beside:wait,beside:carry", "--trainer-process", "--stagger",
                      "--json", str(path)],
                     deadline_s=420)
    assert re.search(r"^\| keep \| [\d.]+ \(", out, re.M), out[-4000:]
    assert re.search(r"^\| beside:wait \| [\d.]+ \(", out, re.M), out[-4000:]
    # its AsyncLLM is shut down output handler first (tests.helpers.stop_async_llm): nothing logged
    assert "Traceback" not in out and "EngineDeadError" not in out, out[-4000:]
    r = json.loads(path.read_text())
    assert r["exact"] and not r["mismatched"]  # zeroed, then one update refilled every byte
    assert r["requests"]["short"] == [] and set(r["requests"]["finished"]) <= {"length"}
    assert [u["version"] for u in r["updates"]] == [1, 2, 3]
    for u in r["updates"]:
        assert "error" not in u and u["buckets"] > 1 and u["exact"], u
        assert len(u["rx_s"]) == 1 and u["rx_s"][0] > 0
        # the probes placed the longest gap: the core's own steps around it, undisturbed decoding
        assert u["core_max_interval_near_gap_s"] > 0 and u["baseline_max_gap_s"] > 0, u
        if u["mode"] == "beside:wait":  # the stall is around the swap's pause, not the push
            assert u["requests_spanning_swap"] == 0 and not u["promise_broken"], u
            assert u["receive_rate_ratio"] >= 0 and 0 < u["stall_s"] <= u["max_gap_s"] + 1e-9
            assert u["phases_s"]["pause"] >= 0 and u["phases_s"]["resume"] >= 0
            continue
        if u["mode"] == "beside:carry":  # never paused: the gap is around the swap's own call
            assert u["phases_s"]["pause"] is None and u["paused_s"] is None, u
            assert u["receive_rate_ratio"] >= 0 and 0 < u["stall_s"] <= u["max_gap_s"] + 1e-9
            assert u["swap_window"][0] < u["swap_window"][1]
            continue
        ph = u["phases_s"]
        assert None not in ph.values(), ph  # every engine call of the update was seen
        for causal in ("pause", "to_push", "push", "reset_prefix_cache", "resume"):
            assert ph[causal] >= 0, (causal, ph)
        # each client's own gap around the push contains the engine-wide one
        assert 0 < u["stall_s"] <= u["client_stall_s"]["median"] + 1e-9, u
        assert abs(sum(ph.values()) - u["stall_s"]) < 1e-6
    assert [r["summary"][m]["updates"] for m in ("keep", "beside:wait", "beside:carry")] == \
        [1, 1, 1]


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


def test_gloo_floor_smoke(tmp_path):
    """The gloo floor script: three modes timed, the received bytes equal to the sent ones."""
    path = tmp_path / "floor.json"
    out = run_script(["benchmarks/gloo_floor.py", "--smoke", "--json", str(path)], deadline_s=300)
    assert "bytes equal     yes" in out, out[-3000:]
    r = json.loads(path.read_text())
    assert r["bytes_equal"] and set(r["ratio_to_raw"]) == {"raw", "chunked", "chunked+verify"}
    assert all(len(v) == 2 and min(v) > 0 for v in r["times_s"].values())


@pytest.mark.multiproc
def test_fixed_cost_smoke(tmp_path):
    """The fixed-cost script: both planes pushed (shm packed and read in place), the receiver's
    steps reported, bit-exact."""
    path = tmp_path / "fixed.json"
    out = run_script(["benchmarks/fixed_cost.py", "--reps", "2", "--json", str(path)],
                     deadline_s=300)
    assert "bit-exact: {'shm': True, 'gloo': True, 'shm_in_place': True}" in out, out[-3000:]
    r = json.loads(path.read_text())
    assert r["tensors"] == 171 and set(r["planes"]) == {"shm", "gloo", "shm_in_place"}
    for plane in r["planes"].values():
        assert plane["receiver_ms"] > 0 and {"ready", "bucket", "kept"} <= set(plane["steps_ms"])


@pytest.mark.multiproc
def test_receive_thread_smoke(tmp_path):
    """The receive-in-a-thread script: one round of both layouts, both bit-exact, the steps
    taken while the updates were received timed."""
    path = tmp_path / "rt.json"
    out = run_script(["benchmarks/receive_thread.py", "--rounds", "1", "--json", str(path)],
                     deadline_s=300)
    assert "round 1 thread / process" in out, out[-3000:]
    [r] = json.loads(path.read_text())["rounds"]
    for mode in ("thread", "process"):
        assert r[mode]["exact"] is True and r[mode]["max_ms"] >= r[mode]["p99_ms"] >= 0, (mode, r)


def test_swap_replay_smoke():
    """The swap's load alone on tiny dims: the replay is bit-exact and every row is printed."""
    out = run_script(["benchmarks/swap_replay.py", "--device", "cpu", "--tiny", "--reps", "2"],
                     deadline_s=120)
    assert "bit-exact: True" in out and "checksums agree: True" in out, out
    for row in ("replay", "loader", "copies", "foreach", "floor", "replay_summed", "sums",
                "sums_torch"):
        assert re.search(rf"^  {row} +host +[\d.]+", out, re.M), out


def test_pause_analysis_places_a_gap_between_slow_steps():
    """On a slow host the engine core may step less often than every 0.1 s: the interval
    around the longest gap is still the one between the steps that bracket it."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from pause_analysis import gap_sources
    finally:
        sys.path.pop(0)
    steps = [0.0, 0.4, 1.2, 1.5]  # the core's steps; their tokens reach clients 0.2 s later
    times = [s + 0.2 for s in steps]
    got = gap_sources(0.6, 0.8, times, (0.0, 0.7), {"core": [(s, s + 0.2) for s in steps],
                                                    "gcs": []})
    assert got["core_max_interval_near_gap_s"] == pytest.approx(0.8)  # 0.4 -> 1.2
    assert got["core_steps_in_gap"] == 1 and got["baseline_max_gap_s"] == pytest.approx(0.4)
