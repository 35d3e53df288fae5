"""Engine side, data plane: LoRA adapters received as updates of their own, into vLLM's LoRA
manager, from memory (nothing touches the disk).

An update whose `Plan` names an `AdapterSpec` goes to an `AdapterLoader` instead of the base-weight
loader. It collects the adapter's PEFT-named tensors (checked one by one against the engine's
model as they arrive), and on `finish` either

* replaces the adapter in place when its layout (rank and target modules) is unchanged: the new
  tensors are copied into the adapter's CPU tensors and, when it is active, into its slot of every
  LoRA layer (vLLM's preallocated `lora_a_stacked`/`lora_b_stacked`): nothing is allocated, CUDA
  graphs stay valid; or
* adds it, or re-registers it with a new layout, through vLLM's LoRA manager.

Until the update commits, `abort` restores exactly what was there before (the old tensors, or the
old registration), so a failed adapter update leaves the adapter as it was and base weights are
never touched. Requests name a pushed adapter with `lora_request(name, id)`: its path
`nccl-sync://<name>` tells vLLM to rebuild it from this worker's memory whenever vLLM's own caches
need it again (`patches.lora.serve_from_memory`). Semantics: docs/lora.md.

vLLM is imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_nccl_sync.engine.handshake import Reference
from vllm_nccl_sync.wire.names import split_name
from vllm_nccl_sync.wire.protocol import AdapterSpec


def lora_request(name: str, lora_id: int) -> Any:
    """The `vllm.lora.request.LoRARequest` that names adapter `name`/`lora_id` pushed into the
    engine (its path points at worker memory, not at a file)."""
    from vllm.lora.request import LoRARequest

    from vllm_nccl_sync.integrations.vllm.patches.lora import SCHEME

    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=SCHEME + name)


@dataclass(slots=True)
class HeldAdapter:
    """An adapter this worker holds: what vLLM rebuilds it from."""

    spec: AdapterSpec
    tensors: dict[str, torch.Tensor]
    """PEFT-named tensors on the host, as received."""
    ids: set[int] = field(default_factory=set)
    """Ids vLLM registered it under: the pushed one, and any `vllm serve` gave it."""
    stats: dict[str, int] = field(default_factory=dict)
    """How its last update went in: `in_place` (ids copied into) and `registered` (re-added)."""


class AdapterStore:
    """The adapters one vLLM worker received, by name; makes one `AdapterLoader` per update."""

    def __init__(self, manager: Any, reference: Reference | None) -> None:
        """`manager`: the worker's `WorkerLoRAManager` (see `for_worker`, `for_model`);
        `reference`: the base model's HF tensors, to check adapter shapes against (None: the
        shapes are only checked against the adapter's rank)."""
        from vllm_nccl_sync.integrations.vllm.patches import lora as lora_patch

        lora_patch.check_version()
        if manager is None:
            raise RuntimeError("this engine runs without LoRA (start it with enable_lora=True)")
        self.wm = manager
        self.reference = reference
        self.held: dict[str, HeldAdapter] = {}
        lora_patch.serve_from_memory(self.wm, self._rebuild)

    @classmethod
    def for_worker(cls, worker: Any, reference: Reference | None) -> AdapterStore:
        """The store of a vLLM worker (the worker extension)."""
        from vllm_nccl_sync.integrations.vllm.patches import lora as lora_patch

        return cls(lora_patch.worker_manager(worker), reference)

    @classmethod
    def for_model(cls, model: Any, reference: Reference | None) -> AdapterStore:
        """The store of a weight-transfer engine, which vLLM hands the model only."""
        from vllm_nccl_sync.integrations.vllm.patches import lora as lora_patch

        return cls(lora_patch.manager_of_model(model), reference)

    def _rebuild(self, name: str, lora_id: int) -> Any:
        """vLLM needs adapter `name` under `lora_id` (evicted earlier, or a new id)."""
        from vllm_nccl_sync.integrations.vllm.patches import lora as lora_patch

        held = self.held.get(name)
        if held is None:
            raise ValueError(f"no LoRA adapter {name!r} was pushed into this engine")
        owner = self.owner(lora_id)
        if owner not in (None, name):
            raise ValueError(f"LoRA id {lora_id} already names adapter {owner!r}")
        s = held.spec
        model = lora_patch.build(self.wm, lora_id, _clones(held.tensors),
                                lora_patch.peft_helper(self.wm, s.rank, s.alpha, s.target_modules))
        held.ids.add(lora_id)
        return model

    def owner(self, lora_id: int) -> str | None:
        """Name of the held adapter registered under `lora_id` (None: none of ours)."""
        return next((n for n, h in self.held.items() if lora_id in h.ids), None)

    def loader(self, spec: AdapterSpec) -> AdapterLoader:
        """The `WeightLoader` of one update of adapter `spec` (the receiver's `adapters=`)."""
        return AdapterLoader(self, spec)

    def listing(self) -> dict[str, dict[str, Any]]:
        """Every held adapter: its id, rank, alpha, targets, the ids vLLM registered it under."""
        return {n: {"id": h.spec.id, "rank": h.spec.rank, "alpha": h.spec.alpha,
                    "target_modules": list(h.spec.target_modules), "ids": sorted(h.ids),
                    "tensors": len(h.tensors), "last_update": dict(h.stats)}
                for n, h in self.held.items()}


def _clones(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM scales `lora_B` in place while it merges an adapter: never hand it ours."""
    return {n: t.clone() for n, t in tensors.items()}


class AdapterLoader:
    """`WeightLoader` of one adapter update: `begin`, `load`*, `finish` (applies), `abort` (undoes
    whatever `finish` did, and drops what was received)."""

    def __init__(self, store: AdapterStore, spec: AdapterSpec) -> None:
        self.store = store
        self.spec = spec
        self.incoming: dict[str, torch.Tensor] = {}
        self._helper: Any = None
        self._undo: list[tuple] = []
        self._prev: HeldAdapter | None = None
        self._applied = False
        self.stats: dict[str, int] = {}

    def begin(self) -> None:
        """Check the adapter's config against the engine's LoRA config (rank, features)."""
        from vllm_nccl_sync.integrations.vllm.patches import lora as lora_patch

        s = self.spec
        if s.id < 1:
            raise ValueError(f"adapter {s.name!r}: id {s.id} must be >= 1")
        if not s.name or s.name.startswith("/"):
            raise ValueError(f"adapter name {s.name!r} must be non-empty and not a path")
        self._helper = lora_patch.peft_helper(self.store.wm, s.rank, s.alpha, s.target_modules)
        self.incoming = {}

    def _check(self, name: str, t: torch.Tensor) -> None:
        from vllm_nccl_sync.integrations.vllm.patches import lora as lora_patch

        module, is_a = split_name(name)
        leaf = module.rsplit(".", 1)[-1]
        s = self.spec
        if s.target_modules and leaf not in s.target_modules:
            raise ValueError(f"tensor {name!r}: module {leaf!r} is not among the adapter's "
                             f"target_modules {list(s.target_modules)}")
        allowed = lora_patch.expected_modules(self.store.wm)
        if leaf not in allowed:
            raise ValueError(f"tensor {name!r}: this engine attaches no LoRA to {leaf!r} "
                             f"(it takes {sorted(allowed)})")
        if t.ndim != 2 or t.shape[0 if is_a else 1] != s.rank:
            raise ValueError(f"tensor {name!r}: shape {list(t.shape)} does not have the "
                             f"adapter's rank {s.rank} as its {'first' if is_a else 'second'} "
                             "dimension")
        if self.store.reference is not None:
            reference = self.store.reference
            found = reference.resolve(module + ".weight")
            if found is None:
                raise ValueError(f"tensor {name!r}: the engine's model has no {module!r}")
            out_f, in_f = reference.tensors[found][1]
            want = [s.rank, in_f] if is_a else [out_f, s.rank]
            if list(t.shape) != want:
                raise ValueError(f"tensor {name!r}: shape {list(t.shape)} != {want} "
                                 f"for {module!r} at rank {s.rank}")
        if not t.is_floating_point():
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} is not floating point")

    @torch.no_grad()
    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> set[str]:
        """Check and keep host copies of the tensors; nothing reaches the engine yet."""
        for name, t in named_tensors:
            self._check(name, t)
            if name in self.incoming:
                raise ValueError(f"tensor {name!r} sent twice")
            self.incoming[name] = t.to("cpu", copy=True)
        return set(n for n, _ in named_tensors)

    def finish(self) -> None:
        """Build the adapter (every check that can fail runs here first), then swap it in."""
        from vllm_nccl_sync.integrations.vllm.patches import lora as lora_patch

        wm, s = self.store.wm, self.spec
        modules: dict[str, set[bool]] = {}
        for name in self.incoming:
            module, is_a = split_name(name)
            modules.setdefault(module, set()).add(is_a)
        half = sorted(m for m, kinds in modules.items() if len(kinds) != 2)
        if half:
            raise ValueError(f"adapter {s.name!r}: modules without both lora_A and lora_B: "
                             f"{half[:5]}")
        owner = self.store.owner(s.id)
        if owner not in (None, s.name):
            raise ValueError(f"adapter {s.name!r}: id {s.id} already names adapter {owner!r}")
        if owner is None and lora_patch.registered(wm, s.id) is not None:
            raise ValueError(f"adapter {s.name!r}: id {s.id} is taken by an adapter this engine "
                             "loaded from elsewhere")
        new = lora_patch.build(wm, s.id, _clones(self.incoming), self._helper)
        prev = self.store.held.get(s.name)
        ids = (set(prev.ids) if prev is not None else set()) | {s.id}
        # The pushed id is added if missing; other ids (e.g. `vllm serve`'s) are changed where
        # registered, and otherwise rebuilt from the new tensors when vLLM next needs them.
        targets = {s.id: new}
        for lora_id in sorted(ids - {s.id}):
            if lora_patch.registered(wm, lora_id) is not None:
                targets[lora_id] = lora_patch.build(wm, lora_id, _clones(self.incoming),
                                                   self._helper)
        # Nothing has changed so far; from here on every step is recorded for `abort`.
        self._prev, self._applied = prev, True
        self.store.held[s.name] = HeldAdapter(s, self.incoming, set(ids))
        in_place = swapped = 0
        for lora_id, model in targets.items():
            old = lora_patch.registered(wm, lora_id)
            if old is not None and lora_patch.same_layout(old, model):
                self._undo.append(("copy", lora_id, old, lora_patch.clone_weights(old)))
                lora_patch.copy_weights(old, model)
                slot = lora_patch.slot_of(wm, lora_id)
                if slot is not None:
                    lora_patch.write_slot(wm, slot, old)
                in_place += 1
            else:
                slot = None if old is None else lora_patch.slot_of(wm, lora_id)
                self._undo.append(("swap", lora_id, old, slot))
                lora_patch.reregister(wm, None if old is None else lora_id, model)
                swapped += 1
        self.stats = {"in_place": in_place, "registered": swapped,
                      "tensors": len(self.incoming)}
        self.store.held[s.name].stats = self.stats

    def abort(self) -> None:
        """Undo `finish` (old tensors, slots and registrations back); drop what was received."""
        from vllm_nccl_sync.integrations.vllm.patches import lora as lora_patch

        wm = self.store.wm
        for entry in reversed(self._undo):
            if entry[0] == "copy":
                _, lora_id, live, backup = entry
                lora_patch.copy_weights(live, backup)
                slot = lora_patch.slot_of(wm, lora_id)
                if slot is not None:
                    lora_patch.write_slot(wm, slot, live)
            else:
                _, lora_id, old, slot = entry
                lora_patch.restore(wm, lora_id, old, slot)
        self._undo = []
        if self._applied:
            if self._prev is None:
                self.store.held.pop(self.spec.name, None)
            else:
                self.store.held[self.spec.name] = self._prev
            self._applied = False
        self.incoming = {}
