"""Does the engine really hold these weights? Per-tensor sha256, trainer/checkpoint vs engine.

Engine side: `Ext.nccl_sync_checksums(names)` hashes the parameters as the worker holds them
(`module_checksums`), under vLLM's names. Trainer side: `verify(source, engine)` hashes a
safetensors checkpoint directory or live `(name, tensor)` pairs under the HF names and compares.

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
import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

_PACKED = "packed by vLLM's CPU backend (its weight is size 0)"
_SHARDS = ("w1", "w3")  # vLLM's shard ids of an expert's gate and up projections, in w13 order


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
    """`{name: {dtype, shape, numel, sha256, ...}}` of `model`'s parameters (tied or shared ones
    under each name, with `alias_of` the first), with what `compare` needs to rebuild each from checkpoint tensors: `parts` (the HF
    names concatenated into it, with their alternative spellings), `output_dim`/`input_dim` (its
    TP-sharded dim), `experts` (for fused expert weights).

    What cannot be read in checkpoint layout gets `sha256 = ""` and a `note` saying why: a linear
    weight vLLM's CPU backend packed away (size 0), experts a MoE backend re-laid out. `names`
    limits the work.
    """
    wanted = set(names) if names is not None else None
    out: dict[str, dict] = {}
    cache: dict[tuple[int, int], str] = {}
    layouts = _Layouts(model)
    first: dict[int, str] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            name = f"{mod_name}.{pname}" if mod_name else pname
            if p is None or (wanted is not None and name not in wanted) or p.is_meta:
                continue
            if (canonical := first.setdefault(id(p), name)) != name:
                out[name] = {**out[canonical], **layouts.of(name, p), "alias_of": canonical}
                continue
            note = ""
            if p.numel() == 0 and hasattr(module, "cpu_linear"):
                note = _PACKED
            elif pname in ("w13_weight", "w2_weight") and _relaid(module):
                note = "experts re-laid out by vLLM's MoE backend (not readable as checkpoint)"
            elif pname in ("weight", "weight_scale_inv") and _ue8m0(module):
                note = ("requantized by vLLM's DeepGEMM kernel to power-of-two (UE8M0) block "
                        "scales after loading (not the checkpoint's values)")
            key = (p.data_ptr(), p.numel())
            if p.numel() and key not in cache and not note:
                cache[key] = digest(p)
            out[name] = {"dtype": _dtype_name(p.dtype), "shape": list(p.shape),
                         "numel": p.numel(), "sha256": cache.get(key, ""),
                         "note": note, **layouts.of(name, p)}
    return out


def _ue8m0(module: torch.nn.Module) -> bool:
    """A block-FP8 linear whose kernel requantizes weight and scales (DeepGEMM with UE8M0)."""
    kernel = getattr(getattr(module, "quant_method", None), "fp8_linear", None)
    return bool(getattr(kernel, "use_deep_gemm_e8m0", False))


def _relaid(module: torch.nn.Module) -> bool:
    from vllm_nccl_sync.patches.vllm_postload import relaid_experts

    return relaid_experts(module) is not None


def packed_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """The model's `packed_modules_mapping` merged with its direct children's, as vLLM resolves
    it (`vllm.model_executor.utils.get_packed_modules_mapping`): a VLM may declare none (an empty
    one from `SupportsLoRA`) while its language model declares `qkv_proj`/`gate_up_proj`."""
    own = dict(getattr(model, "packed_modules_mapping", None) or {})
    for child in model.children():
        for stacked, members in (getattr(child, "packed_modules_mapping", None) or {}).items():
            own.setdefault(stacked, list(members))
    return own


class _Layouts:
    """Where each vLLM parameter's values come from in HF terms, from the model's own structures:
    `hf_to_vllm_mapper` (inverted), `packed_modules_mapping`, its expert mapping."""

    def __init__(self, model: torch.nn.Module) -> None:
        mapper = getattr(type(model), "hf_to_vllm_mapper", None)
        self.renames: list[tuple[str, str, str]] = []  # (kind, vLLM spelling, HF spelling)
        for kind in ("prefix", "substr", "suffix"):
            for orig, new in (getattr(mapper, f"orig_to_new_{kind}", None) or {}).items():
                if new:
                    self.renames.append((kind, new, orig))
        self.packed = packed_modules(model)
        self.expert_map: list[tuple[str, str, int, str]] = []
        for holder in (model, getattr(model, "model", None)):
            get = getattr(holder, "get_expert_mapping", None)
            if callable(get):
                try:
                    self.expert_map = [m for m in get() if m[1].endswith("_proj.")]
                except Exception:  # noqa: BLE001 - then the conventional names are used
                    self.expert_map = []
                break

    def spellings(self, name: str) -> list[str]:
        """`name` and every HF name the model's mapper would turn into it."""
        out = [name]
        for kind, new, orig in self.renames:
            if kind == "prefix" and name.startswith(new):
                out.append(orig + name[len(new):])
            elif kind == "suffix" and name.endswith(new):
                out.append(name[: -len(new)] + orig)
            elif kind == "substr" and new in name:
                out.append(name.replace(new, orig))
        return list(dict.fromkeys(out))

    def of(self, name: str, p: torch.Tensor) -> dict[str, Any]:
        info: dict[str, Any] = {}
        for attr in ("output_dim", "input_dim"):
            if isinstance(getattr(p, attr, None), int):
                info[attr] = getattr(p, attr)
        if (experts := self._experts(name, p)) is not None:
            info["experts"] = experts
            return info
        options = [[self.spellings(name)]]
        for stacked, members in self.packed.items():
            if f".{stacked}." in name:
                options.append([self.spellings(name.replace(f".{stacked}.", f".{m}."))
                                for m in members])
        info["parts"] = options
        return info

    def _experts(self, name: str, p: torch.Tensor) -> list[list[str]] | None:
        """Per expert and shard (w13: gate then up), the HF names of a fused expert weight."""
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in ("w13_weight", "w2_weight") or p.dim() != 3:
            return None
        if self.expert_map:
            rows = sorted((e, _SHARDS.index(s) if s in _SHARDS else 0, name.replace(pn, wn))
                          for pn, wn, e, s in self.expert_map
                          if pn in name and (s == "w2") == (leaf == "w2_weight"))
            if rows:
                return [self.spellings(hf) for _, _, hf in rows]
        base = name[: -len(leaf)].replace(".routed_experts.", ".")
        projs = ([("gate_proj", "w1"), ("up_proj", "w3")] if leaf == "w13_weight"
                 else [("down_proj", "w2")])
        return [self.spellings(f"{base}{e}.{hf}.weight") + self.spellings(f"{base}{e}.{alt}.weight")
                for e in range(p.shape[0]) for hf, alt in projs]


# --------------------------------------------------------------------------- trainer side


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
            return None, f"dtype {_dtype_name(tensors[0].dtype)} vs engine's {dtype}"
        note = f" (after casting {_dtype_name(tensors[0].dtype)} to {dtype})"
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

