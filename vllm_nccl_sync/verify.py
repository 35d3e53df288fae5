"""Does the engine really hold these weights? Per-tensor sha256, trainer/checkpoint vs engine.

Engine side: `Ext.nccl_sync_checksums(names)` hashes the parameters as the worker holds them
(`module_checksums`), under vLLM's names. Trainer side: `verify(source, engine)` hashes a
safetensors checkpoint directory or live `(name, tensor)` pairs under the HF names and compares.

Not everything the trainer sends can be compared to what vLLM keeps, and the report says so per
tensor instead of guessing:

* equal names and shapes: compared byte for byte (a floating tensor of another dtype is cast to the
  engine's dtype first, exactly as loading does);
* vLLM's stacked parameters (`qkv_proj` = q, k, v; `gate_up_proj` = gate, up): compared as the
  concatenation of their parts when the engine runs one TP rank;
* **not comparable**, with the reason: a weight vLLM's CPU backend packed for its GEMM kernels (its
  `weight` is size 0 after start-up; on the CPU backend this is every linear layer), a TP shard or
  padded tensor (shape differs), a stacked parameter under TP > 1, a name the engine does not have.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM parameter -> the HF parameters concatenated (along dim 0) into it."""
_PART_OF = {part: stacked for stacked, parts in STACKED.items() for part in parts}
_PACKED = "packed by vLLM's CPU backend (its weight is size 0)"


def _bytes(t: torch.Tensor):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


def digest(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' bytes, one after the other (row-major: a dim-0 concatenation)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(memoryview(_bytes(t)))
    return h.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@torch.no_grad()
def module_checksums(model: torch.nn.Module, names: list[str] | None = None) -> dict[str, dict]:
    """`{name: {dtype, shape, numel, sha256}}` of `model`'s parameters (tied ones under each name).

    Size-0 parameters (vLLM CPU's packed linears) get `sha256 = ""`. `names` limits the work.
    """
    wanted = set(names) if names is not None else None
    out: dict[str, dict] = {}
    cache: dict[tuple[int, int], str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if (wanted is not None and name not in wanted) or p.is_meta:
            continue
        key = (p.data_ptr(), p.numel())
        if p.numel() and key not in cache:
            cache[key] = digest(p)
        out[name] = {"dtype": _dtype_name(p.dtype), "shape": list(p.shape), "numel": p.numel(),
                     "sha256": cache.get(key, "") if p.numel() else ""}
    return out


# --------------------------------------------------------------------------- trainer side


def checkpoint_tensors(path: str) -> dict[str, Callable[[], torch.Tensor]]:
    """Lazy `{name: () -> tensor}` over a safetensors file or every `*.safetensors` in a dir."""
    from safetensors import safe_open

    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {path}")
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for f in files:
        handle = safe_open(f, framework="pt")
        for name in handle.keys():
            out[name] = lambda h=handle, n=name: h.get_tensor(n)
    return out


def _source(source: Any) -> dict[str, Callable[[], torch.Tensor]]:
    if isinstance(source, (str, os.PathLike)):
        return checkpoint_tensors(os.fspath(source))
    items = source.items() if isinstance(source, Mapping) else source
    return {n: (lambda t=t: t) for n, t in items}


@dataclass(slots=True)
class Entry:
    """One source tensor on one worker."""

    name: str
    worker: int
    status: str
    """`match`, `mismatch` or `not_comparable`."""
    detail: str = ""


@dataclass(slots=True)
class VerifyReport:
    entries: list[Entry] = field(default_factory=list)
    engine_only: list[str] = field(default_factory=list)
    """Engine parameters (worker 0) that no source tensor maps to."""

    def count(self, status: str) -> int:
        return sum(e.status == status for e in self.entries)

    @property
    def ok(self) -> bool:
        """Every comparable tensor matched, and at least one was compared."""
        return self.count("mismatch") == 0 and self.count("match") > 0

    def summary(self) -> str:
        return (f"{self.count('match')} match, {self.count('mismatch')} MISMATCH, "
                f"{self.count('not_comparable')} not comparable "
                f"({len({e.worker for e in self.entries})} worker(s)); "
                f"{len(self.engine_only)} engine parameters without a source tensor")

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "summary": self.summary(),
                "counts": {s: self.count(s) for s in ("match", "mismatch", "not_comparable")},
                "entries": [{"name": e.name, "worker": e.worker, "status": e.status,
                             "detail": e.detail} for e in self.entries],
                "engine_only": self.engine_only}


def _expected(tensors: list[torch.Tensor], dtype: str) -> tuple[str | None, str]:
    """sha256 of `tensors` as the engine would hold them in `dtype`, or (None, why not)."""
    target = getattr(torch, dtype, None)
    note = ""
    if any(t.dtype != target for t in tensors):
        if target is None or not all(t.is_floating_point() for t in tensors) \
                or not target.is_floating_point:
            return None, f"dtype {_dtype_name(tensors[0].dtype)} vs engine's {dtype}"
        note = f" (after casting {_dtype_name(tensors[0].dtype)} to {dtype})"
        tensors = [t.to(target) for t in tensors]
    return digest(*tensors), note


def compare(source: Any, workers: list[dict]) -> VerifyReport:
    """Compare `source` (checkpoint path, dict or `(name, tensor)` pairs) with each worker's
    `nccl_sync_checksums()` result."""
    src = _source(source)
    report = VerifyReport()
    covered: set[str] = set()
    for w, result in enumerate(workers):
        params: dict[str, dict] = result["params"]
        tp = int(result.get("tp_size", 1))
        group_done: dict[str, tuple[str, str]] = {}
        for name in sorted(src):
            p = params.get(name)
            if p is not None:
                covered.add(name)
                t = src[name]()
                if p["numel"] == 0 and t.numel() > 0:
                    report.entries.append(Entry(name, w, "not_comparable", _PACKED))
                elif list(t.shape) != p["shape"]:
                    report.entries.append(Entry(name, w, "not_comparable",
                                                f"engine holds shape {p['shape']}, source "
                                                f"{list(t.shape)} (TP shard or padding)"))
                else:
                    want, note = _expected([t], p["dtype"])
                    status = ("not_comparable" if want is None
                              else "match" if want == p["sha256"] else "mismatch")
                    report.entries.append(Entry(name, w, status, note))
                continue
            report.entries.append(Entry(name, w, *_stacked(name, src, params, tp, group_done,
                                                           covered)))
        if w == 0:
            report.engine_only = sorted(set(params) - covered)
    return report


def _stacked(name: str, src: dict, params: dict, tp: int, done: dict,
             covered: set[str]) -> tuple[str, str]:
    """(status, detail) of HF `name` that vLLM holds inside a stacked parameter, if it does."""
    parts = name.split(".")
    stacked_name = None
    for i, part in enumerate(parts):
        if part in _PART_OF:
            stacked_parts = STACKED[_PART_OF[part]]
            members = [".".join(parts[:i] + [m] + parts[i + 1:]) for m in stacked_parts]
            stacked_name = ".".join(parts[:i] + [_PART_OF[part]] + parts[i + 1:])
            break
    if stacked_name is None or stacked_name not in params:
        return "not_comparable", "the engine has no parameter of this name"
    covered.add(stacked_name)
    if stacked_name in done:
        return done[stacked_name]
    p = params[stacked_name]
    where = f"as part of {stacked_name}"
    missing = [m for m in members if m not in src]
    if p["numel"] == 0:
        out = ("not_comparable", f"{where}: {_PACKED}")
    elif tp > 1:
        out = ("not_comparable", f"{where}: sharded across {tp} TP ranks")
    elif missing:
        out = ("not_comparable", f"{where}: the source lacks {missing}")
    else:
        tensors = [src[m]() for m in members]
        shape = [sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]]
        if shape != p["shape"]:
            out = ("not_comparable", f"{where}: engine shape {p['shape']} != stacked {shape}")
        else:
            want, note = _expected(tensors, p["dtype"])
            if want is None:
                out = ("not_comparable", f"{where}: {note}")
            else:
                out = ("match" if want == p["sha256"] else "mismatch", where + note)
    done[stacked_name] = out
    return out


def verify(source: Any, engine: Any, names: list[str] | None = None,
           timeout: float | None = 300.0) -> VerifyReport:
    """Compare `source` with what `engine` (an `engines` handle: `LLMHandle`, `AsyncLLMHandle`,
    `HTTPHandle`) holds, through its workers' `nccl_sync_checksums` RPC."""
    results = engine.call("nccl_sync_checksums", names, timeout=timeout)
    return compare(source, results)

