"""Test-only vLLM worker extension: `vllm_nccl_sync.Ext` plus a failure armed on one worker.

`worker_extension_cls="tests.fault_ext.FaultExt"`. The added method is prefixed `nccl_test_` (vLLM
asserts that extension names are new to the worker class) and returns msgpack-native values.
The failure wraps what `Ext`'s `EngineSession` (`self._nccl_sync`) receives with: its loaders
(`session.loaders`, giving a `VllmWeightLoader`) or its receiver:

* "finish": the loader's `finish()` raises before doing anything (in place it runs after the
  last bucket was loaded, so this worker holds the new tensors, not yet re-packed; `abort()`,
  which the receiver calls next, re-packs them);
* "load": the loader's `load()` loads the first half of the tensors it is given, then raises
  (staged: the whole verified update comes in one `load()`, after the first `Commit`);
* "verify": the receiver's check of the sender's `Seal` fails (staged: before any `Ack`).
"""

from __future__ import annotations

from typing import Any

from vllm_nccl_sync.integrations.vllm.ext import Ext
from vllm_nccl_sync.outcomes import Kind, Problem

INJECTED = "nccl_test injected failure"
WHERE = ("finish", "load", "verify")


class FailingLoader:
    """Delegates to the real loader; fails as armed."""

    def __init__(self, real: Any, where: str, tp_rank: int) -> None:
        self.real = real
        self.where = where
        self.tp_rank = tp_rank

    def begin(self) -> None:
        self.real.begin()

    def load(self, named_tensors: list) -> set[str]:
        if self.where != "load":
            return self.real.load(named_tensors)
        half = named_tensors[: len(named_tensors) // 2]
        self.real.load(half)
        raise RuntimeError(f"{INJECTED}: load() on tp rank {self.tp_rank} after "
                           f"{len(half)} of {len(named_tensors)} tensors")

    def finish(self) -> None:
        if self.where == "finish":
            raise RuntimeError(f"{INJECTED}: finish() on tp rank {self.tp_rank}")
        self.real.finish()

    def abort(self) -> None:
        self.real.abort()


class FaultExt(Ext):
    """`Ext` with `nccl_test_arm`."""

    def nccl_test_arm(self, where: str = "", tp_rank: int = 1) -> dict[str, Any]:
        """Arm failure `where` (see the module docstring) on the worker of tensor-parallel rank
        `tp_rank` only; `where=""` disarms every worker. Call after `nccl_sync_join`."""
        from vllm.distributed import get_tensor_model_parallel_rank

        if where and where not in WHERE:
            raise ValueError(f"unknown failure {where!r}; one of {WHERE}")
        me = get_tensor_model_parallel_rank()
        session = self._nccl_sync
        if session is None or not session.joined:
            return {"tp_rank": me, "armed": "", "error": "not joined"}
        receiver = session.receiver
        real = getattr(session.loaders, "real", session.loaders)  # the session's own
        receiver.__dict__.pop("_verify", None)  # the class's own check again
        session.loaders = real
        armed = where if where and me == tp_rank else ""
        if armed == "verify":
            def failing_verify(seal: Any, sums: Any, u: Any) -> None:
                u.failed = u.failed or Problem(Kind.SEAL, f"rank {receiver.rank}: {INJECTED}: "
                                               f"verification of the seal on tp rank {me}")

            receiver._verify = failing_verify
        elif armed:
            def failing() -> FailingLoader:
                return FailingLoader(real(), armed, me)

            failing.real = real
            session.loaders = failing
        return {"tp_rank": me, "armed": armed}
