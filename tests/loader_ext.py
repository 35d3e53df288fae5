"""Test-only vLLM worker extension: feeds safetensors files through `VllmWeightLoader`.

Methods are prefixed `nccl_test_` (vLLM asserts that extension names are new to the worker class)
and return msgpack-native values. Each batch is copied into one shared buffer, loaded from views of
it, and the buffer is then overwritten, as a real receive buffer would be.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Any


class LoaderExt:
    """Mixed into vLLM's worker class by `worker_extension_cls="tests.loader_ext.LoaderExt"`."""

    def nccl_test_load_dir(
        self, path: str, n_batches: int = 3, only: list[str] | None = None, abort: bool = False
    ) -> dict[str, Any]:
        """Load the *.safetensors under `path` (only names containing a string of `only`, if given).

        With `abort`, end with `loader.abort()` (as after a failed update) instead of `finish()`."""
        import torch
        from safetensors.torch import load_file

        from vllm_nccl_sync.integrations.vllm.loader import VllmWeightLoader

        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            tensors.update(load_file(f))
        if "lm_head.weight" not in tensors:  # tied: a trainer's state_dict() still holds the alias
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        names = sorted(n for n in tensors if only is None or any(s in n for s in only))
        loader = VllmWeightLoader(self)
        size = max(tensors[n].numel() * tensors[n].element_size() for n in names) * len(names)
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        t0 = time.perf_counter()
        loader.begin()
        t1 = time.perf_counter()
        loaded: set[str] = set()
        per = -(-len(names) // n_batches)
        for b in range(0, len(names), per):
            batch, off = [], 0
            for n in names[b : b + per]:
                t = tensors[n]
                nbytes = t.numel() * t.element_size()
                view = buf[off : off + nbytes].view(t.dtype).view(t.shape)
                view.copy_(t)
                batch.append((n, view))
                off += nbytes
            loaded |= loader.load(batch)
            del batch, view
            buf.fill_(0xFF)  # the "receive buffer" is reused: stale views would now read NaN
        t2 = time.perf_counter()
        loader.abort() if abort else loader.finish()
        t3 = time.perf_counter()
        return {
            "sent": len(names),
            "loaded": len(loaded),
            "stats": loader.stats,
            "begin_ms": round(1e3 * (t1 - t0), 2),
            "load_ms": round(1e3 * (t2 - t1), 2),
            "finish_ms": round(1e3 * (t3 - t2), 2),
        }

    def nccl_test_ptrs(self) -> dict[str, int]:
        """data_ptr of every non-empty parameter and buffer of the model."""
        from vllm_nccl_sync.engine.checksums import param_pointers

        return param_pointers(self.model_runner.model)
