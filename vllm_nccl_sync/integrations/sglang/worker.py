"""SGLang's side of `integrations.sglang`: the custom weight loader that runs commands in each TP
worker.

SGLang calls `load(model_runner.model, named_tensors)` in every TP scheduler process (see
`integrations.sglang`); a command travels as the only named tensor (its name carries JSON, the
tensor is
empty) and runs on that worker's `EngineSession`: `join` (rank `rank_offset + pp_rank * tp +
tp_rank`, plans checked against the checkpoint's safetensors headers), `receive` (through the
model's own `load_weights`, in place), `state`, `adapters`, `param_ptrs`, `checksums`,
`metrics`, `close`. `load` never raises for a command: SGLang calls custom loaders outside any
`try`; each worker writes its result as JSON into the report folder the command names.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from vllm_nccl_sync.engine.handshake import Reference, checkpoint_reference
from vllm_nccl_sync.engine.session import EngineSession, Placement
from vllm_nccl_sync.integrations.vllm.checksums import VllmLayout
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.packing import dtype_name

log = logging.getLogger(__name__)

LOADER = "vllm_nccl_sync.integrations.sglang.load"
"""The import path to give SGLang's `--custom-weight-loader` and use as `load_format`."""
COMMAND_PREFIX = "vllm_nccl_sync:"
"""A named tensor whose name starts with this is a command (the rest of the name is JSON)."""
SUPPORTED = ("0.5.",)
"""SGLang versions (prefixes) whose custom-weight-loader hook this module follows."""
OPS = ("join", "receive", "state", "adapters", "param_ptrs", "checksums", "metrics", "close")
METHODS = {f"nccl_sync_{op}": op for op in OPS}
"""The vLLM extension's RPC names (what `WeightSync` calls) mapped to commands."""
MAX_COMMAND = 64 * 1024

_SESSIONS: dict[int, EngineSession] = {}
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


def _dtype(model: torch.nn.Module) -> str:
    """The wire name of the dtype `model` holds its floating-point weights in ("": none)."""
    return next((dtype_name(p.dtype) for p in model.parameters() if p.is_floating_point()), "")


def _reference(model: torch.nn.Module, model_path: str | None) -> Reference | None:
    """The engine's tensors in HF terms from the checkpoint's safetensors headers, or None."""
    config = getattr(model, "config", None)
    path = model_path or getattr(config, "_name_or_path", None) or ""
    return checkpoint_reference(path, bool(getattr(config, "tie_word_embeddings", False)),
                                _dtype(model) or None)


def _session(model: torch.nn.Module) -> EngineSession:
    """The session of `model`'s worker (made on its first command; outlives re-joins)."""
    session = _SESSIONS.get(id(model))
    if session is None:
        session = _SESSIONS[id(model)] = EngineSession(
            lambda: model, lambda: _parallel_info()[:2], layout=VllmLayout)
    return session


def run_command(model: torch.nn.Module, cmd: dict) -> Any:
    """Run one command in this worker; returns a JSON-native result (raises on failure)."""
    session = _session(model)
    op, args = cmd["op"], cmd.get("args", {})
    if op == "join":
        version = _sglang_version()
        if version and not version.startswith(SUPPORTED):
            log.warning("sglang %s is not a tested version (%s)", version, SUPPORTED)
        cfg = SyncConfig.from_dict(args["cfg"])
        tp_rank, tp_size, pp_rank, pp_size = _parallel_info()
        where = Placement(int(args.get("rank_offset", 1)) + pp_rank * tp_size + tp_rank, 0,
                          tp_rank, tp_size, {"pp_rank": pp_rank, "pp_size": pp_size})
        loader = SGLangWeightLoader(model)
        return session.join(cfg, where, lambda: loader, dtype=_dtype(model),
                            reference=_reference(model, args.get("model_path"))).to_dict()
    if op == "receive":
        return session.receive(args.get("timeout_s")).to_dict()
    if op == "checksums":
        return session.checksums(args.get("names"))
    if op == "close":
        session.close()
        return {"closed": True}
    reports = {"state": session.report, "adapters": session.adapters,
               "param_ptrs": session.param_ptrs, "metrics": session.metrics}
    return reports[op]()


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
