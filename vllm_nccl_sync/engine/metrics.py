"""Observability: one structured log line per update, Prometheus metrics, a progress printer.

Log lines. Every update start/finish/failure is one record on the `vllm_nccl_sync.events` logger:
its message is `key=value` pairs (`event=update_finish version=3 bytes=... gbps=...`) and the same
fields ride on the record as `record.nccl_sync`, which `JsonFormatter` writes as one JSON object
per line. The trainer side logs through `push_logged(client, ...)`; each receiving worker logs
through `observe_update` (called by `Receiver` at the end of every update, success or failure).

Prometheus. vLLM serves `/metrics` from its API-server process, but updates happen in the worker
processes, so a worker's metrics reach that endpoint only through prometheus_client's multiprocess
mode: when `PROMETHEUS_MULTIPROC_DIR` is set before `vllm serve` starts (vLLM sets it itself with
`--api-server-count` > 1), every process writes its values to files in that directory and vLLM's
`/metrics` (a `MultiProcessCollector` over it) shows the workers' `vllm_nccl_sync_*` series too.
Without it the workers' metrics stay in their own process; read them with the `nccl_sync_state` /
`nccl_sync_metrics` RPCs (the latter returns this worker's Prometheus text) or from the log lines.
Set `VLLM_NCCL_SYNC_PROMETHEUS=0` to register nothing.

In a process whose logging nobody configured (a vLLM worker), `VLLM_NCCL_SYNC_LOG=text` or `json`
makes the first event attach a stderr handler (INFO) to the `vllm_nccl_sync` loggers.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, TextIO

from vllm_nccl_sync.outcomes import WorkerSummary

EVENTS = "vllm_nccl_sync.events"
"""Logger of the update events (start, finish, failure) of both sides."""

_events = logging.getLogger(EVENTS)


# --------------------------------------------------------------------------- structured log lines


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    return json.dumps(text) if (not text or any(c in text for c in ' "=\n')) else text


def kv_line(event: str, fields: dict[str, Any]) -> str:
    """`event=<event> k=v ...`; values with spaces or quotes are JSON-quoted."""
    return " ".join(f"{k}={_fmt(v)}" for k, v in {"event": event, **fields}.items())


_auto_done = False


def _auto_configure() -> None:
    """Honour `VLLM_NCCL_SYNC_LOG` (text|json) once, if this package's logging has no handler."""
    global _auto_done
    _auto_done = True
    mode = os.environ.get("VLLM_NCCL_SYNC_LOG", "").lower()
    if mode in ("text", "json") and not logging.getLogger("vllm_nccl_sync").handlers:
        configure_logging(json_lines=mode == "json")


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one update event as a `key=value` line, with the fields attached for `JsonFormatter`."""
    if not _auto_done:
        _auto_configure()
    if _events.isEnabledFor(level):
        _events.log(level, kv_line(event, fields), extra={"nccl_sync": {"event": event, **fields}})


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and an event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(getattr(record, "nccl_sync", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(
    *, json_lines: bool = False, level: int = logging.INFO, stream: TextIO | None = None
) -> logging.Handler:
    """Send this package's logs to `stream` (stderr), as JSON lines or `key=value` text."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    pkg = logging.getLogger("vllm_nccl_sync")
    pkg.addHandler(handler)
    pkg.setLevel(level)
    return handler


# --------------------------------------------------------------------------- trainer side


def push_logged(client: Any, named_tensors: Iterable, version: int, **kwargs: Any) -> Any:
    """`client.push(...)` between an `update_start` and an `update_finish`/`update_failed` event."""
    log_event("update_start", side="trainer", version=version,
              receivers=len(getattr(client, "ranks", ())))
    t0 = time.perf_counter()
    try:
        res = client.push(named_tensors, version, **kwargs)
    except Exception as e:
        log_event("update_failed", logging.WARNING, side="trainer", version=version,
                  seconds=time.perf_counter() - t0, error=str(e)[:500])
        raise
    log_event("update_finish", side="trainer", version=version, bytes=res.bytes,
              buckets=res.buckets, tensors=res.tensors, seconds=res.seconds, gbps=res.gbps)
    return res


class ProgressPrinter:
    """A `PushClient.push(progress=...)` callback printing bytes, buckets and GB/s to stderr.

    At most one line per `interval_s` (the first bucket and `finish()` always print). On a
    terminal the line is rewritten in place; elsewhere (logs, CI) each update is a new line.
    """

    def __init__(self, total_bytes: int | None = None, *, interval_s: float = 0.5,
                 stream: TextIO | None = None, label: str = "push") -> None:
        self.total = total_bytes
        self.interval = interval_s
        self.stream = stream or sys.stderr
        self.label = label
        self.lines = 0
        self._last = -float("inf")
        self._state = (0, 0, 0.0)
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def _text(self, buckets: int, nbytes: int, seconds: float) -> str:
        done = f"{nbytes / 1e9:.3f} GB"
        if self.total:
            done += f" / {self.total / 1e9:.3f} GB ({100 * nbytes / self.total:.0f}%)"
        rate = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        return f"{self.label}: {done}, {buckets} buckets, {rate:.2f} GB/s, {seconds:.2f} s"

    def _emit(self, text: str, final: bool) -> None:
        end = "\n" if final or not self._tty else ""
        self.stream.write(("\r" if self._tty else "") + text + end)
        self.stream.flush()
        self.lines += 1

    def __call__(self, buckets: int, nbytes: int, seconds: float) -> None:
        self._state = (buckets, nbytes, seconds)
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._emit(self._text(buckets, nbytes, seconds), final=False)

    def finish(self, result: Any = None) -> None:
        """Print the final line (from a `PushResult` if given: its time includes the acks)."""
        if result is not None:
            self._state = (result.buckets, result.bytes, result.seconds)
        self._emit(self._text(*self._state) + " done", final=True)


# --------------------------------------------------------------------------- receiver side


class _Prometheus:
    """This process's `vllm_nccl_sync_*` series, labelled by transfer-group rank."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        def gauge(name: str, doc: str) -> Any:
            try:  # the value written last wins across a worker's processes (multiprocess mode)
                return Gauge(name, doc, ["rank"], multiprocess_mode="mostrecent")
            except ValueError:  # prometheus_client < 0.16
                return Gauge(name, doc, ["rank"], multiprocess_mode="max")

        self.updates = Counter("vllm_nccl_sync_updates", "Weight updates completed", ["rank"])
        self.failures = Counter("vllm_nccl_sync_failures", "Weight updates failed", ["rank"])
        self.bytes = Counter("vllm_nccl_sync_received_bytes", "Bytes received by updates", ["rank"])
        self.version = gauge("vllm_nccl_sync_weight_version",
                             "Version of the weights held (-1: as started)")
        self.consistent = gauge("vllm_nccl_sync_consistent",
                                "1 unless an update failed part-way in place")
        self.seconds = gauge("vllm_nccl_sync_last_update_seconds", "Duration of the last update")
        self.gbps = gauge("vllm_nccl_sync_last_update_gbps", "GB/s of the last update")
        self.when = gauge("vllm_nccl_sync_last_update_timestamp_seconds",
                          "Unix time the last update ended (success or failure)")
        self.seen: dict[str, tuple[int, int, int]] = {}


_prom: _Prometheus | None | bool = None
_prom_lock = threading.Lock()


def prometheus() -> _Prometheus | None:
    """This process's metrics (created once), or None without prometheus_client or when disabled."""
    global _prom
    with _prom_lock:
        if _prom is None:
            _prom = False
            if os.environ.get("VLLM_NCCL_SYNC_PROMETHEUS", "1") != "0":
                try:
                    _prom = _Prometheus()
                except ImportError:
                    pass
                except Exception:  # e.g. names taken in this registry: never break an update
                    logging.getLogger(__name__).exception("Prometheus metrics unavailable")
        return _prom or None


def export_state(rank: int, state: Any, summary: WorkerSummary | None = None) -> None:
    """Mirror a `ReceiverState` into the Prometheus series of `rank` (counters by their delta)."""
    prom = prometheus()
    if prom is None:
        return
    r = str(rank)
    u0, f0, b0 = prom.seen.get(r, (0, 0, 0))
    prom.updates.labels(r).inc(max(state.updates - u0, 0))
    prom.failures.labels(r).inc(max(state.failures - f0, 0))
    prom.bytes.labels(r).inc(max(state.bytes - b0, 0))
    prom.seen[r] = (state.updates, state.failures, state.bytes)
    prom.version.labels(r).set(state.version)
    prom.consistent.labels(r).set(1 if state.consistent else 0)
    if summary is not None:
        prom.when.labels(r).set(time.time())
        if summary.ok:
            secs = summary.seconds
            prom.seconds.labels(r).set(secs)
            prom.gbps.labels(r).set(summary.bytes / secs / 1e9 if secs > 0 else 0.0)


def observe_update(receiver: Any, summary: WorkerSummary) -> None:
    """Called by `Receiver` when an update ends: one event line, then the Prometheus series."""
    try:
        st = receiver.state
        fields = {"side": "receiver", "rank": receiver.rank, "version": summary.version,
                  "bytes": summary.bytes, "buckets": summary.buckets}
        if summary.ok:
            secs = summary.seconds
            log_event("update_finish", **fields, tensors=summary.tensors, seconds=secs,
                      gbps=summary.bytes / secs / 1e9 if secs > 0 else 0.0, updates=st.updates)
        else:
            log_event("update_failed", logging.WARNING, **fields, consistent=st.consistent,
                      failures=st.failures, error=summary.error[:500])
        export_state(receiver.rank, st, summary)
    except Exception:  # observability must never fail an update
        logging.getLogger(__name__).exception("recording update metrics failed")


def prometheus_text() -> str:
    """This process's `vllm_nccl_sync_*` series in the Prometheus text format ("" if none)."""
    if prometheus() is None:
        return ""
    from prometheus_client import REGISTRY, generate_latest

    text = generate_latest(REGISTRY).decode()
    keep = [ln for ln in text.splitlines() if "vllm_nccl_sync_" in ln]
    return "\n".join(keep) + ("\n" if keep else "")
