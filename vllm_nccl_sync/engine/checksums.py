"""What a worker holds, read back: per-parameter sha256 in checkpoint terms, data pointers.

`module_checksums` hashes the parameters as the worker holds them, under the engine's names,
with what `verify.compare` needs to rebuild each one from checkpoint tensors; where those come
from is the framework's knowledge, handed in as a `Layout` (vLLM's:
`integrations.vllm.checksums`). `param_pointers` proves that updates stay in place.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Layout(Protocol):
    """How one model's parameters read in checkpoint terms (made once per `module_checksums`)."""

    def note(self, module: torch.nn.Module, pname: str, p: torch.Tensor) -> str:
        """Why parameter `pname` of `module` cannot be read as checkpoint values ("" if it can)."""
        ...

    def of(self, name: str, p: torch.Tensor) -> dict[str, Any]:
        """What rebuilds parameter `name` from checkpoint tensors: `parts` (the checkpoint
        names concatenated into it, with their alternative spellings) or `experts`."""
        ...


class SameNames:
    """A model whose parameters are the checkpoint's tensors under the same names."""

    def __init__(self, model: torch.nn.Module) -> None:
        pass

    def note(self, module: torch.nn.Module, pname: str, p: torch.Tensor) -> str:
        return ""

    def of(self, name: str, p: torch.Tensor) -> dict[str, Any]:
        return {"parts": [[[name]]]}


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


def _dims(p: torch.Tensor) -> dict[str, int]:
    """The parameter's TP-sharded dims, where its framework marked them on it."""
    return {a: getattr(p, a) for a in ("output_dim", "input_dim")
            if isinstance(getattr(p, a, None), int)}


@torch.no_grad()
def module_checksums(model: torch.nn.Module, names: list[str] | None = None,
                     layout: Callable[[torch.nn.Module], Layout] = SameNames) -> dict[str, dict]:
    """`{name: {dtype, shape, numel, sha256, ...}}` of `model`'s parameters (tied or shared ones
    under each name, with `alias_of` the first), with what `verify.compare` needs to rebuild
    each from checkpoint tensors: `output_dim`/`input_dim` (its TP-sharded dim) and what
    `layout(model)` says (`parts` or `experts`).

    What cannot be read in checkpoint layout gets `sha256 = ""` and a `note` saying why (the
    layout's). `names` limits the work.
    """
    wanted = set(names) if names is not None else None
    out: dict[str, dict] = {}
    cache: dict[tuple[int, int], str] = {}
    layouts = layout(model)
    first: dict[int, str] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            name = f"{mod_name}.{pname}" if mod_name else pname
            if p is None or (wanted is not None and name not in wanted) or p.is_meta:
                continue
            where = {**_dims(p), **layouts.of(name, p)}
            if (canonical := first.setdefault(id(p), name)) != name:
                out[name] = {**out[canonical], **where, "alias_of": canonical}
                continue
            note = layouts.note(module, pname, p)
            key = (p.data_ptr(), p.numel())
            if p.numel() and key not in cache and not note:
                cache[key] = digest(p)
            out[name] = {"dtype": dtype_str(p.dtype), "shape": list(p.shape),
                         "numel": p.numel(), "sha256": cache.get(key, ""),
                         "note": note, **where}
    return out


def param_pointers(model: torch.nn.Module) -> dict[str, int]:
    """data_ptr of every non-empty parameter and buffer of `model` (tied ones under each name)."""
    out = {}
    for kind in (model.named_parameters, model.named_buffers):
        for name, t in kind(remove_duplicate=False):
            if t.numel() > 0 and not t.is_meta:
                out[name] = t.data_ptr()
    return out
