"""A receiver's commit round: `Seal`, `Ack`, `Commit`; staged: then load, `Ack(2)`, `Commit(2)`.

Its order is a rule: a message of the update that is already here when this receiver is about to
send its `Ack` was sent before the sender could have heard that `Ack`, so a `Commit` then is
refused (an `Abort` ends the update as it always may).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NoReturn

from vllm_nccl_sync.engine.dataplane import ReceivePlane
from vllm_nccl_sync.engine.inbox import Inbox, Wait
from vllm_nccl_sync.engine.residency import Residency
from vllm_nccl_sync.engine.state import WeightLoader
from vllm_nccl_sync.engine.update import Update
from vllm_nccl_sync.outcomes import Kind, Problem, UpdateFailed, clip
from vllm_nccl_sync.wire.packing import wholes
from vllm_nccl_sync.wire.protocol import PROTOCOL_VERSION, Ack, Commit, Seal

log = logging.getLogger(__name__)


def _prepare(loader: WeightLoader, u: Update) -> None:
    """Let the loader prepare the swap of update `u`'s staged tensors (where it can: replay
    recorded ahead), while the engine still serves."""
    prepare = getattr(loader, "prepare", None)
    if prepare is None:
        return
    try:
        for batch in wholes(u.staged_tensors, u.capacity):
            prepare(batch)
    except Exception:  # noqa: BLE001 - only a head start: the load does it all
        log.exception("preparing the loader failed")
    u.mark("prepared")


class CommitRound:
    """The commit round of receiver `rank`: sends bounded by `timeout_s`, the sender's verdicts
    awaited for `verdict_s`; `residency` tells whether the weights may be written now (a staged
    update is loaded only then; None: always)."""

    def __init__(self, inbox: Inbox, plane: ReceivePlane, rank: int, timeout_s: float,
                 verdict_s: float, residency: Callable[[], Residency] | None = None) -> None:
        self.inbox, self.plane, self.rank = inbox, plane, rank
        self.timeout_s, self.verdict_s = timeout_s, verdict_s
        self.residency = residency

    def seal(self, u: Update) -> Seal:
        """The sender's `Seal` after the last bucket (anything else breaks the protocol); the
        loads queued so far have run when it returns."""
        seal = self.inbox.next(u, Wait(f"the Seal of update {u.version}", self.verdict_s))
        if not isinstance(seal, Seal):
            raise self.inbox.violation(u, f"expected Seal after bucket {u.seq}, "
                                          f"got {clip(repr(seal), 200)}")
        u.sealed = True
        self.plane.settle(self.timeout_s)
        return seal

    def run(self, loader: WeightLoader, u: Update) -> None:
        """`Ack(1)`, `Commit(1)`; staged: then load everything, `Ack(2)` once the copies are
        queued, `Commit(2)` once they ran."""
        if u.beside is not None:  # before Ack: the swap comes after it
            _prepare(loader, u)
        self._ack(1, u)
        u.mark("acked")
        if u.staged:
            u.exposed = True  # the sender may tell others to load from here on
        self._commit(1, u)
        u.mark("committed")
        if not u.staged:
            return
        if u.beside is not None:  # no collective is pending: the deadman waits past the gate
            self.plane.extend(2 * self.verdict_s)
            u.beside.gate(u.version)  # the engine's owner pauses generation, then swaps
            self.plane.extend(self.verdict_s)
            early = self.inbox.pending(u, "nothing before the swap")  # an Abort raises
            if early is not None:
                raise self.inbox.violation(u, f"the sender sent {clip(repr(early), 200)} "
                                              f"before the swap of update {u.version}")
        why = self.residency().unwritable if self.residency is not None else None
        if why:  # e.g. put to sleep while the update was received beside serving
            self._refuse(u, why.at(f"rank {self.rank} did not load staged update {u.version}"))
        try:
            with self.plane.loading():
                loader.begin()
                u.began = True
                u.mark("begun")
                for batch in wholes(u.staged_tensors, u.capacity):  # blocks made whole
                    loader.load(batch)
                u.staged_tensors = []
                u.mark("copied")  # the copies queued; next, the post-load rule
                loader.finish()
            u.mark("loaded")  # the loaders and the post-load rule returned
            if u.beside is not None:  # the engine may go on with its turn while they copy
                u.beside.queued()
        except Exception as e:  # noqa: BLE001 - user/vLLM code: report it
            log.exception("loading the staged update failed")
            self._refuse(u, Problem(Kind.LOAD, f"rank {self.rank} failed loading the staged "
                                    f"update: {clip(repr(e))}"))
        if problem := u.coverage_problem(loader):
            self._refuse(u, problem)
        self._ack(2, u)  # the sender's Commit(2) comes back while the device copies
        self._settle(u)
        self._commit(2, u)
        u.mark("committed2")

    def _settle(self, u: Update) -> None:
        """Wait (bounded) until every copy of the staged update's load ran, before its
        `Commit(2)` is taken and the swap's caller goes on; one that fails refuses the update
        (the sender may have committed meanwhile: this worker reports itself inconsistent)."""
        try:
            self.plane.settle(self.timeout_s)
            if u.beside is not None:
                u.beside.shadow.settle()
        except Exception as e:  # noqa: BLE001 - the device's own failure: report it
            log.exception("the staged update's copies failed")
            self._refuse(u, Problem(Kind.LOAD, f"rank {self.rank}: the staged update's copies "
                                    f"failed: {clip(repr(e))}"))
        u.mark("settled")  # every copy they queued ran

    def _refuse(self, u: Update, problem: Problem) -> NoReturn:
        """Fail the staged update's second phase: the sender hears `problem`; raises."""
        u.failed = problem
        self.inbox.tell(u, u.seq + 1, problem.text)
        raise problem.error()

    def _ack(self, phase: int, u: Update) -> None:
        """Send `Ack(phase)`, unless the sender already sent something of this update."""
        early = self.inbox.pending(u, f"nothing before Ack({phase})")
        if early is not None:
            raise self.inbox.violation(
                u, f"the sender sent {clip(repr(early), 200)} before this receiver's "
                   f"Ack({phase}) of update {u.version} (the commit round goes Seal, Ack, Commit)")
        self.inbox.send(Ack(PROTOCOL_VERSION, self.rank, u.version, u.seq + 1, u.nbytes,
                            u.ntensors, time.perf_counter() - u.t0, phase))

    def _commit(self, phase: int, u: Update) -> None:
        """Wait for `Commit(phase)` of this update (an `Abort` or a timeout fails it)."""
        try:
            msg = self.inbox.next(u, Wait(f"Commit({phase}) of update {u.version}",
                                          self.verdict_s))
        except UpdateFailed:
            if u.staged and phase == 1:
                u.exposed = False  # aborted before any Commit: no worker was told to load
            raise
        if not (isinstance(msg, Commit) and msg.phase == phase):
            raise self.inbox.violation(u, f"expected Commit({phase}) of update {u.version}, "
                                          f"got {clip(repr(msg), 200)}")
