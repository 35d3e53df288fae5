"""Import paths that moved, kept working for a while with a `DeprecationWarning`.

An old path imports as a module holding the new module's public names (the same objects: a
class keeps its new `__module__`, so what is pickled names where it lives now). The table is the
whole list; a path leaves it one release after the move is announced.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

MOVED = {
    "vllm_nccl_sync.glue.weight_transfer": "vllm_nccl_sync.weight_transfer",
    "vllm_nccl_sync.glue.engines": "vllm_nccl_sync.integrations.vllm.handles",
    "vllm_nccl_sync.glue.ext": "vllm_nccl_sync.integrations.vllm.ext",
    "vllm_nccl_sync.glue.lora": "vllm_nccl_sync.integrations.vllm.lora",
    "vllm_nccl_sync.glue.sglang": "vllm_nccl_sync.integrations.sglang",
    "vllm_nccl_sync.glue.verl": "vllm_nccl_sync.integrations.verl",
    "vllm_nccl_sync.testing": "vllm_nccl_sync.tiny",
}
"""Old module path -> where its public names live now."""
PACKAGES = {"vllm_nccl_sync.glue"}
"""Old packages that exist only to hold moved modules."""


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of `MOVED` and `PACKAGES`, and loads them as aliases."""

    def find_spec(self, name: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name not in MOVED and name not in PACKAGES:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=name in PACKAGES)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        new = MOVED.get(module.__name__)
        if new is None:
            module.__path__ = []
            return
        warnings.warn(f"{module.__name__} moved to {new}; import it from there",
                      DeprecationWarning, stacklevel=2)
        target = importlib.import_module(new)
        names = getattr(target, "__all__", None) or [
            n for n in vars(target) if not n.startswith("_")]
        module.__dict__.update({n: getattr(target, n) for n in names})
        module.__all__ = list(names)


def install() -> None:
    """Put the alias finder on `sys.meta_path` once."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
