"""Weight loaders for plain `torch.nn.Module`s (trainer-side checks, tests, benchmarks).

The vLLM loader, which goes through vLLM's own weight loaders, is `vllm_loader.VllmWeightLoader`.
"""

from __future__ import annotations

import torch

from vllm_nccl_sync.wire.taps import copies_tapped, copy_tapped


class ModuleLoader:
    """Copies HF-named tensors into a module's parameters and buffers, in place.

    Copies are issued on the current stream, so on CUDA a receive buffer refilled later on that
    stream is never overwritten before these copies have read it.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.targets: dict[str, torch.Tensor] = dict(
            module.named_parameters(remove_duplicate=False))
        self.targets.update(module.named_buffers(remove_duplicate=False))
        self.params = dict(module.named_parameters())
        self.loaded: set[str] = set()

    def begin(self) -> None:
        self.loaded = set()

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> set[str]:
        """Every tensor checked first (a bad one: nothing of the batch is copied), then copied
        in one call; tensors the receiver checksums (`taps.tapping`) are copied summing."""
        pairs = [(self._target(name, t), t) for name, t in named_tensors]
        with torch.no_grad():
            pairs = copies_tapped(pairs)
            if pairs:
                torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs],
                                     non_blocking=True)
        done = {name for name, _ in named_tensors}
        self.loaded |= done
        return done

    def _target(self, name: str, t: torch.Tensor) -> torch.Tensor:
        target = self.targets.get(name)
        if target is None:
            raise KeyError(f"tensor {name!r} is not a parameter or buffer of the model")
        if target.shape != t.shape:
            raise ValueError(f"tensor {name!r}: shape {list(t.shape)} != model's "
                             f"{list(target.shape)}")
        return target

    def load_rows(self, name: str, rows: torch.Tensor, first_row: int, shape: list[int]) -> bool:
        """Copy whole rows of dim 0 of tensor `name` in place (a chunk of a tensor larger than a
        bucket: no staging copy); False if the target is not a contiguous tensor of `shape`."""
        target = self.targets.get(name)
        if target is None or list(target.shape) != shape or not target.is_contiguous():
            return False
        dst = target[first_row : first_row + rows.shape[0]]
        with torch.no_grad():
            copy_tapped(dst, rows)
        if first_row + rows.shape[0] == shape[0]:
            self.loaded.add(name)
        return True

    def unwritten(self) -> list[str]:
        """The module's parameters this update loaded nothing into (a tied alias counts)."""
        written = {id(self.targets[n]) for n in self.loaded}
        return [n for n, p in self.params.items() if id(p) not in written]

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass
