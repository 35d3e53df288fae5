"""vLLM's parameters in checkpoint terms, for `engine.checksums.module_checksums`.

`VllmLayout` reads, from the model's own structures, which HF tensors each parameter is made of
(renames, stacked `qkv_proj`/`gate_up_proj`, fused experts) and which parameters vLLM changed after
loading (linears its CPU backend packed, experts a MoE backend re-laid out, block-FP8 scales
DeepGEMM requantized to UE8M0). SGLang's model classes declare the same structures.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_nccl_sync.engine import checksums

_PACKED = "packed by vLLM's CPU backend (its weight is size 0)"
_SHARDS = ("w1", "w3")  # vLLM's shard ids of an expert's gate and up projections, in w13 order


def module_checksums(model: torch.nn.Module, names: list[str] | None = None) -> dict[str, dict]:
    """`engine.checksums.module_checksums` of a vLLM model (`VllmLayout`)."""
    return checksums.module_checksums(model, names, VllmLayout)


def _ue8m0(module: torch.nn.Module) -> bool:
    """A block-FP8 linear whose kernel requantizes weight and scales (DeepGEMM with UE8M0)."""
    kernel = getattr(getattr(module, "quant_method", None), "fp8_linear", None)
    return bool(getattr(kernel, "use_deep_gemm_e8m0", False))


def _relaid(module: torch.nn.Module) -> bool:
    from vllm_nccl_sync.integrations.vllm.patches.postload import relaid_experts

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


class VllmLayout:
    """Where each vLLM parameter's values come from in HF terms, from the model's own structures:
    `hf_to_vllm_mapper` (inverted), `packed_modules_mapping`, its expert mapping; and which
    parameters vLLM changed after loading (a `Layout` of `engine.checksums`)."""

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

    def note(self, module: torch.nn.Module, pname: str, p: torch.Tensor) -> str:
        if p.numel() == 0 and hasattr(module, "cpu_linear"):
            return _PACKED
        if pname in ("w13_weight", "w2_weight") and _relaid(module):
            return "experts re-laid out by vLLM's MoE backend (not readable as checkpoint)"
        if pname in ("weight", "weight_scale_inv") and _ue8m0(module):
            return ("requantized by vLLM's DeepGEMM kernel to power-of-two (UE8M0) block "
                    "scales after loading (not the checkpoint's values)")
        return ""

    def of(self, name: str, p: torch.Tensor) -> dict[str, Any]:
        if (experts := self._experts(name, p)) is not None:
            return {"experts": experts}
        options = [[self.spellings(name)]]
        for stacked, members in self.packed.items():
            if f".{stacked}." in name:
                options.append([self.spellings(name.replace(f".{stacked}.", f".{m}."))
                                for m in members])
        return {"parts": options}

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
