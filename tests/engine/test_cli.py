"""`vllm-nccl-sync` CLI and observability against a real engine.

`bench` over gloo; the console entry point; and one `vllm serve` (dev mode, CPU) on which
`verify --url` runs before and after a push, the `nccl_sync_metrics` RPC answers, vLLM's own
`/metrics` shows the workers' `vllm_nccl_sync_*` series (PROMETHEUS_MULTIPROC_DIR), and the worker
logs one JSON event line per update (VLLM_NCCL_SYNC_LOG=json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from vllm_nccl_sync import cli
from vllm_nccl_sync.tiny import build_model, make_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "vllm_nccl_sync.cli", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    for command in ("demo", "bench", "verify"):
        assert command in out.stdout
    args = cli.build_parser().parse_args(["demo", "--arch", "llama", "--bucket-mib", "0.5"])
    assert (args.arch, args.bucket_mib, args.func) == ("llama", 0.5, cli.cmd_demo)


@pytest.mark.multiproc
def test_bench_on_gloo(tmp_path, capfd):
    path = tmp_path / "bench.json"
    rc = cli.main(["bench", "--backend", "gloo", "--size-mib", "2", "--bucket-mib", "0.5",
                   "--reps", "2", "--json", str(path)])
    out = capfd.readouterr()  # fd level: the progress lines come from the trainer process
    assert rc == 0, out
    assert "raw broadcast" in out.out and "push / raw" in out.out
    assert "bit-exact       yes" in out.out
    assert "done" in out.err  # the progress printer's final line
    r = json.loads(path.read_text())
    assert r["backend"] == "gloo" and r["bit_exact"] and len(r["push_times_s"]) == 2
    assert r["wire_bytes"] == r["payload_bytes"] >= 2 * 2**20 * 0.9
    assert r["buckets"] >= 4 and r["ratio"] == pytest.approx(r["raw_s"] / r["push_s"])


def test_bench_pushes_a_lora_adapter(tmp_path, capfd):
    """`--lora-rank`: an adapter update (routed to the receiver's adapter loader) of every matrix,
    a small fraction of the model's bytes, exact on the wire and bit for bit."""
    path = tmp_path / "bench.json"
    rc = cli.main(["bench", "--backend", "gloo", "--size-mib", "2", "--bucket-mib", "0.5",
                   "--reps", "2", "--lora-rank", "8", "--no-progress", "--json", str(path)])
    out = capfd.readouterr()
    assert rc == 0, out
    assert "a rank-8 LoRA adapter" in out.out and "bit-exact       yes" in out.out
    r = json.loads(path.read_text())
    assert r["lora_rank"] == 8 and r["bit_exact"] and r["wire_bytes"] == r["payload_bytes"]
    assert 0 < r["payload_bytes"] < r["model_bytes"] / 4
    assert r["tensors"] == 2 * 17  # lora_A and lora_B of the embedding and 16 layer matrices


# --------------------------------------------------------------------------- a real engine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`vllm serve` (dev mode) on a tiny model, with a Prometheus multiprocess directory and JSON
    event lines from its workers."""
    from vllm_nccl_sync.tiny import start_server

    path = make_model(str(tmp_path_factory.mktemp("qwen2")), "qwen2", seed=1)
    prom = tmp_path_factory.mktemp("prom")
    log_path = tmp_path_factory.mktemp("logs") / "server.log"
    proc, url = start_server(path, str(log_path), env={"PROMETHEUS_MULTIPROC_DIR": str(prom),
                                                      "VLLM_NCCL_SYNC_LOG": "json"})
    yield url, path, log_path
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.mark.vllm
def test_verify_push_verify_and_metrics_over_http(server, capsys, tmp_path):
    from vllm_nccl_sync.integrations.vllm.handles import HTTPHandle
    from vllm_nccl_sync.trainer.sync import WeightSync
    from vllm_nccl_sync.verify import verify

    url, path, log_path = server
    report_path = tmp_path / "report.json"
    rc = cli.main(["verify", "--checkpoint", path, "--url", url, "--json", str(report_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads(report_path.read_text())
    by_name = {e["name"]: e for e in report["entries"]}
    # Kept in HF layout: compared byte for byte.
    assert by_name["model.embed_tokens.weight"]["status"] == "match"
    assert by_name["model.norm.weight"]["status"] == "match"
    # Stacked by vLLM: compared as the concatenation q|k|v.
    assert by_name["model.layers.0.self_attn.k_proj.bias"]["status"] == "match"
    assert "qkv_proj.bias" in by_name["model.layers.0.self_attn.k_proj.bias"]["detail"]
    # Packed by vLLM's CPU backend: said so, never guessed.
    down = by_name["model.layers.1.mlp.down_proj.weight"]
    assert down["status"] == "not_comparable" and "packed" in down["detail"]
    assert by_name["model.layers.0.mlp.up_proj.weight"]["status"] == "not_comparable"
    assert report["counts"]["mismatch"] == 0 and report["counts"]["match"] >= 10
    assert "not comparable" in out and "packed by vLLM's CPU backend" in out

    handle = HTTPHandle(url)
    trainer = build_model("qwen2", seed=2)
    sync = WeightSync([handle], bucket_bytes=64 * 1024, timeout_s=60)
    try:
        sync.connect()
        pushed = sync.update(trainer.state_dict(), version=1)
        # The checkpoint the engine started from no longer matches ...
        rc = cli.main(["verify", "--checkpoint", path, "--url", url])
        out = capsys.readouterr().out
        assert rc == 1 and "MISMATCH" in out and "model.embed_tokens.weight" in out
        # ... and the trainer's live tensors do (Python API).
        live = verify(trainer.state_dict(), handle)
        assert live.ok and live.count("mismatch") == 0, live.summary()
        # Counters and this worker's Prometheus series, by RPC ...
        [m] = handle.call("nccl_sync_metrics", timeout=60)
        assert m["state"]["version"] == 1 and m["state"]["updates"] == 1
        assert m["state"]["bytes"] == pushed.bytes
        assert 'vllm_nccl_sync_weight_version{rank="1"} 1.0' in m["prometheus"]
    finally:
        sync.close()
    # ... on vLLM's own /metrics (API-server process, PROMETHEUS_MULTIPROC_DIR) ...
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    assert 'vllm_nccl_sync_updates_total{rank="1"} 1.0' in text
    assert 'vllm_nccl_sync_weight_version{rank="1"} 1.0' in text
    # ... and as one JSON event line from the worker.
    events = [json.loads(ln[ln.index("{"):]) for ln in log_path.read_text().splitlines()
              if '"logger": "vllm_nccl_sync.events"' in ln]
    [finish] = [e for e in events if e["event"] == "update_finish"]
    assert finish["version"] == 1 and finish["bytes"] == pushed.bytes and finish["rank"] == 1
