"""What a worker holds, read back: per-parameter sha256 in checkpoint terms, data pointers.

`module_checksums` hashes the parameters as the worker holds them, under the engine's names,
with what `verify.compare` needs to rebuild each one from checkpoint tensors (its parts, its
TP-sharded dim, its experts); `param_pointers` proves that updates stay in place.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

_PACKED = "packed by vLLM's CPU backend (its weight is size 0)"
_SHARDS = ("w1", "w3")  # vLLM's shard ids of an expert's gate and up projections, in w13 order


def _bytes(t: torch.Tensor) -> Any:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


def digest(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' bytes, one after the other (row-major: a dim-0 concatenation)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(memoryview(_bytes(t)))
    return h.hexdigest()


def dtype_str(dtype: torch.dtype) -> str:
    """`dtype` without its `torch.` prefix (any dtype, unlike the wire's `dtype_name`)."""
    return str(dtype).removeprefix("torch.")


@torch.no_grad()
def module_checksums(model: torch.nn.Module, names: list[str] | None = None) -> dict[str, dict]:
    """`{name: {dtype, shape, numel, sha256, ...}}` of `model`'s parameters (tied or shared ones
    under each name, with `alias_of` the first), with what `verify.compare` needs to rebuild
    each from checkpoint tensors: `parts` (the HF names concatenated into it, with their
    alternative spellings), `output_dim`/`input_dim` (its TP-sharded dim), `experts` (for fused
    expert weights).

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
            out[name] = {"dtype": dtype_str(p.dtype), "shape": list(p.shape),
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


def param_pointers(model: torch.nn.Module) -> dict[str, int]:
    """data_ptr of every non-empty parameter and buffer of `model` (tied ones under each name)."""
    out = {}
    for kind in (model.named_parameters, model.named_buffers):
        for name, t in kind(remove_duplicate=False):
            if t.numel() > 0 and not t.is_meta:
                out[name] = t.data_ptr()
    return out
