"""SGLang engines as receivers: the same protocol, the same `PushClient`, no SGLang patch.

SGLang (read in 0.5.17, the newest pinning torch 2.11) has no worker extension like vLLM's, but
it has a hook that runs our code inside every TP worker with the live model: a custom weight
loader. A server started with

    --custom-weight-loader vllm_nccl_sync.integrations.sglang.load

(`sgl.Engine(..., custom_weight_loader=[LOADER])`) lets `update_weights_from_tensor(named_tensors,
load_format=LOADER)` call `load(model_runner.model, named_tensors)` in each TP scheduler process,
inside SGLang's event loop (no forward step runs meanwhile; the tokenizer side holds its
model-update write lock, so in-flight requests finish first unless the engine is paused).

This package uses that hook as an RPC: the trainer side sends one *command* as the only named
tensor (the name carries JSON, the tensor is empty), and `load` (`worker`) runs it on each
worker's `EngineSession`, the one behind the vLLM extension too:

* `join`: the worker joins the trainer's group as `rank_offset + pp_rank * tp + tp_rank`, plans
  checked against the checkpoint's safetensors headers (like the vLLM extension);
* `receive`: one update, loaded bucket by bucket through the SGLang model's own
  `load_weights` (qkv/gate_up stacking, TP sharding, tied embeddings; in place, so CUDA graphs
  keep their pointers);
* `state`, `adapters`, `param_ptrs`, `checksums`, `metrics`, `close`.

Any other named tensors are handed to `model.load_weights` unchanged, so the loader can stand in
for SGLang's default path. `load` never raises: SGLang calls custom loaders outside any `try`,
and an exception there would take the scheduler down. SGLang discards what a custom loader
returns, so each worker writes its result as JSON into a report folder named by the command
(a folder both sides see: the in-process `sgl.Engine` always, an HTTP server on the same host);
the trainer-side handles read them back. Update outcomes also reach the trainer through the
protocol itself (`Ack`/`Error` per rank), whatever the report folder.

Trainer side: `SGLangEngineHandle(engine)` for an in-process `sgl.Engine`, `SGLangHTTPHandle(url)`
for `python -m sglang.launch_server ...`; both are `EngineHandle`s (`trainer.sync`), so
`WeightSync([...])` drives them (and vLLM engines in the same group) unchanged.

Limits (SGLang's own hook has them too): weights that SGLang transforms after loading (FP8 and
other online quantization, some MoE layouts) are not re-processed; speculative decoding (the
update goes to the draft worker) and data parallelism without DP attention are not supported.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from typing import Any

import torch

from vllm_nccl_sync.integrations.sglang.worker import LOADER, METHODS, command_tensors

log = logging.getLogger(__name__)


class _SGLangHandle:
    """Common part of the handles (each an `EngineHandle` of `trainer.sync`, like vLLM's):
    commands, report folder, pause bookkeeping."""

    def __init__(self, tp_size: int, pp_size: int, report_dir: str | None,
                 model_path: str | None, call_timeout_s: float) -> None:
        self.tp_size, self.pp_size = tp_size, pp_size
        self.workers = tp_size * pp_size
        self.model_path = model_path
        self._timeout = call_timeout_s
        self._own_dir = report_dir == "auto"
        self.report_dir = (tempfile.mkdtemp(prefix="vllm_nccl_sync_sglang_")
                           if report_dir == "auto" else report_dir)
        self._mode = "wait"
        self._lock = threading.Lock()

    def _send(self, named: list[tuple[str, torch.Tensor]], flush_cache: bool,
              timeout: float | None) -> tuple[bool, str]:
        raise NotImplementedError

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Run the extension method `method` (`nccl_sync_*`) on every worker; one result each."""
        op = METHODS.get(method)
        if op is None:
            raise ValueError(f"{method!r} is not one of {sorted(METHODS)}")
        if op == "join":
            cfg, offset = args[0], (args[1] if len(args) > 1 else 1)
            cmd_args = {"cfg": cfg, "rank_offset": offset, "model_path": self.model_path}
        elif op == "receive":
            cmd_args = {"timeout_s": args[0] if args else None}
        elif op == "checksums":
            cmd_args = {"names": args[0] if args else None}
        else:
            cmd_args = {}
        call = uuid.uuid4().hex
        cmd = {"op": op, "args": cmd_args, "call": call, "report": self.report_dir}
        # After a receive SGLang flushes its cache (its KV came from the old weights) unless
        # requests were kept in place: SGLang can only flush an idle engine, and asserts it did.
        flush = op == "receive" and self._mode != "keep"
        with self._lock:
            ok, message = self._send(command_tensors(cmd), flush, timeout)
        results = self._collect(call)
        if not ok:
            return [{"ok": False, "error": f"SGLang refused {op}: {message}"}] * self.workers
        if results is None:
            return [{"ok": True, "reported": False}] * self.workers
        return results

    def _collect(self, call: str) -> list[dict] | None:
        """Every worker's report of `call` in (pp, tp) order, or None without a report folder."""
        if not self.report_dir:
            return None
        out = []
        for pp in range(self.pp_size):
            for tp in range(self.tp_size):
                path = os.path.join(self.report_dir, f"{call}.pp{pp}.tp{tp}.json")
                try:
                    with open(path) as f:
                        out.append(json.load(f))
                    os.remove(path)
                except FileNotFoundError:
                    out.append({"ok": False, "error": (
                        f"no report from worker pp{pp}/tp{tp} in {self.report_dir} (does the "
                        f"engine see this folder, and was it started with "
                        f"--custom-weight-loader {LOADER}?)")})
        return out

    def close(self) -> None:
        if self._own_dir and self.report_dir:
            shutil.rmtree(self.report_dir, ignore_errors=True)


class SGLangEngineHandle(_SGLangHandle):
    """An in-process `sgl.Engine` started with `custom_weight_loader=[LOADER]`.

    The offline engine only steps inside `generate()`, so an update between two calls needs no
    pause. Calls are serialized (the engine's event loop is run by whichever thread calls it).
    """

    def __init__(self, engine: Any, *, report_dir: str | None = "auto",
                 call_timeout_s: float = 600.0) -> None:
        sa = engine.server_args
        if LOADER not in (getattr(sa, "custom_weight_loader", None) or []):
            raise ValueError(f"start the engine with custom_weight_loader=[{LOADER!r}]")
        super().__init__(sa.tp_size, getattr(sa, "pp_size", 1) or 1, report_dir,
                         sa.model_path, call_timeout_s)
        self.engine = engine

    def _send(self, named, flush_cache, timeout):
        out = self.engine.update_weights_from_tensor(
            named_tensors=named, load_format=LOADER, flush_cache=flush_cache)
        return bool(out[0]), str(out[1])

    def pause(self, mode: str) -> None:
        self._mode = mode

    def resume(self) -> None:
        self._mode = "wait"


def http_payload(named: list[tuple[str, torch.Tensor]], tp_size: int) -> list[str]:
    """`serialized_named_tensors` for SGLang's HTTP `/update_weights_from_tensor`: SGLang's own
    format (its multiprocessing pickler, base64), one copy per TP rank. Produced here, only ever
    read by SGLang (which unpickles it with its restricted unpickler)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    text = base64.b64encode(buf.getvalue()).decode()
    return [text] * tp_size


class SGLangHTTPHandle(_SGLangHandle):
    """An SGLang server (`python -m sglang.launch_server --custom-weight-loader LOADER ...`).

    `pause` modes: `abort` (`/pause_generation` mode abort), `wait` (no pause: SGLang's update
    waits for in-flight requests), `keep` (mode `in_place`: requests stay, with KV from the old
    weights; the cache is flushed once the engine is idle again, within `keep_flush_s`).
    `report_dir` must be a folder the server sees (the default, a local temporary folder, suits
    a server on this host); `None` returns only SGLang's success flag per worker.
    """

    def __init__(self, url: str, *, tp_size: int = 1, pp_size: int = 1,
                 report_dir: str | None = "auto", model_path: str | None = None,
                 api_key: str | None = None, call_timeout_s: float = 600.0,
                 keep_flush_s: float = 60.0) -> None:
        super().__init__(tp_size, pp_size, report_dir, model_path, call_timeout_s)
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.keep_flush_s = keep_flush_s

    def _request(self, path: str, body: dict | None, timeout: float | None,
                 method: str = "POST") -> tuple[int, Any]:
        import urllib.error
        import urllib.request

        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self._timeout) as r:
                raw, code = r.read(), r.status
        except urllib.error.HTTPError as e:
            raw, code = e.read(), e.code
        try:
            return code, json.loads(raw) if raw else None
        except ValueError:
            return code, raw.decode(errors="replace")[:500]

    def _send(self, named, flush_cache, timeout):
        body = {"serialized_named_tensors": http_payload(named, self.tp_size),
                "load_format": LOADER, "flush_cache": flush_cache}
        code, out = self._request("/update_weights_from_tensor", body,
                                  None if timeout is None else timeout + 10)
        if isinstance(out, dict):
            return bool(out.get("success")) and code == 200, str(out.get("message", ""))
        return False, f"HTTP {code}: {out}"

    def pause(self, mode: str) -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode {mode!r} must be 'abort', 'wait' or 'keep'")
        self._mode = mode
        if mode != "wait":
            sg_mode = "abort" if mode == "abort" else "in_place"
            code, out = self._request("/pause_generation", {"mode": sg_mode}, 60)
            if code != 200:
                raise RuntimeError(f"/pause_generation -> HTTP {code}: {out}")

    def resume(self) -> None:
        mode, self._mode = self._mode, "wait"
        if mode == "wait":
            return
        code, out = self._request("/continue_generation", {}, 60)
        if code != 200:
            raise RuntimeError(f"/continue_generation -> HTTP {code}: {out}")
        if mode == "keep":  # kept requests hold old-weight KV: flush once they are done
            t = self.keep_flush_s
            code, out = self._request(f"/flush_cache?timeout={t}", None, t + 30)
            if code != 200:
                log.warning("SGLang did not flush its cache after a kept update (%s): %s",
                            code, out)


def wait_healthy(url: str, timeout_s: float = 300.0, proc: Any = None) -> None:
    """Return once `url/health` answers 200; `TimeoutError` after `timeout_s` (or once `proc`
    died)."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
            raise TimeoutError(f"SGLang at {url} not healthy within {timeout_s} s")
        time.sleep(1)
