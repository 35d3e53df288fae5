"""SGLang engines as receivers: the same protocol, the same `PushClient`, no SGLang patch.

SGLang (read in 0.5.17, the newest pinning torch 2.11) has no worker extension like vLLM's, but
it has a hook that runs our code inside every TP worker with the live model: a custom weight
loader. A server started with

    --custom-weight-loader vllm_nccl_sync.glue.sglang.load

(`sgl.Engine(..., custom_weight_loader=[LOADER])`) lets `update_weights_from_tensor(named_tensors,
load_format=LOADER)` call `load(model_runner.model, named_tensors)` in each TP scheduler process,
inside SGLang's event loop (no forward step runs meanwhile; the tokenizer side holds its
model-update write lock, so in-flight requests finish first unless the engine is paused).

This module uses that hook as an RPC: the trainer side sends one *command* as the only named
tensor (the name carries JSON, the tensor is empty), and `load` runs it in each worker:

* `join`: a `Receiver` joins the trainer's group as `rank_offset + pp_rank * tp + tp_rank`,
  checked against the checkpoint's safetensors headers (like the vLLM extension);
* `receive`: one update, loaded bucket by bucket through the SGLang model's own
  `load_weights` (qkv/gate_up stacking, TP sharding, tied embeddings; in place, so CUDA graphs
  keep their pointers);
* `state`, `param_ptrs`, `checksums`, `close`.

Any other named tensors are handed to `model.load_weights` unchanged, so the loader can stand in
for SGLang's default path. `load` never raises: SGLang calls custom loaders outside any `try`,
and an exception there would take the scheduler down. SGLang discards what a custom loader
returns, so each worker writes its result as JSON into a report folder named by the command
(a folder both sides see: the in-process `sgl.Engine` always, an HTTP server on the same host);
the trainer-side handles read them back. Update outcomes also reach the trainer through the
protocol itself (`Ack`/`Error` per rank), whatever the report folder.

Trainer side: `SGLangEngineHandle(engine)` for an in-process `sgl.Engine`, `SGLangHTTPHandle(url)`
for `python -m sglang.launch_server ...`; both are `vllm_nccl_sync.glue.engines.EngineHandle`s, so
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
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

LOADER = "vllm_nccl_sync.glue.sglang.load"
"""The import path to give SGLang's `--custom-weight-loader` and use as `load_format`."""
COMMAND_PREFIX = "vllm_nccl_sync:"
"""A named tensor whose name starts with this is a command (the rest of the name is JSON)."""
SUPPORTED = ("0.5.",)
"""SGLang versions (prefixes) whose custom-weight-loader hook this module follows."""
OPS = ("join", "receive", "state", "param_ptrs", "checksums", "close")
METHODS = {f"nccl_sync_{op}": op for op in OPS}
"""The vLLM extension's RPC names (what `WeightSync` calls) mapped to commands."""
MAX_COMMAND = 64 * 1024


# =============================================================================== engine side


@dataclass
class _Worker:
    """What one TP worker of one model holds between commands."""

    state: Any  # ReceiverState: outlives re-joins
    receiver: Any = None
    loader: Any = None
    info: dict = field(default_factory=dict)


_WORKERS: dict[int, _Worker] = {}
"""Per model object (one per TP scheduler process, or several models in one test process)."""


class SGLangWeightLoader:
    """`WeightLoader` over an SGLang model's `load_weights` (full HF-named tensors, in place).

    SGLang's loaders copy into the existing parameters, so no reference to a receive buffer is
    kept after `load` returns (the copies are issued on the current stream, which the receiver
    orders before the buffer is refilled). Nothing is re-processed after loading, exactly as in
    SGLang's own `update_weights_from_tensor` / `update_weights_from_distributed`.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.loaded: set[str] = set()
        self.calls = 0

    def begin(self) -> None:
        self.loaded = set()
        self.calls = 0

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> set[str]:
        if not named_tensors:
            return set()
        self.calls += 1
        done = self.model.load_weights(named_tensors)  # some models return the names, some None
        names = set(done) if isinstance(done, (set, list, tuple)) else {n for n, _ in named_tensors}
        self.loaded |= names
        return names

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass


def parse_command(named_tensors: list) -> dict | None:
    """The command carried by `named_tensors`, or None if they are ordinary weights.

    Raises `ValueError` (or `TypeError`) if a command is malformed: mixed with weights, not JSON,
    an unknown op, args that are not an object.
    """
    names = [n for n, _ in named_tensors]
    cmds = [n for n in names if isinstance(n, str) and n.startswith(COMMAND_PREFIX)]
    if not cmds:
        return None
    if len(names) != 1:
        raise ValueError(f"a command must travel alone, got {len(names)} named tensors")
    text = cmds[0][len(COMMAND_PREFIX):]
    if len(text) > MAX_COMMAND:
        raise ValueError(f"command of {len(text)} characters is too long")
    cmd = json.loads(text)
    if not isinstance(cmd, dict) or cmd.get("op") not in OPS:
        raise ValueError(f"not a command: {text[:200]!r}")
    if not isinstance(cmd.get("args", {}), dict):
        raise TypeError("command args must be an object")
    return cmd


def command_tensors(cmd: dict) -> list[tuple[str, torch.Tensor]]:
    """`cmd` as the named tensors SGLang carries to every worker: one empty tensor, JSON name."""
    text = json.dumps(cmd, separators=(",", ":"))
    if len(text) > MAX_COMMAND:
        raise ValueError(f"command of {len(text)} characters is too long")
    return [(COMMAND_PREFIX + text, torch.empty(0, dtype=torch.uint8))]


def _parallel_info() -> tuple[int, int, int, int]:
    """(tp_rank, tp_size, pp_rank, pp_size) of this SGLang worker; (0, 1, 0, 1) outside SGLang."""
    try:
        from sglang.srt.distributed import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        pp = get_pp_group()
        return (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(),
                pp.rank_in_group, pp.world_size)
    except (ImportError, AssertionError, AttributeError):
        return 0, 1, 0, 1


def _sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return ""


def _model_dtype(model: torch.nn.Module) -> torch.dtype | None:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def _reference(model: torch.nn.Module, model_path: str | None) -> Any:
    """The engine's tensors in HF terms from the checkpoint's safetensors headers, or None."""
    from vllm_nccl_sync.engine.handshake import checkpoint_reference
    from vllm_nccl_sync.wire.packing import dtype_name

    config = getattr(model, "config", None)
    path = model_path or getattr(config, "_name_or_path", None) or ""
    dtype = _model_dtype(model)
    return checkpoint_reference(path, bool(getattr(config, "tie_word_embeddings", False)),
                                dtype_name(dtype) if dtype is not None else None)


def _state(w: _Worker) -> dict:
    st = w.state
    return {"joined": w.receiver is not None,
            "rank": w.receiver.rank if w.receiver is not None else -1,
            "version": st.version, "consistent": st.consistent, "updates": st.updates,
            "failures": st.failures, "bytes": st.bytes, "last_seconds": st.last_seconds,
            "last_error": st.last_error}


def _close(w: _Worker) -> None:
    if w.receiver is not None:
        try:
            w.receiver.close()
        finally:
            w.receiver = w.loader = None


def run_command(model: torch.nn.Module, cmd: dict) -> dict:
    """Run one command in this worker; returns a JSON-native result (raises on failure)."""
    from vllm_nccl_sync.engine.receiver import ReceiverState

    w = _WORKERS.get(id(model))
    if w is None:
        w = _WORKERS[id(model)] = _Worker(ReceiverState())
    op, args = cmd["op"], cmd.get("args", {})
    if op == "join":
        from vllm_nccl_sync.engine.receiver import Receiver
        from vllm_nccl_sync.wire.config import SyncConfig

        version = _sglang_version()
        if version and not version.startswith(SUPPORTED):
            log.warning("sglang %s is not a tested version (%s)", version, SUPPORTED)
        _close(w)
        cfg = SyncConfig.from_dict(args["cfg"])
        tp_rank, tp_size, pp_rank, pp_size = _parallel_info()
        rank = int(args.get("rank_offset", 1)) + pp_rank * tp_size + tp_rank
        device = (torch.device("cuda", torch.cuda.current_device())
                  if cfg.backend == "nccl" else None)
        w.receiver = Receiver(cfg, rank, replica=0, tp_rank=tp_rank, tp_size=tp_size,
                              device=device, reference=_reference(model, args.get("model_path")),
                              state=w.state)
        w.loader = SGLangWeightLoader(model)
        w.info = {"rank": rank, "replica": 0, "tp_rank": tp_rank, "tp_size": tp_size,
                  "pp_rank": pp_rank, "pp_size": pp_size}
        return dict(w.info)
    if op == "receive":
        if w.receiver is None:
            return {"ok": False, "error": "join has not been run on this worker"}
        return w.receiver.receive(w.loader, args.get("timeout_s"))
    if op == "state":
        return _state(w)
    if op == "param_ptrs":
        from vllm_nccl_sync.glue.vllm_loader import param_pointers

        return param_pointers(model)
    if op == "checksums":
        from vllm_nccl_sync.verify import module_checksums

        tp_rank, tp_size, _, _ = _parallel_info()
        return {"tp_rank": tp_rank, "tp_size": tp_size,
                "params": module_checksums(model, args.get("names"))}
    assert op == "close"
    _close(w)
    return {"closed": True}


def _report(cmd: dict, result: Any) -> None:
    """Write this worker's result where the trainer-side handle reads it (if asked to)."""
    folder, call = cmd.get("report"), cmd.get("call")
    if not folder or not call:
        return
    tp_rank, _, pp_rank, _ = _parallel_info()
    path = os.path.join(folder, f"{call}.pp{pp_rank}.tp{tp_rank}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def load(model: torch.nn.Module, named_tensors: list) -> None:
    """SGLang's custom weight loader: run a command, or load ordinary weights.

    Called by SGLang as `load(model_runner.model, named_tensors)` in every TP worker. Never
    raises for a command (the outcome goes to the report and, for updates, to the trainer).
    """
    named = list(named_tensors)
    try:
        cmd = parse_command(named)
    except (ValueError, TypeError) as e:
        log.error("vllm_nccl_sync: rejected a malformed command: %s", e)
        return
    if cmd is None:
        model.load_weights(named)  # SGLang's default for update_weights_from_tensor
        return
    try:
        result = run_command(model, cmd)
    except Exception as e:  # report, never take the scheduler down
        log.exception("vllm_nccl_sync: command %s failed", cmd.get("op"))
        result = {"ok": False, "error": f"{cmd.get('op')} failed: {e!r}"}
    try:
        _report(cmd, result)
    except OSError:
        log.exception("vllm_nccl_sync: could not write the report of %s", cmd.get("op"))


# ============================================================================== trainer side


class _SGLangHandle:
    """Common part of the handles: commands, report folder, pause bookkeeping."""

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
    """Return once `url/health` answers 200; `TimeoutError` after `timeout_s` (or if `proc` died)."""
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
