"""Engine side: where a vLLM model's parameters and buffers live, found once.

A model's modules do not change after start-up, but a parameter may be replaced (a reload wrapper,
a post-load rule): `ModelSlots` walks the modules once and reads what each slot holds every time.
"""

from __future__ import annotations

import torch


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: canonical} for parameters that are the same Parameter as one listed earlier
    (e.g. {"lm_head.weight": "model.embed_tokens.weight"} when embeddings are tied)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if (canonical := first.setdefault(id(p), name)) != name:
            out[name] = canonical
    return out


class ModelSlots:
    """Every parameter and buffer of a model under every name (tied ones under each)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._slots: list[tuple[str, dict, str]] = []
        """(full name, the owning module's `_parameters` or `_buffers`, the name there)"""
        for kind, named in (("p", model.named_parameters), ("b", model.named_buffers)):
            for name, _ in named(remove_duplicate=False):
                prefix, _, leaf = name.rpartition(".")
                owner = model.get_submodule(prefix) if prefix else model
                self._slots.append((name, owner._parameters if kind == "p" else owner._buffers,
                                    leaf))

    def now(self) -> dict[str, torch.Tensor]:
        """What every slot holds now."""
        return {n: held[leaf] for n, held, leaf in self._slots if held.get(leaf) is not None}
