"""Observability: event lines (key=value and JSON), the progress printer, and the receivers'
Prometheus series read back the way vLLM's `/metrics` reads them (multiprocess directory)."""

from __future__ import annotations

import io
import json
import logging

import pytest
import torch

from tests.conftest import free_port
from tests.procs import run_procs
from vllm_nccl_sync.engine import metrics
from vllm_nccl_sync.trainer.push import PushResult


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def events():
    h = ListHandler()
    log = logging.getLogger(metrics.EVENTS)
    old = log.level
    log.addHandler(h)
    log.setLevel(logging.INFO)
    yield h.records
    log.removeHandler(h)
    log.setLevel(old)


def test_event_lines_are_key_value_and_json(events):
    metrics.log_event("update_finish", side="trainer", version=3, bytes=1024, gbps=1.5,
                      error="two words")
    [rec] = events
    assert rec.getMessage() == ('event=update_finish side=trainer version=3 bytes=1024 '
                                'gbps=1.5 error="two words"')
    doc = json.loads(metrics.JsonFormatter().format(rec))
    assert doc["event"] == "update_finish" and doc["version"] == 3 and doc["bytes"] == 1024
    assert doc["level"] == "INFO" and doc["logger"] == metrics.EVENTS


class FakeClient:
    ranks = (1, 2)

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def push(self, named, version, **kw):
        if self.fail:
            raise RuntimeError("rank 2: boom")
        return PushResult(version, 3, 3000, 5, 0.5, [])


def test_push_logged_start_finish_and_failure(events):
    res = metrics.push_logged(FakeClient(), {}, 7)
    assert res.bytes == 3000
    start, finish = (r.nccl_sync for r in events)
    assert start == {"event": "update_start", "side": "trainer", "version": 7, "receivers": 2}
    assert finish["event"] == "update_finish" and finish["buckets"] == 3
    assert finish["gbps"] == pytest.approx(3000 / 0.5 / 1e9)
    with pytest.raises(RuntimeError):
        metrics.push_logged(FakeClient(fail=True), {}, 8)
    failed = events[-1]
    assert failed.levelno == logging.WARNING
    assert failed.nccl_sync["event"] == "update_failed" and "boom" in failed.nccl_sync["error"]


def test_progress_printer_is_rate_limited():
    out = io.StringIO()
    p = metrics.ProgressPrinter(total_bytes=4_000_000_000, interval_s=3600, stream=out)
    for k in range(1, 101):
        p(k, k * 40_000_000, k * 0.01)
    p.finish(PushResult(1, 100, 4_000_000_000, 200, 1.0, []))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # the first bucket, then the final line; nothing in between
    assert lines[0].startswith("push: 0.040 GB / 4.000 GB (1%), 1 buckets")
    assert lines[1] == "push: 4.000 GB / 4.000 GB (100%), 100 buckets, 4.00 GB/s, 1.00 s done"


# --------------------------------------------------------------------------- multi-process


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 64, generator=g), "b.bias": torch.randn(7, generator=g)}


def sender(cfg: dict) -> list:
    from vllm_nccl_sync import PushClient, SyncConfig
    from vllm_nccl_sync.trainer.push import PushError

    client = PushClient(SyncConfig(**cfg))
    client.connect()
    out = [client.push(tensors(v), v).bytes for v in (1, 2)]
    try:  # a tensor the receiver's model does not have: this update fails
        client.push({**tensors(3), "zzz.unknown": torch.ones(3)}, 3)
    except PushError as e:
        out.append(str(e))
    client.close()
    return out


def receiver(cfg: dict) -> dict:
    from vllm_nccl_sync import SyncConfig
    from vllm_nccl_sync.engine.loaders import ModuleLoader
    from vllm_nccl_sync.engine.receiver import Receiver

    lines = io.StringIO()
    h = logging.StreamHandler(lines)
    h.setFormatter(metrics.JsonFormatter())
    logging.getLogger(metrics.EVENTS).addHandler(h)
    logging.getLogger(metrics.EVENTS).setLevel(logging.INFO)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 64, bias=False)
            self.b = torch.nn.Module()
            self.b.bias = torch.nn.Parameter(torch.zeros(7))

    rx = Receiver(SyncConfig(**cfg), 1)
    summaries = [rx.receive(ModuleLoader(Model()), timeout_s=60) for _ in range(3)]
    rx.close()
    return {"summaries": summaries, "lines": lines.getvalue().splitlines(),
            "text": metrics.prometheus_text()}


@pytest.mark.multiproc
def test_receiver_series_reach_a_multiprocess_registry(tmp_path, monkeypatch):
    """What vLLM's `/metrics` shows when PROMETHEUS_MULTIPROC_DIR is set: each worker process
    writes its `vllm_nccl_sync_*` values there and a `MultiProcessCollector` aggregates them."""
    prom = pytest.importorskip("prometheus_client")
    from prometheus_client import multiprocess

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # inherited by the processes
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2,
               bucket_bytes=4096, timeout_s=30.0)
    pushed, got = run_procs([(sender, (cfg,)), (receiver, (cfg,))], 90)
    assert [s["ok"] for s in got["summaries"]] == [True, True, False]
    assert "zzz.unknown" in pushed[2]

    events = [json.loads(ln) for ln in got["lines"]]
    assert [e["event"] for e in events] == ["update_finish", "update_finish", "update_failed"]
    assert events[1]["version"] == 2 and events[1]["bytes"] == pushed[1] and events[1]["rank"] == 1
    assert events[1]["gbps"] > 0 and "zzz.unknown" in events[2]["error"]
    assert 'vllm_nccl_sync_updates_total{rank="1"} 2.0' in got["text"]

    registry = prom.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"rank": "1"})

    assert value("vllm_nccl_sync_updates_total") == 2
    assert value("vllm_nccl_sync_failures_total") == 1
    assert value("vllm_nccl_sync_received_bytes_total") == pushed[0] + pushed[1]
    assert value("vllm_nccl_sync_weight_version") == 2
    assert value("vllm_nccl_sync_consistent") == 0  # update 3 failed after loading a bucket
    assert value("vllm_nccl_sync_last_update_seconds") > 0
    assert value("vllm_nccl_sync_last_update_timestamp_seconds") > 1.7e9
