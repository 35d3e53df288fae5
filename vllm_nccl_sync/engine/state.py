"""What a worker holds across updates and re-joins, and where received tensors go."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol

import torch


class WeightLoader(Protocol):
    """Where received tensors go. `load` must not keep references to the tensors it is given.

    A loader may also offer `load_rows(name, rows, first_row, shape) -> bool` (see
    `packing.RowLoader`): then the chunks of a tensor larger than a bucket are loaded as they
    arrive, rows of dim 0 at a time, instead of being reassembled in a staging copy first; it
    answers False at a tensor's first chunk when that tensor cannot be loaded piecewise. And it
    may offer `stats` (a dict of what its last load took), reported in the update's summary,
    and `prepare(named_tensors)`: called with a staged update received beside serving once it
    verified, before any `begin` and while the engine still serves; it may get ready for
    loading those tensors but must not change the model.
    """

    def begin(self) -> None: ...

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> set[str]: ...

    def finish(self) -> None: ...

    def abort(self) -> None: ...


def require_checksums_default() -> bool:
    """The engine-side policy: `VLLM_NCCL_SYNC_REQUIRE_CHECKSUMS` ("1" unless set to "0")."""
    return os.environ.get("VLLM_NCCL_SYNC_REQUIRE_CHECKSUMS", "1") != "0"


def held_weights(version: int) -> str:
    """How a held version reads in a message: -1 is what the engine started with, the weights
    vLLM's `/weight_info` calls "default"."""
    return "the default weights (version -1)" if version < 0 else f"version {version}"


@dataclass(slots=True)
class ReceiverState:
    """What this worker holds and has done; reported by `nccl_sync_state`."""

    version: int = -1
    """Version of the last committed update (-1: the weights the engine started with)."""
    consistent: bool = True
    """False once an update failed after data may have been loaded anywhere: this worker (or a
    peer) may hold tensors of another version than `version`."""
    updates: int = 0
    failures: int = 0
    bytes: int = 0
    last_seconds: float = 0.0
    last_error: str = ""
    adapters: dict[str, int] = field(default_factory=dict)
    """Version of the last committed update of each LoRA adapter, by adapter name."""
