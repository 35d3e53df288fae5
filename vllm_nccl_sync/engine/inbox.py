"""A receiver's control-plane waits: the sender's next message of this update, by a deadline.

Every wait ends at its absolute deadline, whatever arrives meanwhile: messages of other updates
(`protocol.belongs`) are skipped without extending it, an `Abort` of this update ends the update,
and a wait that ends without what it waited for names what it received and dropped. Before an
update opens, frames that do not decode are dropped too (leftovers are not its concern); they are
named the same way, except a `Plan` that names its update (`protocol.UnreadablePlan`): that
update opened, and is refused as a whole.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import Counter
from collections.abc import Callable

from vllm_nccl_sync.engine.update import Update
from vllm_nccl_sync.outcomes import Problem, ProtocolError, UpdateFailed, clip
from vllm_nccl_sync.wire.channel import ReceiverChannel
from vllm_nccl_sync.wire.deadline import Deadline
from vllm_nccl_sync.wire.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Error,
    Message,
    Plan,
    Repeat,
    UnreadablePlan,
    belongs,
)

log = logging.getLogger(__name__)

_NAMED = 5
"""Kinds of dropped frames a message names (the most frequent first)."""


class Wait(Deadline):
    """What a wait is for, and its deadline (`seconds` from now)."""

    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(seconds)
        self.what = what


class Inbox:
    """The control plane as receiver `rank` uses it: bounded waits, and bounded `Error`s.

    `progress` is called for every message of the update in progress (the data plane's deadman
    restarts its count); `dropped` counts what was skipped or dropped since `reset()`.
    """

    def __init__(self, channel: ReceiverChannel, rank: int, timeout_s: float,
                 progress: Callable[[], None]) -> None:
        self.channel = channel
        self.rank = rank
        self.timeout_s = timeout_s
        self.progress = progress
        self.dropped: Counter[str] = Counter()

    def reset(self) -> None:
        """A new update: nothing dropped yet."""
        self.dropped = Counter()

    def send(self, msg: Message) -> None:
        """Send `msg` to the sender (bounded by the config's timeout)."""
        self.channel.send(msg, self.timeout_s)

    # ------------------------------------------------------------------ waits

    def opening(self, seconds: float) -> Plan | Repeat:
        """The next update's `Plan` (or `Repeat`), within `seconds`; anything else before it is
        dropped, but a Plan that does not decode and names its update raises `UnreadablePlan`."""
        return self._take(Wait("the Plan of an update", seconds), None)

    def next(self, u: Update, wait: Wait) -> Message:
        """The sender's next message of update `u` before `wait`'s deadline. An `Abort` of it
        raises `UpdateFailed` (naming where), `TimeoutError` names what was dropped meanwhile."""
        msg = self._take(wait, u)
        if isinstance(msg, Abort):
            if any(k >= msg.seq for k in u.posted):
                u.in_step = False  # we wait in a collective the sender never posts
            where = "in the commit round" if u.sealed else f"at bucket {msg.seq}"
            raise UpdateFailed(f"sender aborted update {u.version} {where}: {clip(msg.reason)}")
        return msg

    def pending(self, u: Update, what: str) -> Message | None:
        """A message of update `u` already here (None if there is none); an `Abort` raises."""
        try:
            return self.next(u, Wait(what, 0.0))
        except TimeoutError:
            return None

    def _take(self, wait: Wait, u: Update | None) -> Message:
        """The first message of update `u` (None: the first `Plan` or `Repeat`) before the
        deadline."""
        while True:
            try:
                msg = self.channel.recv(wait.left(), fail_on_drop=u is not None)
            except TimeoutError as e:
                raise self._expired(wait, str(e)) from None
            except ProtocolError as e:
                if u is not None or isinstance(e, UnreadablePlan):
                    raise
                log.warning("rank %d dropped an undecodable frame before the update: %s",
                            self.rank, clip(str(e), 200))
                self.dropped[f"undecodable frame ({clip(str(e), 200)})"] += 1
            else:
                if isinstance(msg, (Plan, Repeat)) if u is None else belongs(msg, u.version):
                    if u is not None:
                        self.progress()
                    return msg
                version = getattr(msg, "version", None)
                kind = type(msg).__name__ + ("" if version is None else f" of update {version}")
                log.info("rank %d skipping a %s while waiting for %s", self.rank, kind, wait.what)
                self.dropped[kind] += 1
            if time.monotonic() >= wait.at:
                raise self._expired(wait, "the deadline passed")

    def _expired(self, wait: Wait, why: str) -> TimeoutError:
        return TimeoutError(f"waited {wait.seconds:.1f} s for {wait.what}: {why}"
                            + (f"; received and dropped meanwhile: {self.said()}"
                               if self.dropped else ""))

    def said(self) -> str:
        """What was dropped since `reset()`, most frequent first."""
        kinds = self.dropped.most_common()
        text = ", ".join(f"{n} {kind}" for kind, n in kinds[:_NAMED])
        return text + (f" (+{len(kinds) - _NAMED} more kinds)" if len(kinds) > _NAMED else "")

    # ------------------------------------------------------------------ telling the sender

    def tell(self, u: Update, seq: int, message: str, tb: str = "") -> None:
        """Send an `Error` of update `u` (bounded: a dead sender must not block us); nothing
        before a plan named the update. The one place this receiver's `Error`s are made."""
        if u.version < 0:  # nobody asked; an Error of no update belongs to none (`belongs`)
            return
        try:
            self.channel.send(Error(PROTOCOL_VERSION, self.rank, seq, clip(message),
                                    tb or traceback.format_exc(), u.version),
                              min(self.timeout_s, 5.0))
        except (TimeoutError, OSError, ValueError) as e:
            log.warning("rank %d could not report its error to the trainer: %s", self.rank, e)

    def fail(self, u: Update, problem: Problem, seq: int | None = None) -> None:
        """Record the first problem of `u` and tell the sender its text at once (once per
        update), so it stops announcing buckets; every collective a `Go` covers is still
        joined."""
        if u.failed is None:
            u.failed = problem
        if not u.told:
            u.told = True
            self.tell(u, u.seq if seq is None else seq, u.failed.text, " ")

    def violation(self, u: Update, text: str) -> UpdateFailed:
        """A message that breaks the protocol: tell the sender (it may be waiting for us)."""
        self.tell(u, u.seq, f"rank {self.rank}: {text}")
        u.told = True
        return UpdateFailed(text)
