"""`ProcEngine`: an `EngineHandle` whose one worker is a real `Receiver` in a spawned process.

It answers the worker extension's calls the trainer side makes (`nccl_sync_join`,
`nccl_sync_receive`, `nccl_sync_close`) plus `digests` (sha256 of what it holds), over a pipe,
so `WeightSync` and the verl backend drive it as they drive a vLLM engine. `die_at_load` SIGKILLs
the worker at its first load of an update (a rank that dies mid-update); `dtype` is what its
`Hello` announces as the engine's dtype.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
from typing import Any

import torch


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                          .tobytes()).hexdigest()


class _Holder:
    """A loader keeping a copy of every tensor it gets (so `digests` can report them)."""

    def __init__(self, held: dict, die: bool) -> None:
        self.held, self.die = held, die

    def begin(self) -> None:
        pass

    def load(self, named):
        if self.die:
            os.kill(os.getpid(), signal.SIGKILL)
        for n, t in named:
            self.held[n] = t.clone()
        return {n for n, _ in named}

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _announce(dtype: str) -> None:
    """Make this process's `Hello`s name `dtype` as the engine's dtype."""
    import msgspec

    from vllm_nccl_sync.wire.channel import ReceiverChannel
    from vllm_nccl_sync.wire.protocol import Hello

    real = ReceiverChannel.send

    def send(self, msg, timeout_s: float = 5.0):
        if isinstance(msg, Hello):
            msg = msgspec.structs.replace(msg, dtype=dtype)
        return real(self, msg, timeout_s)

    ReceiverChannel.send = send


def _serve(conn, die_at_load: bool, dtype: str) -> None:
    from vllm_nccl_sync.engine.receiver import Receiver
    from vllm_nccl_sync.wire.config import SyncConfig

    if dtype:
        _announce(dtype)
    rx, held = None, {}
    while True:
        method, args = conn.recv()
        try:
            if method == "nccl_sync_join":
                cfg, offset = args
                if rx is not None:
                    rx.close()
                rx = Receiver(SyncConfig.from_dict(cfg), offset,
                              state=None if rx is None else rx.state)
                out = [{"rank": offset}]
            elif method == "nccl_sync_receive":
                out = [rx.receive(_Holder(held, die_at_load), args[0])]
            elif method == "digests":
                out = [{n: (digest(t), str(t.dtype)) for n, t in held.items()}]
            elif method == "nccl_sync_close":
                if rx is not None:
                    rx.close()
                conn.send(("ok", []))
                return
            else:
                raise ValueError(f"no such method {method!r}")
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001 - the caller raises it
            conn.send(("error", repr(e)))


class ProcEngine:
    """An engine of one worker in a spawned process (see the module docstring)."""

    workers = 1

    def __init__(self, *, die_at_load: bool = False, dtype: str = "") -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, die_at_load, dtype), daemon=True)
        self.proc.start()

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        if not self.proc.is_alive():
            raise RuntimeError(f"the engine process exited ({self.proc.exitcode})")
        self._conn.send((method, args))
        try:
            if not self._conn.poll(timeout):
                raise TimeoutError(f"{method}: no answer within {timeout} s")
            status, out = self._conn.recv()
        except (EOFError, ConnectionError, OSError):
            self.proc.join(5)
            raise RuntimeError(f"the engine process died during {method} "
                               f"(exit code {self.proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(out)
        return out

    def pause(self, mode: str) -> None:
        pass

    def resume(self) -> None:
        pass

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
