"""Does the engine really hold these weights? Per-tensor sha256, trainer/checkpoint vs engine.

Engine side: `nccl_sync_checksums(names)` hashes the parameters as the worker holds them
(`integrations.vllm.checksums.module_checksums`, re-exported here), under the engine's names. This
side:
`verify(source, engine)` hashes a safetensors checkpoint directory or live `(name, tensor)` pairs
under the HF names and compares.

Every engine parameter is rebuilt from the source tensors it is made of, the way vLLM's loaders
lay them out, using the model's own structures (reported by the engine with its checksums): its
`hf_to_vllm_mapper` (e.g. a VLM's `model.language_model.*`), `packed_modules_mapping` (`qkv_proj`
= q, k, v; `gate_up_proj` = gate, up; or the fused tensor itself, as Phi-3 ships it), its expert
mapping (`w13` = gate, up per expert; `w2` = down), this worker's TP shard, and vocabulary
padding (zeros). A floating source of another dtype is cast to the engine's dtype first, exactly
as loading does. On GPU every parameter is compared this way.

What cannot be compared is reported per tensor with the reason, never guessed: a linear weight
vLLM's CPU backend packed for its GEMM kernels (size 0 after start-up: every linear on CPU; its
kernel does not give it back reproducibly), experts a backend re-laid out (vLLM's CPU MoE
pre-packing), block-FP8 weights and scales DeepGEMM requantized to UE8M0 scales (Hopper and
later), fused experts under TP, a name the engine does not have.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_nccl_sync.engine.checksums import digest, dtype_str
from vllm_nccl_sync.integrations.vllm.checksums import module_checksums  # noqa: F401


def checkpoint_tensors(path: str) -> dict[str, Callable[[], torch.Tensor]]:
    """Lazy `{name: () -> tensor}` over a safetensors file or every `*.safetensors` in a dir."""
    from safetensors import safe_open

    if os.path.isfile(path):
        files = [path]
    else:
        from vllm_nccl_sync.engine.handshake import local_model_dir

        path = local_model_dir(path) or path  # a model id in the local hub cache
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
            return None, f"dtype {dtype_str(tensors[0].dtype)} vs engine's {dtype}"
        note = f" (after casting {dtype_str(tensors[0].dtype)} to {dtype})"
        tensors = [t.to(target) for t in tensors]
    return digest(*tensors), note


def compare(source: Any, workers: list[dict]) -> VerifyReport:
    """Compare `source` (checkpoint path, dict or `(name, tensor)` pairs) with each worker's
    `nccl_sync_checksums()` result: every engine parameter is rebuilt from the source tensors it
    is made of (stacked parts, experts, this worker's TP shard, vocabulary padding) and hashed."""
    src = _source(source)
    report = VerifyReport()
    for w, result in enumerate(workers):
        params: dict[str, dict] = result["params"]
        tp, rank = int(result.get("tp_size", 1)), int(result.get("tp_rank", 0))
        status_of: dict[str, tuple[str, str]] = {}
        engine_only = []
        for pname, p in sorted(params.items()):
            names, missing = _sources(p, src)
            if not names:
                if "alias_of" not in p:  # a module reachable under two names (tied or shared)
                    engine_only.append(pname)
                continue
            if missing:
                st = ("not_comparable", f"as part of {pname}: the source lacks {missing[:3]}")
            else:
                st = _check(pname, p, [src[n]() for n in names], tp, rank)
            for n in names:
                status_of.setdefault(n, st)
        for name in sorted(src):
            status, detail = status_of.get(
                name, ("not_comparable", "the engine has no parameter of this name"))
            report.entries.append(Entry(name, w, status, detail))
        if w == 0:
            report.engine_only = engine_only
    return report


def _sources(p: dict, src: dict) -> tuple[list[str], list[str]]:
    """(source names that make up engine parameter `p`, in order; names it lacks)."""
    if "experts" in p:
        rows = p["experts"]
        found = [next((n for n in row if n in src), None) for row in rows]
        names = [n for n in found if n is not None]
        return names, ([row[0] for row, n in zip(rows, found) if n is None] if names else [])
    best: tuple[list[str], list[str]] = ([], [])
    for option in p.get("parts", []):
        found = [next((n for n in part if n in src), None) for part in option]
        names = [n for n in found if n is not None]
        missing = [part[0] for part, n in zip(option, found) if n is None]
        if names and not missing:
            return names, []
        if names and not best[0]:
            best = (names, missing)
    return best


def _shard(t: torch.Tensor, dim: int, size: int, tp: int, rank: int) -> torch.Tensor | None:
    """This rank's `size` entries of `t` along `dim`: an even TP shard, or one of a tensor
    zero-padded to `size * tp` (vLLM's vocabulary padding); None if neither fits."""
    full = t.shape[dim]
    if size * tp < full:
        return None
    if size * tp > full:
        pad = list(t.shape)
        pad[dim] = size * tp - full
        t = torch.cat([t, t.new_zeros(pad)], dim)
    return t.narrow(dim, rank * size, size)


def _check(pname: str, p: dict, tensors: list[torch.Tensor], tp: int, rank: int
           ) -> tuple[str, str]:
    """(status, detail) of engine parameter `p` against the source tensors it is made of."""
    where = f"as part of {pname}" if len(tensors) > 1 else ""

    def said(detail: str) -> str:
        return f"{where}: {detail}" if where and detail else where or detail

    if not p["sha256"]:
        return "not_comparable", said(p.get("note") or "the engine holds it empty")
    shape = list(p["shape"])
    if "experts" in p:
        per = [list(t.shape) for t in tensors[: max(1, len(tensors) // shape[0])]]
        full = [shape[0], sum(s[0] for s in per), *per[0][1:]]
        if full != shape:
            return "not_comparable", said(f"engine shape {shape} != experts {full} (TP shard)")
    else:
        full = [sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]]
        dims = [d for d in range(len(shape)) if len(full) == len(shape) and full[d] != shape[d]]
        if len(full) != len(shape) or len(dims) > 1 or (dims and len(tensors) > 1 and dims[0]):
            return "not_comparable", said(f"engine holds shape {shape}, source {full}")
        if dims:
            d = dims[0]
            sizes = ([t.shape[d] * shape[d] // full[d] for t in tensors] if len(tensors) > 1
                     else [shape[d]])
            cut = [_shard(t, d, n, tp, rank) for t, n in zip(tensors, sizes)]
            if any(c is None for c in cut) or sum(c.shape[d] for c in cut) != shape[d]:
                return "not_comparable", said(f"engine holds shape {shape}, source {full}")
            tensors = cut
            where = (where + " " if where else "") + (
                f"(TP shard {rank}/{tp})" if tp > 1 else "(padded)")
    want, note = _expected(tensors, p["dtype"])
    if want is None:
        return "not_comparable", said(note)
    return ("match" if want == p["sha256"] else "mismatch"), where + note


def verify(source: Any, engine: Any, names: list[str] | None = None,
           timeout: float | None = 300.0) -> VerifyReport:
    """Compare `source` with what `engine` (an `engines` handle: `LLMHandle`, `AsyncLLMHandle`,
    `HTTPHandle`) holds, through its workers' `nccl_sync_checksums` RPC."""
    results = engine.call("nccl_sync_checksums", names, timeout=timeout)
    return compare(source, results)

