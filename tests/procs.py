"""Run functions in separate processes with a hard deadline, and wait for observed states with
one: a test never hangs CI."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any


def _entry(q, idx: int, fn: Callable, args: tuple) -> None:
    try:
        q.put((idx, True, fn(*args)))
    except BaseException:
        q.put((idx, False, traceback.format_exc()))


def run_procs(calls: list[tuple[Callable, tuple]], deadline_s: float,
              allow_killed: set[int] = frozenset()) -> list[Any]:
    """Start each `fn(*args)` in its own spawned process; return their results in order.

    Raises `AssertionError` with the remote traceback if one failed, or if the deadline passes
    (every process still alive is then killed). Processes in `allow_killed` may die (a fault the
    test injects); their result is None.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(q, i, fn, args), daemon=True)
             for i, (fn, args) in enumerate(calls)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    end = time.monotonic() + deadline_s
    try:
        while len(results) + len(errors) < len(procs):
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"processes still running after the {deadline_s} s deadline")
            try:
                idx, ok, val = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                for i in allow_killed:
                    if procs[i].exitcode not in (None, 0) and i not in results:
                        results[i] = None
                dead = [i for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and i not in results]
                if dead and q.empty():
                    time.sleep(0.5)
                    if q.empty():
                        raise AssertionError(f"process {dead} died with exit codes "
                                             f"{[procs[i].exitcode for i in dead]}") from None
                continue
            if ok:
                results[idx] = val
            else:
                errors.append(f"process {idx} failed:\n{val}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[i] for i in range(len(procs))]


def record_broadcasts() -> list[int]:
    """Make every broadcast of this process record the byte count it announces (the list it
    returns; a gloo receiver posts its whole buffer but announces the header's length)."""
    from vllm_nccl_sync.planes.base import Transport

    sizes: list[int] = []
    orig = Transport.broadcast

    def spy(self, tensor, src=0, *, length=None, to=None):
        sizes.append(tensor.numel() if length is None else length)
        return orig(self, tensor, src, length=length, to=to)

    Transport.broadcast = spy
    return sizes


def die_after_broadcasts(n: int) -> None:
    """Make this process SIGKILL itself once its `n`-th data-plane post completed (so that
    buckets did land before it dies, whatever the machine's speed)."""
    import os
    import signal

    from vllm_nccl_sync.planes.base import Transport

    real, calls = Transport.broadcast, []

    def broadcast_then_die(self, tensor, src=0, *, length=None, to=None):
        handle = real(self, tensor, src, length=length, to=to)
        calls.append(1)
        if len(calls) == n:
            handle.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return handle

    Transport.broadcast = broadcast_then_die


def wait_until(ready: Callable[[], bool], what: str, timeout_s: float) -> None:
    """Poll `ready()` until true; fail with `what` after `timeout_s` (a generous deadline, never
    a guess at how fast something runs)."""
    import pytest

    end = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > end:
            pytest.fail(f"{what}: not observed within {timeout_s:.0f} s")
        time.sleep(0.05)
