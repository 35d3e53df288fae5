"""`WeightSync`: one object a trainer holds to keep one or many engines on its latest weights.

It hosts the transfer group, joins every engine to it (rank offsets computed here), and for each
update runs every engine's receive call beside the push (`beside`), so the caller writes one
line: `sync.update(model.state_dict(), version=step)`. A failed update raises what the push
raised (same type, `errors`, `missing` and cause), carrying the workers' own reports.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

import torch

from vllm_nccl_sync.outcomes import (
    CARRY_RPC,
    CARRY_UNSUPPORTED,
    PushError,
    WorkerSummary,
    clip,
)
from vllm_nccl_sync.trainer.adapters import adapter_update
from vllm_nccl_sync.trainer.beside import Outcome, engine_call_s
from vllm_nccl_sync.trainer.beside import beside as alongside
from vllm_nccl_sync.trainer.push import PushClient, PushResult
from vllm_nccl_sync.trainer.tensors import Progress
from vllm_nccl_sync.wire.config import SyncConfig, free_ports
from vllm_nccl_sync.wire.protocol import AdapterSpec

__all__ = ["EngineHandle", "WeightSync", "adapter_update", "free_port", "settle"]

_DEFAULT = SyncConfig.defaults()
PAUSE_MODES = ("abort", "wait", "keep", "carry")
"""What happens to in-flight requests at an update: aborted, waited for, kept (frozen, then
recomputed on the new weights) or carried (beside serving only: never paused, their KV kept)."""


_GIVEN: collections.deque[int] = collections.deque(maxlen=256)
"""The ports `free_port` gave this process last."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now, none of the last 256 this process was given: two
    calls in a row never give the same port (the OS may hand a just-closed one out again, and a
    config's control and group ports must differ)."""
    port = free_ports(host, 1, frozenset(_GIVEN))[0]
    _GIVEN.append(port)
    return port


class EngineHandle(Protocol):
    """One engine (replica) as `WeightSync` drives it (vLLM's and SGLang's: `integrations`)."""

    workers: int
    """How many workers (tensor x pipeline parallel) receive in this engine."""

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Run `method` of the worker extension on every worker; one result per worker."""
        ...

    def pause(self, mode: str) -> None:
        """Stop scheduling: `abort`, `wait` for, or `keep` in-flight requests."""
        ...

    def resume(self) -> None:
        """Resume scheduling and reset the prefix cache (its KV came from the old weights)."""
        ...

    # Optional: `reset_prefix_cache()`. A handle that has it is asked before each update whether
    # its engine's memory is asleep (vLLM's sleep mode); if so it is neither paused nor resumed
    # (resuming would let it step before `wake_up(tags=["kv_cache"])`), only this is called.


def _sleeping(state: list[dict[str, Any]]) -> bool:
    """Whether a worker of this engine reports memory asleep (vLLM's sleep mode)."""
    return any(w.get("asleep") for w in state)


def settle(version: int, pushed: Outcome, answers: list[Outcome],
           engines: list[EngineHandle], offsets: list[int]) -> PushResult:
    """The outcome of a push run `beside` every engine's receive call (engine i's workers are
    ranks `offsets[i]`...): its result, or what the push raised (the same type, `errors`,
    `missing` and cause) carrying every worker's report; a `PushError` naming the workers whose
    reports failed although the push succeeded. An engine whose call failed counts as one
    failed report per worker."""
    summaries: list[WorkerSummary] = []
    live: list[dict[str, Any]] = []
    for i, (e, off, a) in enumerate(zip(engines, offsets, answers, strict=True)):
        if a.ok:
            mine = [WorkerSummary.from_dict(s) for s in a.value]
            live.append(next((s.extra["live"] for s in mine if "live" in s.extra), {}))
        else:
            text = clip(f"engine {i}'s receive call failed: {a.error!r}", 500)
            mine = [WorkerSummary(ok=False, rank=off + w, error=text) for w in range(e.workers)]
            live.append({})
        summaries += mine
    if isinstance(pushed.error, PushError):
        raise pushed.error.with_summaries(summaries) from pushed.error.__cause__
    if pushed.error is not None:
        raise pushed.error
    failed = {s.rank: s.error or "failed" for s in summaries if not s.ok}
    if failed:
        raise PushError(f"update {version} was committed, but workers report a failure: "
                        + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items())),
                        failed, summaries=summaries)
    return replace(pushed.value, live=live)


class WeightSync:
    """Trainer-side driver of `engines`, all fed by one broadcast per bucket.

    Args: `backend` (`gloo` or `nccl`), `bucket_bytes`, `timeout_s` (every wait), `host` (the
    address this trainer binds), `secret` (hex HMAC key), `shard` (each worker gets only what its
    loaders read: shard to shard), `receive_process` (gloo: each worker receives in a process of
    its own): as in `SyncConfig`, whose defaults they take; `device`: this trainer's data-plane
    device.
    """

    def __init__(
        self,
        engines: list[EngineHandle],
        *,
        backend: str = _DEFAULT["backend"],
        bucket_bytes: int = _DEFAULT["bucket_bytes"],
        timeout_s: float = _DEFAULT["timeout_s"],
        host: str = _DEFAULT["host"],
        secret: str = _DEFAULT["secret"],
        shard: bool = _DEFAULT["shard"],
        receive_process: bool = _DEFAULT["receive_process"],
        device: torch.device | None = None,
    ) -> None:
        if not engines:
            raise ValueError("WeightSync needs at least one engine")
        self.engines = engines
        self.cfg = SyncConfig.build(host=host, world_size=1 + sum(e.workers for e in engines),
                                    backend=backend, bucket_bytes=bucket_bytes,
                                    timeout_s=timeout_s, secret=secret, shard=shard,
                                    receive_process=receive_process, door="WeightSync")
        self.offsets = [1 + sum(e.workers for e in engines[:i]) for i in range(len(engines))]
        self.client = PushClient(self.cfg, device)

    def _calls(self, method: str, *args: Any) -> list:
        bound = engine_call_s(self.cfg.timeout_s)
        return [partial(e.call, method, *args, timeout=bound) for e in self.engines]

    def connect(self) -> list[list[dict[str, Any]]]:
        """Join every engine's workers to the group; returns each worker's rank assignment.
        Raises what `PushClient.connect` raised, or the first engine's join failure."""
        cfg = self.cfg.to_dict()
        bound = engine_call_s(self.cfg.timeout_s)
        calls = [partial(e.call, "nccl_sync_join", cfg, off, timeout=bound)
                 for e, off in zip(self.engines, self.offsets, strict=True)]
        joined, answers = alongside(calls, self.client.connect, self.cfg.timeout_s,
                                 name="nccl-sync-join")
        if joined.error is not None:
            raise joined.error
        for a in answers:
            if a.error is not None:
                raise a.error
        return [a.value for a in answers]

    def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        version: int,
        *,
        pause_mode: str = "wait",
        dtype: torch.dtype | None = None,
        force: bool = False,
        staged: bool = False,
        adapter: AdapterSpec | None = None,
        beside: bool = False,
        shadow: str = "device",
        progress: Progress | None = None,
    ) -> PushResult:
        """Push one complete update into every engine.

        Each engine is paused (`pause_mode`: `abort`, `wait` or `keep` its in-flight requests) for
        the update and resumed with its prefix cache reset, whatever the outcome. With `beside`,
        `pause_mode="carry"` pauses nothing: each engine swaps between two steps, its running
        requests keep their KV and continue on the new weights (docs/serving.md). Engines refuse a
        `version` not newer than the one they hold unless `force`; `staged`, `dtype`, `adapter`
        (the tensors are this LoRA adapter's, see `update_adapter`) and `progress` are `push`'s.

        `beside`: the engines keep serving while they receive (a staged update, kept in a shadow
        copy on the engine's device, or in host memory with `shadow="host"`); once every worker
        verified everything, each engine is paused per `pause_mode` only for the swap, which
        loads the shadow in place (docs/serving.md).
        Raises what `PushClient.push` raised (`UpdateRefused`, `PushError`: the same type,
        `errors`, `missing` and cause) with the workers' reports in `summaries`; a `PushError`
        naming the workers whose reports failed when the push itself succeeded.
        """
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode {pause_mode!r} must be one of {PAUSE_MODES}")
        if pause_mode == "carry" and not beside:
            raise ValueError("pause_mode 'carry' swaps an update received beside serving: "
                             "pass beside=True")
        self.client.check(named_tensors, dtype=dtype, adapter=adapter)  # before engines wait
        push = partial(self.client.push, named_tensors, version, dtype=dtype, force=force,
                       adapter=adapter, progress=progress)
        if beside:
            return self._beside(push, version, pause_mode, shadow)
        asleep = self._asleep()
        self._hold(asleep, pause_mode)
        try:
            pushed, answers = alongside(
                self._calls("nccl_sync_receive", self.cfg.timeout_s),
                partial(push, staged=staged), self.cfg.timeout_s, name="nccl-sync-receive")
        finally:
            self._release(asleep)
        return settle(version, pushed, answers, self.engines, self.offsets)

    def _asleep(self, states: list[list[dict[str, Any]]] | None = None) -> list[bool]:
        """Per engine, whether a worker reports its memory asleep (vLLM's sleep mode), from
        `states` (`state()`) or asked now. Only handles that can reset their prefix cache alone
        count (others are not asked); an engine that does not answer counts as awake (its
        receive reports what is wrong)."""
        out = []
        for i, e in enumerate(self.engines):
            try:
                out.append(hasattr(e, "reset_prefix_cache") and _sleeping(
                    states[i] if states is not None else e.call("nccl_sync_state", timeout=30)))
            except Exception:  # noqa: BLE001 - the update itself names what is wrong
                out.append(False)
        return out

    def _hold(self, asleep: list[bool], mode: str,
              engines: list[EngineHandle] | None = None) -> None:
        """Pause every engine (of `engines`, default all) whose memory is awake."""
        for e, a in zip(engines or self.engines, asleep, strict=True):
            if not a:
                e.pause(mode)

    def _release(self, asleep: list[bool], engines: list[EngineHandle] | None = None) -> None:
        """Resume what `_hold` paused; an engine asleep only gets its prefix cache reset."""
        for e, a in zip(engines or self.engines, asleep, strict=True):
            if a:
                e.reset_prefix_cache()  # type: ignore[attr-defined]
            else:
                e.resume()

    def _beside(self, push: Callable[..., PushResult], version: int, pause_mode: str,
                shadow: str) -> PushResult:
        """`update(beside=True)`: start every worker's receive beside serving, push (staged);
        once every worker verified, pause each engine, swap, resume."""
        t = self.cfg.timeout_s
        bound = engine_call_s(t)
        states = self.state()
        for i, state in enumerate(states):
            busy = [s.get("rank") for s in state if s.get("beside")]
            if busy:
                raise PushError(f"engine {i}'s workers {busy} are still receiving an update beside "
                                "serving (it ends by its own timeout)")
        asleep = self._asleep(states)
        for i, e in enumerate(self.engines):
            started = e.call("nccl_sync_receive_beside", t, shadow, timeout=bound)
            failed = [s for s in started if not s.get("ok")]
            if failed:
                raise PushError(f"engine {i} could not receive beside serving: "
                                + "; ".join(str(s.get("error")) for s in failed))
        turn, verified = threading.Event(), threading.Event()

        def swap_all() -> list[Outcome]:
            turn.wait(bound)
            if pause_mode == "carry" and verified.is_set():
                return self._carry(asleep)
            paused = verified.is_set()  # else the push failed: collect the reports, no pause
            try:
                if paused:
                    self._hold(asleep, pause_mode)
                return alongside(self._calls("nccl_sync_swap", bound), lambda: None, t,
                              name="nccl-sync-swap")[1]
            finally:
                if paused:
                    self._release(asleep)

        def pushed() -> PushResult:
            try:
                return push(staged=True, verified=lambda: (verified.set(), turn.set()))
            finally:
                turn.set()

        done, (swapped,) = alongside([swap_all], pushed, t, name="nccl-sync-beside")
        answers = swapped.value if swapped.ok else [swapped] * len(self.engines)
        return settle(version, done, answers, self.engines, self.offsets)

    def _carry(self, asleep: list[bool]) -> list[Outcome]:
        """Every engine's swap in one turn of its engine core, requests kept in flight
        (`integrations.vllm.patches.swap_turn`); an engine whose core does not take that call swaps
        under a
        `keep` pause instead."""
        t = self.cfg.timeout_s
        bound = engine_call_s(t)
        outs = alongside(self._calls(CARRY_RPC, bound), lambda: None, t,
                         name="nccl-sync-carry")[1]
        for i, (e, o) in enumerate(zip(self.engines, outs, strict=True)):
            if o.ok and any(s.get("carry") == CARRY_UNSUPPORTED for s in o.value):
                self._hold(asleep[i:i + 1], "keep", [e])
                try:
                    outs[i] = Outcome(e.call("nccl_sync_swap", bound, timeout=bound))
                except Exception as err:  # noqa: BLE001 - reported like a failed call
                    outs[i] = Outcome(error=err)
                finally:
                    self._release(asleep[i:i + 1], [e])
        return outs

    def update_adapter(
        self,
        adapter: Any,
        version: int,
        *,
        name: str,
        lora_id: int,
        rank: int | None = None,
        alpha: float | None = None,
        target_modules: list[str] | None = None,
        pause_mode: str = "wait",
        dtype: torch.dtype | None = None,
        force: bool = False,
    ) -> PushResult:
        """Push LoRA adapter `name` (id `lora_id`) into every engine (started with LoRA enabled):
        added, or its weights replaced; versioned on its own. Base weights are not touched.

        `adapter` is a PEFT model (its active adapter's tensors and config are sent) or a mapping
        of PEFT-named LoRA tensors (`...q_proj.lora_A.weight`), then with `rank`, `alpha` and
        `target_modules`. Requests naming the adapter after this returns use the new weights;
        in-flight ones are handled per `pause_mode` (docs/lora.md). A `vllm serve` engine
        (`HTTPHandle`) also gets the name registered, so requests may say `"model": name`.
        """
        tensors, spec = adapter_update(adapter, name, lora_id, rank, alpha, target_modules)
        result = self.update(tensors, version, pause_mode=pause_mode, dtype=dtype, force=force,
                             adapter=spec)
        for e in self.engines:  # a served engine's OpenAI routes learn the name (once)
            register = getattr(e, "register_adapter", None)
            if register is not None:
                register(name)
        return result

    def state(self) -> list[list[dict[str, Any]]]:
        """Every worker's `nccl_sync_state` (version held, consistency, counters), per engine."""
        return [e.call("nccl_sync_state", timeout=30) for e in self.engines]

    def close(self) -> None:
        """Leave the group on every engine (best effort: an engine may be gone) and close."""
        alongside(self._calls("nccl_sync_close"), lambda: None, 0.0, name="nccl-sync-close")
        self.client.close()
