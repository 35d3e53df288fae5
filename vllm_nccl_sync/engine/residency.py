"""Where a model's weights are, as the engine's sleep calls and its other weight calls leave them.

Colocated trainers put the engine to sleep while they step: it may offload the weights to host
memory (restored on waking), discard them (after waking the parameters hold whatever the fresh
allocation holds), zero them, or load them again from the checkpoint. None of these goes through
an update, so the engine's integration records them here (vLLM's sleep levels 1 and 2,
`discard`, `reset_weights` and `reload_weights`: `integrations/vllm/patches/sleep.py`) and
the session reads them:

* weights asleep: an update is refused before any byte moves (writing into unmapped memory
  would take the engine down), and so are checksums;
* weights discarded: the engine reports `consistent: False`, and only an update that rewrites
  every weight may commit (the plan must name every checkpoint tensor, and every parameter
  must be written by the loaders); then it is consistent again;
* weights reloaded from the checkpoint: the engine holds its default weights (version -1).

One record per model object, in the worker's process: both front doors (`Ext`, the `nccl_sync`
backend) see the same one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

import torch

from vllm_nccl_sync.outcomes import Kind, Problem


@dataclass(slots=True)
class Residency:
    """What happened to one model's weights outside any update."""

    asleep: set[str] = field(default_factory=set)
    """vLLM memory tags now released ("weights", "kv_cache")."""
    level: int = 0
    """Level of the last sleep."""
    discarded: str = ""
    """Why the weights are gone ("" while they hold what the last update or load left)."""
    epoch: int = 0
    """Counts events that changed the weights outside an update (a session takes them in once)."""
    reloaded: bool = False
    """The last such event loaded the checkpoint (the default weights, version -1)."""

    def slept(self, level: int) -> None:
        self.level = level
        if level >= 1:
            self.asleep |= {"weights", "kv_cache"}
        if level >= 2:
            self.lost(f"vLLM's sleep(level={level}) discarded the weights")

    def woke(self, tags: list[str] | tuple[str, ...] | None) -> None:
        self.asleep = set() if tags is None else self.asleep - set(tags)

    def lost(self, why: str) -> None:
        self.discarded, self.reloaded = why, False
        self.epoch += 1

    def reloaded_from(self, checkpoint: bool) -> None:
        """`reload_weights` ran: from the model's checkpoint, or from tensors it was given."""
        if checkpoint:
            self.discarded, self.reloaded = "", True
        else:
            self.discarded = self.discarded or (
                "vLLM's reload_weights loaded weights that no update pushed")
            self.reloaded = False
        self.epoch += 1

    def rewritten(self) -> None:
        """An update that rewrote every weight committed."""
        self.discarded = ""

    @property
    def unwritable(self) -> Problem | None:
        """Why nothing may write into the weights now (None if they may be written)."""
        if "weights" in self.asleep:
            return Problem(Kind.RESIDENCY, f"the engine's weights are asleep (vLLM sleep level "
                           f"{self.level}); call wake_up(tags=['weights']) before pushing")
        return None

    def to_dict(self) -> dict[str, object]:
        return {"asleep": sorted(self.asleep), "discarded": self.discarded}


_HELD: WeakKeyDictionary[torch.nn.Module, Residency] = WeakKeyDictionary()


def residency(model: torch.nn.Module) -> Residency:
    """The record of `model` (made empty on first use)."""
    found = _HELD.get(model)
    if found is None:
        found = _HELD[model] = Residency()
    return found
