"""One engine worker's side of the transfer group, behind every front door.

The vLLM worker extension (`integrations.vllm.ext.Ext`), vLLM's weight-transfer engine `nccl_sync`
(`integrations.vllm.transfer.engine`) and SGLang's custom loader (`integrations.sglang`) are thin
adapters over one
`EngineSession`: it joins (and re-joins) the trainer's group, keeps what outlives a re-join (the
versions held, consistency, counters, the LoRA adapters pushed), receives updates into the
engine's loader, and reports state, adapters, checksums, parameter pointers and metrics. What is
engine-specific comes from the front door: the live model, its tensor-parallel position, the
adapter store, and at each join where the worker sits, its loader, reference and dtype. What
vLLM's sleep mode did to the weights meanwhile (`engine.residency`) is taken in before each
report and update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vllm_nccl_sync.engine.checksums import Layout, SameNames, module_checksums, param_pointers
from vllm_nccl_sync.engine.handshake import Reference
from vllm_nccl_sync.engine.metrics import export_state, prometheus_text
from vllm_nccl_sync.engine.receiver import Receiver
from vllm_nccl_sync.engine.residency import Residency, residency
from vllm_nccl_sync.engine.shadow import BesideReceive, Shadow
from vllm_nccl_sync.engine.state import ReceiverState, WeightLoader
from vllm_nccl_sync.outcomes import CARRY_UNSUPPORTED, WorkerSummary
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.protocol import AdapterSpec, ReadSet


class Adapters(Protocol):
    """The LoRA adapters one worker holds (e.g. `integrations.vllm.lora.AdapterStore`)."""

    def loader(self, spec: AdapterSpec) -> WeightLoader: ...

    def listing(self) -> dict[str, dict[str, Any]]: ...


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one worker sits in the transfer group and in its engine."""

    rank: int
    """Rank in the transfer group (0 is the trainer)."""
    replica: int = 0
    """Data-parallel index of this worker's engine."""
    tp_rank: int = 0
    tp_size: int = 1
    details: dict[str, Any] = field(default_factory=dict)
    """What the front door reports with it (e.g. `host`, `pp_rank`)."""

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "replica": self.replica, "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, **self.details}


class EngineSession:
    """One worker's session: `join`, `receive`, `report`, `adapters`, `checksums`,
    `param_ptrs`, `metrics`, `close`. Failures of an update are reported, never raised.

    `model` returns the live model; `parallel` its `(tp_rank, tp_size)`; `adapters` makes the
    worker's adapter store (at the first join, kept across re-joins; None: the engine takes no
    LoRA adapters); `layout` reads the model's parameters in checkpoint terms for `checksums`
    (the framework's, e.g. `integrations.vllm.checksums.VllmLayout`).
    """

    def __init__(self, model: Callable[[], torch.nn.Module],
                 parallel: Callable[[], tuple[int, int]],
                 adapters: Callable[[], Adapters] | None = None,
                 layout: Callable[[torch.nn.Module], Layout] = SameNames) -> None:
        self.state = ReceiverState()
        """What the worker holds: outlives re-joins."""
        self.receiver: Receiver | None = None
        self.placement: Placement | None = None
        self.loaders: Callable[[], WeightLoader] | None = None
        """The loader of the next update (asked at each update: the model may change)."""
        self._model = model
        self._parallel = parallel
        self._make_adapters = adapters
        self._layout = layout
        self._adapters: Adapters | None = None
        self._beside: BesideReceive | None = None
        self._shadow: Shadow | None = None
        self._epoch = 0  # the last residency event taken into `state`

    def residency(self) -> Residency:
        """What vLLM's sleep mode and weight calls did to the model, taken into `state` once
        per event: discarded weights are inconsistent until an update rewrites them all, a
        reload from the checkpoint holds the default weights (version -1)."""
        r = residency(self._model())
        if r.epoch != self._epoch:
            self._epoch = r.epoch
            st = self.state
            if r.discarded:
                st.consistent, st.last_error = False, r.discarded
            elif r.reloaded:
                st.version, st.consistent = -1, True
        return r

    def join(self, cfg: SyncConfig, where: Placement, loaders: Callable[[], WeightLoader], *,
             reference: Reference | None = None, dtype: str = "",
             device: torch.device | None = None,
             reads: Callable[[], ReadSet] | None = None) -> Placement:
        """Join the trainer's group as `where.rank`, leaving the group held before; blocks until
        the trainer's `PushClient.connect()` meets it (at most `cfg.timeout_s`).

        `loaders` gives the loader of each update (asked once here, so that a model it cannot
        update is refused now, saying why); `reference` is the engine's tensors that plans are
        checked against; `dtype` its floating-point weight dtype (a wire dtype name, "" if not
        known); `device` the worker's device (the NCCL data plane uses it); `reads` this
        worker's read set, published to the trainer when `cfg.shard` (`ValueError` saying why
        when there is none). Raises what joining raises (`TimeoutError` naming the trainer's
        address, ...).
        """
        self._refuse_while_beside("join")
        self.close()
        loaders()
        read_set = _read_set(reads) if cfg.shard else None
        if self._make_adapters is not None and self._adapters is None:
            self._adapters = self._make_adapters()
        self.receiver = Receiver(
            cfg, where.rank, replica=where.replica, tp_rank=where.tp_rank, tp_size=where.tp_size,
            device=device, reference=reference, state=self.state, dtype=dtype,
            adapters=self._adapters.loader if self._adapters is not None else None,
            residency=self.residency, reads=read_set)
        self.placement, self.loaders = where, loaders
        return where

    @property
    def joined(self) -> bool:
        return self.receiver is not None

    def _not_ready(self) -> WorkerSummary | None:
        """Why no update can be received now (None: one can)."""
        self.residency()
        why = ("this worker has not joined a trainer (join first)" if self.receiver is None
               else "an update is being received beside serving (swap it first)"
               if self._receiving_beside else "")
        return None if not why else WorkerSummary(
            ok=False, rank=self.receiver.rank if self.receiver else -1,
            version=self.state.version, consistent=self.state.consistent, error=why)

    @property
    def _receiving_beside(self) -> bool:
        return self._beside is not None and self._beside.running

    def _refuse_while_beside(self, what: str) -> None:
        if self._receiving_beside:
            raise RuntimeError(f"cannot {what} while an update is received beside serving "
                               "(swap it first)")

    def receive(self, timeout_s: float | None = None) -> WorkerSummary:
        """Receive one update (call while the trainer pushes); `timeout_s` bounds the wait for
        it to start. Returns this worker's summary, ok or not."""
        if (refused := self._not_ready()) is not None:
            return refused
        assert self.receiver is not None and self.loaders is not None
        return self.receiver.run(self.loaders(), timeout_s)

    def receive_beside(self, timeout_s: float | None = None, place: str = "device",
                       device: torch.device | None = None) -> WorkerSummary:
        """Start receiving one (staged) update while the engine keeps serving, into a shadow
        on `place` (`shadow.Shadow`); returns at once (`ok`: started). `swap` loads it."""
        if (refused := self._not_ready()) is not None:
            return refused
        receiver = self.receiver
        assert receiver is not None and self.loaders is not None
        loader = self.loaders()
        if self._shadow is None or self._shadow.place != place:
            self._shadow = None  # one shadow at a time
            dev = device if device is not None else _device_of(self._model())
            self._shadow = Shadow(dev, place)
        self._beside = BesideReceive(lambda b: receiver.run(loader, timeout_s, b),
                                     self._shadow, receiver.verdict_s)
        return WorkerSummary(ok=True, rank=receiver.rank, version=self.state.version,
                             consistent=self.state.consistent, extra={"beside": "receiving"})

    def open_swap(self, timeout_s: float) -> None:
        """Let the swap of the update received beside serving begin, and return once its loads
        are queued (or it ended; at most `timeout_s`): the engine's turn goes on while the
        device copies, then `swap` waits for the end. Nothing if no update is received."""
        if self._beside is not None:
            self._beside.open(timeout_s)

    def swap(self, timeout_s: float) -> WorkerSummary:
        """Load the update received beside serving (call with generation paused); waits for it
        to be verified everywhere (at most the receive's own bounds) and committed, or to fail.
        Returns its summary, as `receive` does."""
        beside = self._beside
        if beside is None:
            return WorkerSummary(ok=False, rank=self.receiver.rank if self.receiver else -1,
                                 version=self.state.version, consistent=self.state.consistent,
                                 error="no update is being received beside serving")
        out = beside.swap(timeout_s)
        if not beside.running:
            self._beside = None
        return out

    def cannot_carry(self) -> WorkerSummary:
        """The answer to `outcomes.CARRY_RPC` when it reaches the worker: the engine around it
        did not take the call (vLLM's engine core swaps and drops its prefix cache in one turn,
        `integrations.vllm.patches.swap_turn`), so nothing is loaded; the trainer swaps under a
        pause."""
        return WorkerSummary(
            ok=False, rank=self.receiver.rank if self.receiver else -1,
            version=self.state.version, consistent=self.state.consistent,
            error="this engine cannot swap with requests in flight (its vLLM is not patched by "
                  "vllm_nccl_sync.integrations.vllm.patches.swap_turn); swap under a pause",
            extra={"carry": CARRY_UNSUPPORTED})

    def report(self) -> dict[str, Any]:
        """Weight version held, consistency, counters and adapter versions of this worker."""
        held = self.residency().to_dict()
        st = self.state
        return {"joined": self.joined, "rank": self.receiver.rank if self.receiver else -1,
                "version": st.version, "consistent": st.consistent, "updates": st.updates,
                "failures": st.failures, "bytes": st.bytes, "last_seconds": st.last_seconds,
                "last_error": st.last_error, "adapters": dict(st.adapters),
                "beside": self._beside.stage if self._receiving_beside else "",
                "shadow_bytes": self._shadow.nbytes if self._shadow is not None else 0,
                "shadow_kept": self._shadow.kept if self._shadow is not None else 0,
                **held}

    def adapters(self) -> dict[str, Any]:
        """Every LoRA adapter pushed into this worker: committed version, id, rank, targets."""
        held = self._adapters.listing() if self._adapters is not None else {}
        return {n: {"version": self.state.adapters.get(n, -1), **h} for n, h in held.items()}

    def checksums(self, names: list[str] | None = None) -> dict[str, Any]:
        """sha256 of the parameters as this worker holds them (`verify` compares them);
        refused while the weights are asleep (their memory is unmapped)."""
        if why := self.residency().unwritable:
            raise RuntimeError(f"cannot read the weights: {why.text}")
        tp_rank, tp_size = self._parallel()
        return {"tp_rank": tp_rank, "tp_size": tp_size,
                "params": module_checksums(self._model(), names, self._layout)}

    def param_ptrs(self) -> dict[str, int]:
        """Data pointer of every non-empty parameter and buffer (to prove updates in place)."""
        return param_pointers(self._model())

    def metrics(self) -> dict[str, Any]:
        """This worker's counters, and its `vllm_nccl_sync_*` series as Prometheus text."""
        if self.receiver is not None:
            export_state(self.receiver.rank, self.state)
        return {"state": self.report(), "prometheus": prometheus_text()}

    def close(self) -> None:
        """Leave the transfer group (what the worker holds stays); a receive beside serving
        ends first, without loading."""
        if self._beside is not None:
            self._beside.cancel(3 * (self.receiver.cfg.timeout_s if self.receiver else 60) + 30)
            self._beside = None
        self._shadow = None
        receiver, self.receiver = self.receiver, None
        if receiver is not None:
            receiver.close()


def _read_set(reads: Callable[[], ReadSet] | None) -> ReadSet:
    """This worker's read set, for shard to shard; `ValueError` saying why there is none."""
    if reads is None:
        raise ValueError("shard to shard (SyncConfig.shard) needs each worker's read set, and "
                         "this engine's integration computes none")
    try:
        return reads()
    except ValueError as e:
        raise ValueError(f"shard to shard (SyncConfig.shard) needs this worker's read set: {e}")\
            from None


def _device_of(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
