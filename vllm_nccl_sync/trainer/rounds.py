"""The sender's control rounds with the receivers (and, with several senders, the other senders).

One object per `PushClient`, used by the single sender and by the coordinator alike (its socket
calls are serialized, so the coordinator's relay thread and its pushing thread may share it):

* `send_all` (a rank that cannot be reached fails the update now), `tell` (mid-update: one that
  cannot be reached fails it later, after the live ones got every agreed collective), `abort`
  (every live rank, never raises);
* `gather`: one message of a kind from every rank named, within an absolute deadline (messages
  of other updates, by `protocol.belongs`, and stale ones are skipped and never extend it); an
  `Error` replaces a rank's answer;
* `open`: the `Plan`, every rank's `Ready`, one `Go` (a refusal: `Abort` to all, `UpdateRefused`);
  `poll`/`await_go`: a stream's cumulative `Ready`s answered with cumulative `Go`s;
* `commit`: every receiver's `Ack(phase)`, then `Commit(phase)` to everyone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from vllm_nccl_sync.outcomes import PushError, UpdateRefused, clip
from vllm_nccl_sync.wire.channel import SenderChannel
from vllm_nccl_sync.wire.deadline import Deadline
from vllm_nccl_sync.wire.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Commit,
    Error,
    Go,
    Message,
    Ready,
    belongs,
)

log = logging.getLogger(__name__)

Relay = Callable[[int, Message], bool]
"""Takes a message of this update that is neither a `Ready` nor an `Error` (the coordinator: an
other sender's `Digest` or `Sent`); False: not handled (logged and skipped)."""


def named(errors: dict[int, str]) -> str:
    """Each rank's error text once, naming the rank unless the text already starts with it."""
    return "; ".join(m if m.startswith(f"rank {r} ") else f"rank {r}: {m}"
                     for r, m in sorted(errors.items()))


class Rounds:
    """The control rounds of one sender (see the module text).

    `receivers`: the receivers' ranks; `peers`: the other senders' (several senders only);
    `early`: messages taken before the first update (other senders' first `Offer`s), read first;
    `extend(seconds)`: keeps the data plane's deadman from beating a wait here.
    """

    def __init__(self, channel: SenderChannel, receivers: list[int], timeout_s: float, *,
                 peers: list[int] | None = None, early: list[tuple[int, Message]] | None = None,
                 extend: Callable[[float], None] | None = None) -> None:
        self.channel = channel
        self.receivers = list(receivers)
        self.peers = list(peers or [])
        self.timeout_s = timeout_s
        self.early = list(early or [])
        self._extend = extend or (lambda seconds: None)
        self._lock = threading.RLock()  # the socket is used by one thread at a time
        self.begin(-1)

    @property
    def everyone(self) -> list[int]:
        return self.receivers + self.peers

    def begin(self, version: int) -> None:
        """Open update `version`: no answers, errors or unreachable ranks yet."""
        self.version = version
        self.errors: dict[int, str] = {}
        """Each failing rank's `Error` text."""
        self.unreachable: dict[int, str] = {}
        """Ranks a mid-update message could not reach, and which message."""
        self.ready = dict.fromkeys(self.receivers, -1)
        self.agreed = -1
        """The highest bucket a `Go` covers."""

    # ------------------------------------------------------------------ sending

    def send_all(self, msg: Message, to: list[int] | None = None) -> None:
        """Send `msg` to the receivers (or `to`); `PushError` naming any that cannot be reached."""
        with self._lock:
            lost = self.channel.send_all(self.receivers if to is None else to, msg)
        if lost:
            raise PushError(f"update {self.version}: ranks {lost} cannot be reached (gone?) "
                            f"sending {type(msg).__name__}", missing=lost)

    def tell(self, msg: Message, to: list[int] | None = None) -> None:
        """Send `msg` mid-update; a rank that cannot be reached is recorded (`unreachable`)."""
        with self._lock:
            lost = self.channel.send_all(self.receivers if to is None else to, msg)
        for r in lost:
            self.unreachable.setdefault(r, type(msg).__name__)

    def abort(self, seq: int, reason: str) -> None:
        """Tell every live rank that this update is abandoned at `seq` (never raises)."""
        msg = Abort(PROTOCOL_VERSION, self.version, seq, clip(reason))
        with self._lock:
            lost = self.channel.send_all(self.everyone, msg)
        if lost:
            log.warning("Abort of update %d did not reach ranks %s", self.version, lost)

    # ------------------------------------------------------------------ receiving

    def _take(self, deadline: Deadline) -> tuple[int, Message] | None:
        with self._lock:
            if self.early:
                return self.early.pop(0)
            try:
                return self.channel.recv(deadline.at)
            except TimeoutError:
                return None

    def _sort(self, rank: int, msg: Message) -> Message | None:
        """Keep `msg` if it belongs to this update and comes from a rank of it; an `Error` is
        recorded here (and returned)."""
        if rank not in self.everyone:
            log.warning("ignoring %s from rank %d, which is not in this group",
                        type(msg).__name__, rank)
            return None
        if not belongs(msg, self.version):
            log.info("ignoring %s of another update from rank %d during update %d",
                     type(msg).__name__, rank, self.version)
            return None
        if isinstance(msg, Error):
            self.errors[rank] = clip(msg.message)
        return msg

    def gather(self, kind: type, *, ranks: list[int] | None = None, seq: int | None = None,
               phase: int | None = None, what: str = "", who: str = "ranks",
               relay: Relay | None = None, stop_on_error: bool = False) -> dict[int, Message]:
        """One `kind` (of `seq`/`phase` where given) from every rank of `ranks` (default: the
        receivers), within `timeout_s` from now; an `Error` replaces a rank's answer.
        `stop_on_error`: end the wait at the first `Error`. Raises `PushError` naming who failed
        (`errors`) and who said nothing in time (`missing`); `what` names the stage."""
        ranks = self.receivers if ranks is None else ranks
        deadline = Deadline(self.timeout_s)  # nothing below extends it
        self._extend(2 * self.timeout_s)  # the deadman never beats this wait
        got: dict[int, Message] = {}
        what = what or f"failed waiting for {kind.__name__}"
        while any(r not in got and r not in self.errors for r in ranks):
            if stop_on_error and self.errors:
                break
            taken = self._take(deadline)
            if taken is None:
                missing = [r for r in ranks if r not in got and r not in self.errors]
                raise self.failure(what, missing, f"no {kind.__name__} from {who} {missing} "
                                   f"within {self.timeout_s:.1f} s")
            rank, msg = taken
            msg = self._sort(rank, msg)
            if msg is None:
                continue
            if isinstance(msg, Error):
                got.pop(rank, None)
            elif (isinstance(msg, kind) and rank in ranks
                  and (seq is None or getattr(msg, "seq", seq) == seq)
                  and (phase is None or getattr(msg, "phase", phase) == phase)):
                got[rank] = msg
            elif not (relay and relay(rank, msg)):
                log.warning("ignoring stale %s from rank %d while waiting for %s",
                            type(msg).__name__, rank, kind.__name__)
        if self.errors:
            raise self.failure(what)
        return got

    def failure(self, what: str, missing: list[int] | None = None, note: str = "") -> PushError:
        """This update's failure `what` (e.g. "failed at bucket 3"): every rank's error, the
        ranks that could not be reached or said nothing (`missing`), and `note`."""
        missing = sorted(set(missing or []) | set(self.unreachable))
        parts = [named(self.errors)] if self.errors else []
        parts += [f"rank {r} cannot be reached (gone?) sending {m}"
                  for r, m in sorted(self.unreachable.items())]
        parts += [note] if note else []
        return PushError(f"update {self.version} {what}: " + "; ".join(parts),
                         self.errors, missing)

    # ------------------------------------------------------------------ agreement

    def open(self, plan: Message, last: int, ranks: list[int] | None = None,
             meanwhile: Callable[[], None] | None = None) -> None:
        """Send the plan to `ranks` (default: the receivers), wait until each accepted every
        header up to `last`, then send one `Go` for them all. A refusal, or silence, is answered
        by `Abort` to all and raised as `UpdateRefused`. `meanwhile` runs while the receivers
        check the plan."""
        ranks = self.receivers if ranks is None else ranks
        try:
            self.send_all(plan, ranks)
            if meanwhile is not None:
                meanwhile()
            self.gather(Ready, ranks=ranks, seq=last, what="refused at the plan",
                        who="ranks" if ranks == self.receivers else "ranks and senders")
        except PushError as e:
            self.abort(-1, str(e))
            raise UpdateRefused(str(e), e.errors, e.missing) from None
        self.ready = dict.fromkeys(self.receivers, last)
        self.agreed = last
        self.tell(Go(PROTOCOL_VERSION, self.version, last), ranks)

    def poll(self, deadline: Deadline | None = None, *, hold: bool = False,
             relay: Relay | None = None) -> None:
        """Take the answers queued so far (until `deadline`: one at least); then, unless `hold`
        or a rank failed, send `Go` for every header all receivers accepted."""
        while True:
            taken = self._take(deadline or Deadline(0.0))
            if taken is None:
                break
            rank, msg = taken
            msg = self._sort(rank, msg)
            if msg is None or isinstance(msg, Error):
                pass
            elif isinstance(msg, Ready) and rank in self.ready:
                self.ready[rank] = max(self.ready[rank], msg.seq)
            elif not (relay and relay(rank, msg)):
                log.warning("ignoring %s from rank %d mid-update", type(msg).__name__, rank)
            if deadline is not None:
                break
        low = min(self.ready.values(), default=self.agreed)
        if not (hold or self.errors or self.unreachable) and low > self.agreed:
            self.agreed = low
            self.tell(Go(PROTOCOL_VERSION, self.version, low))

    def await_go(self, seq: int) -> None:
        """Wait, within `timeout_s` from now, until every receiver accepted header `seq` and its
        `Go` is sent; `PushError` if a rank failed or said nothing in time."""
        deadline = Deadline(self.timeout_s)
        self._extend(2 * self.timeout_s)
        while self.agreed < seq:
            if self.errors or self.unreachable:
                raise self.failure(f"failed at bucket {seq}")
            if deadline.passed():
                missing = sorted(r for r, k in self.ready.items() if k < seq)
                raise self.failure(f"failed at bucket {seq}", missing,
                                   f"no Ready for bucket {seq} from ranks {missing} within "
                                   f"{self.timeout_s:.1f} s")
            self.poll(deadline)

    # ------------------------------------------------------------------ commit

    def commit(self, buckets: int, phase: int) -> dict[int, Ack]:
        """Gather every receiver's `Ack(phase)` of this update's `buckets`, then send everyone
        `Commit(phase)` (a receiver that cannot be reached fails the update)."""
        acks = self.gather(Ack, phase=phase, what="failed in the commit round")
        bad = sorted(r for r, a in acks.items()
                     if a.version != self.version or a.buckets != buckets)
        if bad:
            raise PushError(f"update {self.version}: ranks {bad} acknowledged another version "
                            "or bucket count")
        commit = Commit(PROTOCOL_VERSION, self.version, phase)
        self.send_all(commit)
        if self.peers:
            self.tell(commit, self.peers)
        return acks
