"""An in-process engine of one worker for tests: the extension's calls mapped onto an
`EngineSession` over a plain module (what `WeightSync` drives through an engine handle)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from vllm_nccl_sync import WeightSync
from vllm_nccl_sync.engine.handshake import Reference
from vllm_nccl_sync.engine.session import EngineSession, Placement
from vllm_nccl_sync.engine.state import WeightLoader
from vllm_nccl_sync.outcomes import CARRY_RPC
from vllm_nccl_sync.wire.config import SyncConfig


class SessionEngine:
    """`call`s reach the session of `model`, loading through `loader(model)`; plans are checked
    against `reference` when given. `pause`/`resume` do nothing (subclasses record them)."""

    workers = 1

    def __init__(self, model: torch.nn.Module,
                 loader: Callable[[torch.nn.Module], WeightLoader],
                 reference: Reference | None = None) -> None:
        self.model = model
        self.session = EngineSession(lambda: self.model, lambda: (0, 1))
        self._loader, self._reference = loader, reference

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        s = self.session
        if method == "nccl_sync_join":
            cfg, offset = args
            s.join(SyncConfig.from_dict(cfg), Placement(offset), lambda: self._loader(self.model),
                   reference=self._reference)
            return [{"rank": offset}]
        if method == "nccl_sync_receive":
            return [s.receive(*args).to_dict()]
        if method == "nccl_sync_receive_beside":
            return [s.receive_beside(*args).to_dict()]
        if method == "nccl_sync_swap":
            return [s.swap(*args).to_dict()]
        if method == CARRY_RPC:  # no engine core here to take it
            return [s.cannot_carry().to_dict()]
        if method == "nccl_sync_state":
            return [s.report()]
        if method == "nccl_sync_close":
            s.close()
            return [None]
        raise ValueError(method)

    def pause(self, mode: str) -> None:
        pass

    def resume(self) -> None:
        pass


@contextmanager
def driven(engine: SessionEngine, timeout_s: float) -> Iterator[WeightSync]:
    """A `WeightSync` over gloo (8 KiB buckets: several per tensor) connected to `engine`."""
    sync = WeightSync([engine], backend="gloo", bucket_bytes=8192, timeout_s=timeout_s)
    sync.connect()
    try:
        yield sync
    finally:
        sync.close()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, bit-equal tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
