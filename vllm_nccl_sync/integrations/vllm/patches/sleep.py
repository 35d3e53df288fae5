"""Tell the worker's sessions what vLLM's sleep mode and weight calls did to the weights.

Upstream: `Worker.sleep`, `Worker.wake_up`, `Worker.reload_weights` (`vllm/v1/worker/gpu_worker.py`,
0.26 and 0.32) and, in 0.32, `Worker.discard` and `Worker.reset_weights` (the latter behind the
RL router's `/weight_checker` "reset"). Level-2 sleep releases the weights without a backup, so
after `wake_up(tags=["weights"])` the parameters are uninitialised memory at the same addresses;
`discard(("weights",))` does the same awake; `reset_weights` zeroes them; `reload_weights` loads
the checkpoint again (or the tensors it is given). No update sees any of it, so these methods are
wrapped to record it in `engine.residency` after vLLM's own code ran (nothing else changes). The
worker extension cannot override them: vLLM refuses an extension whose attributes clash with
the worker's.

Applied from the `vllm.general_plugins` entry point `nccl_sync_sleep` in every vLLM process, and
again by every session (idempotent). Other vLLM versions: not applied, logged once; updates then
do not know about sleep (docs/colocated.md says what that risks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_nccl_sync.engine.residency import residency
from vllm_nccl_sync.integrations.vllm.patches import plugin

SUPPORTED = ("0.26.", "0.32.")
_MARK = "_vllm_nccl_sync_watched"


def _model(worker: Any) -> Any:
    return worker.model_runner.model


def _after(method: Callable[..., Any], record: Callable[..., None]) -> Callable[..., Any]:
    """`method`, then `record(worker, *args, **kwargs)` once it returned."""

    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = method(self, *args, **kwargs)
        record(self, *args, **kwargs)
        return out

    setattr(wrapped, _MARK, True)
    return wrapped


def _slept(worker: Any, level: int = 1, *_: Any, **__: Any) -> None:
    residency(_model(worker)).slept(int(level))


def _woke(worker: Any, tags: list[str] | None = None, *_: Any, **__: Any) -> None:
    residency(_model(worker)).woke(tags)


def _discarded(worker: Any, tags: tuple[str, ...] | str = (), *_: Any, **__: Any) -> None:
    tags = (tags,) if isinstance(tags, str) else tuple(tags)
    if "weights" in tags:
        r = residency(_model(worker))
        r.asleep.add("weights")
        r.lost("vLLM's discard(tags=('weights',)) released the weights")
    if "kv_cache" in tags:
        residency(_model(worker)).asleep.add("kv_cache")


def _reset(worker: Any, *_: Any, **__: Any) -> None:
    residency(_model(worker)).lost("vLLM's reset_weights zeroed the weights")


def _reloaded(worker: Any, weights_iterator: Any = None, weights_path: str | None = None,
              *_: Any, **__: Any) -> None:
    """With neither argument vLLM reloads the model's own checkpoint."""
    residency(_model(worker)).reloaded_from(weights_iterator is None and weights_path is None)


RECORDS: dict[str, Callable[..., None]] = {
    "sleep": _slept, "wake_up": _woke, "discard": _discarded, "reset_weights": _reset,
    "reload_weights": _reloaded,
}
"""What each wrapped `Worker` method records (only those the installed vLLM has)."""


def watch(cls: type) -> list[str]:
    """Wrap `cls`'s methods named in `RECORDS` (once); returns the names wrapped now."""
    done = []
    for name, record in RECORDS.items():
        method = cls.__dict__.get(name)
        if callable(method) and not getattr(method, _MARK, False):
            setattr(cls, name, _after(method, record))
            done.append(name)
    return done


def install() -> None:
    """Apply the patch in this process where it applies (idempotent; never raises)."""

    def apply() -> None:
        from vllm.v1.worker.gpu_worker import Worker

        watch(Worker)

    plugin(apply, SUPPORTED, "updates are not told about sleep mode")
