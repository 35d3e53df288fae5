"""Engine calls run beside a push (or a join), with one bound.

An update needs every engine's workers inside their receive call while the trainer pushes, and
a join needs them inside their join call while the trainer hosts the rendezvous. `beside` starts
each engine call in a daemon thread of its own, runs the trainer's side, and collects every
call's outcome. One formula bounds it all (`engine_call_s`): each engine call is given it as its
own RPC timeout, and once the trainer's side ended, every call must have answered within it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from typing import Any


def engine_call_s(timeout_s: float) -> float:
    """The bound on an engine call beside a push, from the update's `timeout_s`: a receiver's
    waits are each bounded by about `timeout_s` (the plan, the verdict, a staged second phase),
    plus 30 s for the RPC itself."""
    return 3 * timeout_s + 30.0


@dataclass(slots=True)
class Outcome:
    """What one call returned (`value`) or raised (`error`); `done` False: still running."""

    value: Any = None
    error: BaseException | None = None
    done: bool = True

    @property
    def ok(self) -> bool:
        return self.done and self.error is None


def _spawn(name: str, fn: Callable[[], Any]) -> Future:
    """Run `fn()` in a daemon thread; its outcome in a Future. (A thread left waiting on a peer
    that failed ends by its own timeout and never holds up the interpreter's exit.)"""
    fut: Future = Future()
    fut.set_running_or_notify_cancel()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


def _outcome(fut: Future, bound: float) -> Outcome:
    if not fut.done():
        return Outcome(error=TimeoutError(f"no answer within {bound:.0f} s"), done=False)
    return Outcome(error=fut.exception()) if fut.exception() else Outcome(fut.result())


def beside(calls: Sequence[Callable[[], Any]], main: Callable[[], Any], timeout_s: float, *,
           name: str = "nccl-sync", fail_fast: bool = False) -> tuple[Outcome, list[Outcome]]:
    """Run `main()` while every one of `calls` runs in a thread of its own; returns main's
    outcome and each call's, in order (never raises for them).

    `main` runs in this thread (its CUDA device and streams are the caller's), and every call
    must answer within `engine_call_s(timeout_s)` after it ended. `fail_fast` (a join): `main`
    runs in a thread too, and the wait ends as soon as a call fails; `main` may then still be
    running (`done` False), bounded by its own timeout.
    """
    bound = engine_call_s(timeout_s)
    futs = [_spawn(f"{name}-{i}", c) for i, c in enumerate(calls)]
    if fail_fast:
        fut = _spawn(name, main)
        wait([fut, *futs], timeout=bound, return_when=FIRST_EXCEPTION)
        if not any(f.done() and f.exception() for f in futs):
            wait([fut], timeout=bound)
        done = _outcome(fut, bound)
    else:
        try:
            done = Outcome(main())
        except Exception as e:  # noqa: BLE001 - returned to the caller
            done = Outcome(error=e)
    wait(futs, timeout=bound)
    return done, [_outcome(f, bound) for f in futs]
