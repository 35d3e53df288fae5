"""The send template: one update as every sender sends it.

`send` owns the sequence of an update on the trainer side, whoever sends: the plan agreed and
its `Go` (`Sender.agree`), every bucket the `Go` covers posted on the lane (`BucketLane`), the
last collectives and checksums drained, the `Seal`, each phase's `Ack`s and `Commit` (two when
staged); on any failure, `Abort` to every live rank, the group given up where it may be out of
step, and the failure translated once into the `PushError` the caller sees
(`outcomes.as_push_error`). It builds the `PushResult`.

What differs is supplied by a `Sender`, one per update:

* its plan and where its bytes come from: `agree` returns its buckets, each header with how to
  make its wire bytes. One sender (`push.OneSender`): a state dict laid out whole, or a stream
  packed as it is pulled, whose iterator announces the next headers while buckets fly and ends
  early on a failure once every agreed bucket is out. Several senders (`multisend.Coordinator`,
  `multisend.PeerUpdate`): the buckets the coordinator's plan gives this rank, from the tensors
  it holds;
* `checked`: after its last collective, what went wrong anywhere (raised), and the update's
  bucket count for the `Seal`;
* `verdict`: where the update is sealed and decided. `Lead`: here, in the control rounds with
  the receivers (one sender, the coordinator); a peer sender's `verdict` follows the
  coordinator (`Sent`, then its `Commit`s or its `Abort`).

Shard to shard changes no step here: each supplier plans from the workers' read sets
(`shards`: one sender's buckets, or the coordinator's plan of every rank's intersections), its
headers name each bucket's blocks and the workers it goes to, and reaching some workers rather
than all is the plane's business, behind `Transport`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from vllm_nccl_sync.outcomes import PushError, UpdateRefused, as_push_error, clip
from vllm_nccl_sync.trainer.lane import BucketLane
from vllm_nccl_sync.trainer.rounds import Rounds
from vllm_nccl_sync.trainer.tensors import Caster, Progress, PushResult
from vllm_nccl_sync.wire.protocol import PROTOCOL_VERSION, Ack, BucketHeader, Seal

Wire = Callable[[], torch.Tensor]
"""How to make one bucket's wire bytes (called once, when the bucket is posted)."""
Buckets = Iterator[tuple[BucketHeader, Wire]]
"""A sender's buckets in the order it posts them."""


class Verdict(Protocol):
    """Where a sender's update is sealed and decided."""

    def seal(self, version: int, buckets: int, sums: Mapping[int, int]) -> None:
        """Every bucket is out: the update's count and checksums go to who judges them."""

    def commit(self, buckets: int, phase: int) -> list[Ack]:
        """Phase `phase` decided: `Commit(phase)` (every receiver's `Ack`s where known)."""

    def abort(self, seq: int, reason: str) -> None:
        """The update is abandoned at `seq`: tell whoever must hear it (never raises)."""


class Sender(Protocol):
    """What one kind of sender supplies to `send` (see the module text); a supplier that
    subclasses it inherits the defaults of `beside` and `per_sender`."""

    lane: BucketLane
    verdict: Verdict
    side: str
    """Names this sender in a failure of its own ("the trainer")."""
    armed_s: float
    """How long the data plane's deadman gives the update before its first extension."""
    layout: tuple[int, tuple] | None = None
    """This update's layout (its id and key) where its plan gave it one: once the update
    committed, every receiver holds it, and the next update of it may open with a `Repeat`."""

    def agree(self) -> Buckets:
        """The plan agreed and its `Go` sent (or received); then this sender's buckets."""

    def beside(self) -> AbstractContextManager[None]:
        """What runs beside the collectives until they are drained (nothing by default)."""
        return nullcontext()

    def checked(self, sums: dict[int, int]) -> int:
        """After the last collective: raise what failed anywhere; else add the checksums other
        senders reported to `sums` and return the update's bucket count."""

    def stop(self) -> tuple[int, str]:
        """Where a failed update stops: the seq its `Abort` names, and how the failure's text
        names it (" at bucket 3", or "")."""

    def out_of_step(self, e: BaseException) -> bool:
        """Whether failure `e` may have left a collective pending that will never complete."""

    def per_sender(self) -> dict[int, int]:
        """The bytes each sender rank sent, where this sender knows them ({} by default)."""
        return {}

    def per_receiver(self) -> dict[int, int]:
        """The bytes each receiver was sent, where buckets went to some only ({} by default)."""
        return {}


class Lead:
    """The verdict made here, in the control rounds with every receiver (and other senders)."""

    def __init__(self, rounds: Rounds) -> None:
        self.rounds = rounds

    def seal(self, version: int, buckets: int, sums: Mapping[int, int]) -> None:
        self.rounds.send_all(Seal(PROTOCOL_VERSION, version, buckets,
                                  [sums.get(k, 0) for k in range(buckets)]))

    def commit(self, buckets: int, phase: int) -> list[Ack]:
        return list(self.rounds.commit(buckets, phase).values())

    def abort(self, seq: int, reason: str) -> None:
        self.rounds.abort(seq, reason)


def send(s: Sender, version: int, caster: Caster, *, staged: bool,
         progress: Progress | None = None,
         verified: Callable[[], None] | None = None) -> PushResult:
    """Send update `version` as `s` supplies it; returns once it was committed. `verified`
    (staged) is called once every receiver verified everything, before the last `Commit`.
    Raises `UpdateRefused` for a refused plan (nothing moved), else `PushError`."""
    lane = s.lane
    lane.begin()
    try:
        with lane.transport.armed(s.armed_s, f"update {version}"):
            buckets = s.agree()
            t0 = time.perf_counter()
            with s.beside():
                for header, wire in buckets:
                    lane.post(header, wire)
                    del wire  # the bucket's tensors go as soon as they are on the wire
                    if progress:
                        progress(lane.posted, lane.bytes, time.perf_counter() - t0)
                sums = lane.drain()
            total = s.checked(sums)
            s.verdict.seal(version, total, sums)
            acks = s.verdict.commit(total, 1)
            if staged:
                if verified is not None:
                    verified()
                s.verdict.commit(total, 2)
    except Exception as e:  # a receiver, a sender or the tensor source failed: end every wait
        err = _failed(s, version, e)
        if err is e:
            raise
        raise err from e
    return PushResult(version, lane.posted, lane.bytes, lane.tensors, time.perf_counter() - t0,
                      acks, s.per_sender(), s.per_receiver(), cast=dict(caster.cast))


def _failed(s: Sender, version: int, e: Exception) -> PushError:
    """Answer failure `e` everywhere it must be heard, once; the `PushError` to raise."""
    seq, where = s.stop()
    if not isinstance(e, UpdateRefused):  # (a refusal was already answered by Abort)
        s.verdict.abort(seq, str(e))
    if s.out_of_step(e):  # the group cannot be trusted any more: every rank joins again
        s.lane.transport.abort(f"update {version} failed: {clip(str(e), 300)}")
    return as_push_error(e, f"update {version} failed{where}", s.side)
