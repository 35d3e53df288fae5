"""What an update ends with, on either side: one exception base, the typed per-worker summary,
the typed `Problem` a check finds, and the one translation of any failure into the trainer's
`PushError`.

Every error this package raises about an update is a `SyncError`; each keeps the builtin base it
always had (`RuntimeError`, `ValueError`), so existing `except` clauses still catch it. A check
returns a `Problem` (a `Kind` and the text the sender and the user see) or None where it finds
none; `Problem.error` is the one place a kind becomes an exception.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from typing import Any

ERROR_MESSAGE_CHARS = 2_000
"""An error text crossing a process boundary is clipped to this many characters."""


def _cut_mark(text: str, keep_of: int) -> tuple[str, int]:
    """The cut marker for `text` shortened to `keep_of` characters, and how many text keeps."""
    n = len(text) - keep_of
    while True:  # the marker's own length depends on n; converges in a step or two
        mark = f" \u2026 [{n} chars cut] \u2026 "
        keep = keep_of - len(mark)
        if len(text) - keep == n or keep <= 0:
            return mark, keep
        n = len(text) - keep


def clip(text: str, limit: int = ERROR_MESSAGE_CHARS) -> str:
    """`text` if it has at most `limit` characters, else `head … [N chars cut] … tail` of
    exactly `limit` characters (a plain cut when `limit` is too small for the marker)."""
    if len(text) <= limit:
        return text
    mark, keep = _cut_mark(text, limit)
    if keep <= 0:
        return text[: max(limit, 0)]
    head = keep - keep // 2
    return text[:head] + mark + text[len(text) - keep // 2 :]


def clip_tail(text: str, limit: int) -> str:
    """Like `clip`, keeping only the tail (the end of a traceback says most)."""
    if len(text) <= limit:
        return text
    mark, keep = _cut_mark(text, limit)
    if keep <= 0:
        return text[len(text) - max(limit, 0) :]
    return mark.lstrip() + text[len(text) - keep :]


class SyncError(Exception):
    """Base of every error this package raises about a join or an update."""


class ProtocolError(SyncError, ValueError):
    """A frame or message that breaks the protocol; the text names the problem."""


class PeerFailed(SyncError, RuntimeError):
    """A data-plane transfer with `rank` failed (the peer died, or the group timed out)."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class NotUpdatable(SyncError, ValueError):
    """An engine this package cannot update in place (e.g. a drafter with weights of its own);
    the text says why and what to change."""


class UpdateFailed(SyncError, RuntimeError):
    """Engine side: this update did not complete; the text says why and on which side."""


class PushError(SyncError, RuntimeError):
    """Trainer side: an update failed.

    `errors`: each failing receiver's (or sender's) message by rank; `missing`: ranks that said
    nothing in time (gone, or stuck); `summaries`: the workers' own reports, where the front door
    collected them (`WeightSync`).
    """

    def __init__(self, message: str, errors: dict[int, str] | None = None,
                 missing: list[int] | None = None,
                 summaries: list[WorkerSummary] | None = None) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})
        self.missing = list(missing or [])
        self.summaries = list(summaries or [])

    def with_summaries(self, summaries: list[WorkerSummary]) -> PushError:
        """The same error (same class, texts, ranks and cause), also carrying `summaries`, and
        naming the failures the workers reported that the trainer did not already name."""
        extra = [s for s in summaries if not s.ok and s.error
                 and s.rank not in self.errors and s.error not in str(self)]
        text = str(self)
        if extra:
            text += "; " + "; ".join(f"rank {s.rank}: {clip(s.error, 500)}" for s in extra)
        err = type(self)(text, self.errors, self.missing, summaries)
        err.__cause__ = self.__cause__
        return err


class UpdateRefused(PushError):
    """A receiver refused the plan or a header before any byte moved; every receiver was sent
    `Abort`, and every engine still holds its previous weights."""


class Kind(enum.Enum):
    """What a check refused (a receiver's, unless said otherwise)."""

    PLAN = "plan"
    """The plan as such: unreadable, without buckets, naming a tensor twice, of a version already
    held, or for an adapter this engine does not take."""
    MODEL = "model"
    """Tensors that disagree with the engine's model (its `Reference`)."""
    HEADER = "header"
    """A bucket header the protocol's rules refuse."""
    MAPPING = "mapping"
    """Sender's memory a header names that cannot be read where it lies."""
    HANDLE = "handle"
    """A CUDA IPC handle whose reference counter is not one the sender's process made."""
    RESIDENCY = "residency"
    """The engine's sleep state: weights asleep, or discarded and not all rewritten."""
    SHADOW = "shadow"
    """An update received beside serving that is not staged, or whose shadow does not fit."""
    OVERRUN = "overrun"
    """A bucket broadcast more bytes than its header's length."""
    DIGEST = "digest"
    """A bucket whose checksum disagrees with (or lacks) the sender's `Digest`."""
    SEAL = "seal"
    """A `Seal` that disagrees with what arrived: the bucket count or a checksum."""
    LOAD = "load"
    """The loader (vLLM's or the user's) failed."""
    COVERAGE = "coverage"
    """An update that must rewrite every weight and did not."""
    LOST = "lost"
    """Trainer side: peers that left the data plane during an update."""
    DRAFTER = "drafter"
    """An engine whose speculative decoding keeps a draft model an update would not reach."""
    READS = "reads"
    """Read sets of one engine's workers that do not tile its checkpoint: a block outside its
    tensor, blocks of one worker that overlap, an element no worker reads."""


_RAISES: dict[Kind, type[SyncError]] = {Kind.HANDLE: ProtocolError, Kind.DRAFTER: NotUpdatable}
"""The exception of each kind that is not an `UpdateFailed` (the update failed on this side)."""


@dataclass(frozen=True, slots=True)
class Problem:
    """What a check found wrong: its `kind`, and the `text` the sender and the user see. A
    problem is never empty; a check that finds none returns None."""

    kind: Kind
    text: str

    def __post_init__(self) -> None:
        if not self.text:
            raise ValueError(f"a {self.kind.value} problem needs a text")

    def __str__(self) -> str:
        return self.text

    def at(self, where: str) -> Problem:
        """The same problem, its text prefixed with `where` (e.g. "rank 1 refused update 3")."""
        return Problem(self.kind, f"{where}: {self.text}")

    def error(self) -> SyncError:
        """The exception this problem raises as (`raise problem.error()`): the one mapping."""
        return _RAISES.get(self.kind, UpdateFailed)(self.text)


def as_push_error(e: BaseException, what: str, side: str) -> PushError:
    """`e` as the `PushError` to raise for a failed update (`what`, e.g. "update 3 failed"):
    itself if it is one; a data-plane peer that left, as `missing` that rank; else failed on
    `side` (e.g. "the trainer")."""
    if isinstance(e, PushError):
        return e
    if isinstance(e, PeerFailed):
        return PushError(f"{what}: rank {e.rank} left the data plane: {clip(str(e))}",
                         missing=[e.rank])
    return PushError(f"{what} on {side}: {clip(repr(e))}")


CARRY_RPC = "nccl_sync_swap_carry"
"""The worker RPC of a swap with running requests kept in flight (`pause_mode="carry"`). vLLM's
engine core takes it (`integrations.vllm.patches.swap_turn`); a worker it reaches answers, without
loading,
a summary whose `carry` is `CARRY_UNSUPPORTED`."""
CARRY_UNSUPPORTED = "unsupported"
ENDS_UPDATE = ("nccl_sync_receive", "nccl_sync_swap", CARRY_RPC)
"""The worker RPCs after which an update is live on the engine: its label is set in their turn."""


def version_label(version: int) -> str:
    """vLLM's weight-version label of this project's `version`: its decimal digits ("7"). The
    one mapping, both ways (`label_version`)."""
    return str(version)


def label_version(label: str) -> int:
    """The version vLLM's label names (`version_label`'s inverse); -1 for any other label, such
    as vLLM's "default" (the weights the engine started with)."""
    return int(label) if label.isdigit() else -1


def committed_version(results: list[Any]) -> int | None:
    """The base weights' version that every worker's summary in `results` (an `ENDS_UPDATE`
    call's answers) reports committed: ok, consistent, one version. None where any did not,
    where they disagree, or for a LoRA adapter's update (the base weights' label stays)."""
    if not results or not all(isinstance(r, dict) for r in results):
        return None
    if not all(r.get("ok") and r.get("consistent") and "adapter" not in r for r in results):
        return None
    versions = {r.get("version") for r in results}
    if len(versions) != 1:
        return None
    v = versions.pop()
    return v if isinstance(v, int) and v >= 0 else None


@dataclass(slots=True)
class WorkerSummary:
    """One worker's report of one update (or of a call that could not run one).

    Crosses RPC boundaries as `to_dict()` (msgpack-native); `from_dict` reads it back, keeping
    keys it does not know in `extra`.
    """

    ok: bool
    rank: int = -1
    version: int = -1
    """The version this worker holds after the call (-1: the weights it started with)."""
    consistent: bool = True
    buckets: int = 0
    bytes: int = 0
    tensors: int = 0
    seconds: float = 0.0
    error: str = ""
    load: dict[str, Any] = field(default_factory=dict)
    """What loading took (layers re-processed, ...), when the loader reports it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Per update: `steps_ms`, the ms spent reaching each step from the one before (`plan`,
    `ready`, `bucket` arrived and `kept` loaded summed over buckets, `read`, `sealed`,
    `checked`, `finished`, `acked`, `committed`, ...); `adapter`, `dropped` where they apply."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("extra"))
        if not d["error"]:
            del d["error"]
        if not d["load"]:
            del d["load"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerSummary:
        known = {f.name for f in fields(cls)} - {"extra"}
        kw = {k: v for k, v in d.items() if k in known}
        kw["error"] = kw.get("error") or ""
        kw["load"] = dict(kw.get("load") or {})
        return cls(extra={k: v for k, v in d.items() if k not in known}, **kw)
