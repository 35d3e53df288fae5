"""Control plane: the typed wire protocol spoken over ZeroMQ.

Every message is a `msgspec.Struct` of one closed tagged union (`Message`), encoded with msgpack
and decoded with a typed decoder, so a frame from the network can only ever become one of these
plain records: no pickle, nothing executable. Each message carries `protocol`.

One update (sender S, every receiver R):

    S -> R  Plan                   every tensor (a state dict) and the headers of the buckets
                                   known up front: all of them for a state dict, the first
                                   `window` for a stream
            | Repeat               a plan every receiver accepted before, by its layout's id
    R -> S  Ready(k) | Error       every header up to k checked against the buffer and the model
    S -> R  Go(k) | Abort          every receiver said Ready(k): the collectives up to k will run
    stream only, while buckets flow: S -> R BucketHeader(j); R -> S Ready(j); S -> R Go(j)
    per bucket k, back to back, no round trip:
    S => R  broadcast of exactly header k's `length` bytes (data plane); a header with `at`
            (`ipc`): none, the receiver reads its `length` bytes where the sender's memory holds them
    S -> R  Digest(k)              gloo only: its checksum, computed while the bytes fly; the
                                   receiver checks it before loading anything from bucket k
    then the commit round:
    S -> R  Seal | Abort           how many buckets there were and each one's checksum
    R -> S  Ack(phase 1) | Error   everything arrived and verified (in place: and is loaded)
    S -> R  Commit(1) | Abort      every receiver of every engine acknowledged
    staged updates only:           R loads now; Ack(phase 2) | Error; S -> R Commit(2) | Abort

`Ready` and `Go` are cumulative: `Go(k)` covers every bucket up to k. A receiver never enters a
collective that no `Go` covers, and the sender posts every collective a `Go` covers, whatever
happens afterwards: a disagreement becomes an `Error` + `Abort` on every side instead of a hang,
and a side that fails after `Go` still joins every collective it agreed to, then fails the update
(an `Error` at once, the sender's `Abort` after the last agreed collective). A receiver stamps the
update's version only on the last `Commit`: an engine never reports a version that some of its
workers do not hold.

Layouts agreed once: a `Plan` may give its layout (every tensor and header, but the version) an
id. Once every receiver accepted it and the update committed, the sender opens a later update of
the same layout with a `Repeat` naming that id: one small message instead of the plan, whatever
the size of the model. A receiver holds the layout of the last plan it accepted since it joined;
it answers a `Repeat` of that layout as it would the plan with the new version (every check that
depends on the engine's state runs again: the version held, sleep, the shadow's room), and
refuses a `Repeat` of any other id as a plan it cannot read. Everything after the opening is the
same, checksums of every byte and the commit round included.

Shard to shard (`SyncConfig.shard`): each worker's `Hello` carries its read set; a header may be
for some receivers only (`to`: only they join its collective, point to point) and a slot may
carry only some blocks of its tensor (`Slot.blocks`); a `Digest` goes to a bucket's receivers.

Several senders (ranks 0..M-1, `SyncConfig.senders`): sender 0 is the coordinator and runs all of
the above with the receivers; every other sender joins its ROUTER (`SenderHello`), opens each
update with an `Offer` of its tensors, gets the `Plan` (each header's `src` names the sender whose
own data-plane group carries the bucket), answers `Ready`, posts its buckets once a `Go` covers
them, sends each `Digest` to the coordinator (relayed to the receivers unchanged) and a `Sent`
after its last one, and ends with the coordinator's `Commit` or `Abort`. One sender: none of this.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from vllm_nccl_sync.outcomes import ProtocolError

PROTOCOL_VERSION = 10
"""Bumped on every incompatible change of these messages or of the checksums they carry
(10: a `Plan` may give its layout an id, and a `Repeat` opens an update with that layout; 9: a worker's `Hello` may carry its read set, a slot may carry blocks of its tensor, a header
may name the receivers it is for; 5: the CPU bucket checksum sums rows of 512 bytes; 6: `Hello` carries the engine's `dtype`, and
the decoder enforces the bounds below; 7: a bucket may be read in place from the sender's
exported memory (`BucketHeader.at`), and the CUDA checksum reads the bytes once; 8: such a
bucket gathers its slots from where each lies, one `Source` per slot, and its checksum is
`integrity.checksum_parts` of them)."""

MAX_FRAME_BYTES = 16 * 1024 * 1024
"""Upper bound of one control frame; larger frames are rejected before decoding."""

MAX_NAME_CHARS = 1024
"""A tensor's, an adapter's or a target module's name."""
MAX_WORD_CHARS = 64
"""A dtype or backend name."""
MAX_DIMS = 32
"""Dimensions of one shape."""
MAX_TENSORS = 1 << 18
"""Tensors of a `Plan` or an `Offer`; slots of one bucket."""
MAX_PLAN_BUCKETS = 1 << 17
"""Headers one `Plan` carries."""
MAX_BUCKETS = 1 << 20
"""Buckets of one update: the checksums of a `Seal` or a `Sent`."""
MAX_TARGET_MODULES = 1024
"""Target modules of one LoRA adapter."""
# The bounds, once: the decoder refuses a frame past any of them with the path of the value
# (`invalid message: Expected `int` >= 0 - at `$.buckets[3].length``). Each one is far above what
# a real model needs, and a message at any one bound (with one-character names) still fits in
# MAX_FRAME_BYTES: a Plan of MAX_TENSORS specs is 6.8 MB, a bucket of MAX_TENSORS slots 12.8 MB,
# a Plan of MAX_PLAN_BUCKETS empty headers 10.6 MB, a Seal of MAX_BUCKETS checksums 9.4 MB.
# Integers are non-negative (-1 only where it means "none": `Ready.version`, `Error.seq`,
# `Error.version`, `Abort.seq`); dimensions and checksums fit an int64. Texts that are reports
# (`Abort.reason`, `Error.message`/`traceback`) are clipped by the channel instead, so that an
# over-long report still arrives. Rules between fields (offsets inside a bucket, sizes against
# dtype x shape, slot order) are `packing.validate_header`'s.

_INT64 = 2**63 - 1
Count = Annotated[int, msgspec.Meta(ge=0)]
"""A length, offset, byte count, seq, version or rank."""
Positive = Annotated[int, msgspec.Meta(ge=1)]
OrNone = Annotated[int, msgspec.Meta(ge=-1)]
"""A seq or version where -1 means none."""
Dim = Annotated[int, msgspec.Meta(ge=0, le=_INT64)]
Checksum = Annotated[int, msgspec.Meta(ge=0, le=_INT64)]
"""`integrity.checksum` of a bucket's wire bytes; 0: none."""
Phase = Annotated[int, msgspec.Meta(ge=1, le=2)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
Word = Annotated[str, msgspec.Meta(max_length=MAX_WORD_CHARS)]
Shape = Annotated[list[Dim], msgspec.Meta(max_length=MAX_DIMS)]
Checksums = Annotated[list[Checksum], msgspec.Meta(max_length=MAX_BUCKETS)]


MAX_BLOCKS = 64
"""Blocks of one tensor one worker reads (a fused checkpoint tensor: one per part it holds)."""
MAX_WHY_CHARS = 1024


class Block(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Elements `[start[d], stop[d])` of every dimension `d` of a tensor."""

    start: Shape
    stop: Shape

    def numel(self) -> int:
        return math.prod(b - a for a, b in zip(self.start, self.stop, strict=True))


Blocks = Annotated[list[Block], msgspec.Meta(max_length=MAX_BLOCKS)]


class Read(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one worker reads of one checkpoint tensor of `dtype` and `shape`: `blocks` (none:
    nothing). `why` is set when the read is the whole tensor because the worker's loader could
    not be followed (a computing loader, a refused replay): then `blocks` is the whole tensor."""

    dtype: Word
    shape: Shape
    blocks: Blocks
    why: Annotated[str, msgspec.Meta(max_length=MAX_WHY_CHARS)] = ""

    def numel(self) -> int:
        """Elements of the tensor this worker reads."""
        return sum(b.numel() for b in self.blocks)


class ReadSet(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One worker's reads (`worker`: its rank inside its engine replica), by checkpoint name."""

    worker: Count
    tensors: Annotated[dict[Name, Read], msgspec.Meta(max_length=MAX_TENSORS)]


class Slot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tensor (or one chunk of a tensor larger than a bucket) inside a bucket.

    `offset`/`nbytes` locate the bytes in the bucket; `start` is the byte offset of these bytes in
    the full tensor (0 unless the tensor is split over several buckets). With `blocks`, the slot
    carries only these blocks of the tensor (of `shape`), each in row-major order, one after the
    other: `start` and `nbytes` then index that concatenation (shard to shard).
    """

    name: Name
    dtype: Word
    shape: Shape
    offset: Count
    nbytes: Count
    start: Count = 0
    blocks: Blocks | None = None


class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A full tensor as the trainer will send it: HF name, wire dtype, full shape."""

    name: Name
    dtype: Word
    shape: Shape


Tensors = Annotated[list[TensorSpec], msgspec.Meta(max_length=MAX_TENSORS)]


class AdapterSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A LoRA adapter as the target of an update (PEFT's names and config).

    The update's tensors are the adapter's (`base_model.model...lora_A.weight` names); the engine
    adds the adapter under `name`/`id`, or replaces the weights of the one it already holds.
    """

    name: Name
    id: Count
    rank: Count
    alpha: float
    target_modules: Annotated[list[Name], msgspec.Meta(max_length=MAX_TARGET_MODULES)]


class Hello(msgspec.Struct, tag="hello", frozen=True, forbid_unknown_fields=True):
    """Receiver -> sender once it has joined: who it is and what it can take."""

    protocol: int
    rank: Count
    replica: Count
    tp_rank: Count
    tp_size: Positive
    bucket_bytes: Positive
    backend: Word
    checksums: bool = True
    """This receiver refuses buckets that no sender checksum covers (its own policy)."""
    dtype: Word = ""
    """The dtype the engine holds its floating-point weights in ("": not known); the trainer
    casts to it where the cast is faithful."""
    reads: ReadSet | None = None
    """What this worker's loaders read of each checkpoint tensor (`wire.reads`; None: not
    published): the trainer then sends it only that (shard to shard)."""


class Source(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a slot's bytes already lie: byte `offset` of memory `segment` that the sender
    exported on its data plane (each receiver maps a segment once and checks the range)."""

    segment: Count
    offset: Count


class BucketHeader(msgspec.Struct, tag="bucket", frozen=True, forbid_unknown_fields=True):
    """Bucket `seq` of update `version` is `length` bytes holding `slots`: inside the `Plan`, or
    sender -> receivers on its own for the later buckets of a stream."""

    protocol: int
    version: Count
    seq: Count
    length: Count
    is_last: bool
    slots: Annotated[list[Slot], msgspec.Meta(max_length=MAX_TENSORS)]
    force: bool = False
    """Accept a `version` not newer than the one the engine holds (rollback on purpose)."""
    staged: bool = False
    """Load nothing until the last bucket arrived and verified (needs memory for a full copy)."""
    src: Count = 0
    """The sender whose data-plane group carries this bucket (0 with one sender)."""
    at: Annotated[list[Source], msgspec.Meta(max_length=MAX_TENSORS)] | None = None
    """Set on a plane whose receivers map the sender's memory (`ipc`): slot i's `nbytes` lie at
    `at[i]` and are read there, nothing is broadcast or packed (one copy per byte). `length`
    and the slots' offsets are still the packed layout's, so every size is agreed alike."""
    to: Annotated[list[Count], msgspec.Meta(max_length=MAX_TENSORS)] | None = None
    """The receivers (ranks) this bucket goes to, point to point; None: every receiver. A
    receiver joins the collectives of its own buckets only (shard to shard)."""


class Plan(msgspec.Struct, tag="plan", frozen=True, forbid_unknown_fields=True):
    """Sender -> receivers: opens every update. `tensors`: every tensor of a state dict (empty
    for a stream); `buckets`: the headers known up front (seq 0, 1, ...; all of them for a state
    dict, the first window for a stream, whose later headers follow as `BucketHeader`s).

    Each receiver checks the tensors and every header against its buffer and model, and answers
    once: `Ready(seq=last header)` or `Error`, so a wrong model is refused before any byte moves.
    `full`: the plan claims to cover the whole model.
    """

    protocol: int
    version: Count
    tensors: Tensors
    full: bool = False
    force: bool = False
    adapter: AdapterSpec | None = None
    """None: the update replaces base weights; else it adds or replaces this LoRA adapter."""
    buckets: Annotated[list[BucketHeader], msgspec.Meta(max_length=MAX_PLAN_BUCKETS)] = []
    """Headers of buckets 0, 1, ... of this update (at least bucket 0)."""
    staged: bool = False
    """Load nothing until the last bucket arrived and verified (needs memory for a full copy)."""
    layout: Count = 0
    """The id the sender gives this plan's layout (0: none): once every receiver accepted the
    plan and its update committed, a later update of the same layout may open with a `Repeat`."""


class Repeat(msgspec.Struct, tag="repeat", frozen=True, forbid_unknown_fields=True):
    """Sender -> receivers: opens update `version` as the plan of layout `layout` opened its
    own, with this version (the same tensors, headers and flags). A receiver whose last accepted
    plan (since it joined) is not of that layout refuses the update."""

    protocol: int
    version: Count
    layout: Positive


class Ready(msgspec.Struct, tag="ready", frozen=True, forbid_unknown_fields=True):
    """Receiver -> sender: every header up to `seq` is valid; the receiver will join their
    collectives once a `Go` covers them."""

    protocol: int
    rank: Count
    seq: Count
    version: OrNone = -1


class Go(msgspec.Struct, tag="go", frozen=True, forbid_unknown_fields=True):
    """Sender -> receivers: every receiver is ready for every bucket up to `seq`; their
    collectives will all be posted, in order, whatever happens afterwards."""

    protocol: int
    version: Count
    seq: Count


class Digest(msgspec.Struct, tag="digest", frozen=True, forbid_unknown_fields=True):
    """Sender -> receivers on gloo, after bucket `seq`'s collective was posted: `checksum`
    (`integrity.checksum`, 0: none) of its wire bytes, computed while they fly. A receiver checks
    it before loading anything from the bucket. On NCCL the checksums come in the `Seal` only
    (computed on the GPU, read once per update)."""

    protocol: int
    version: Count
    seq: Count
    checksum: Checksum


class Abort(msgspec.Struct, tag="abort", frozen=True, forbid_unknown_fields=True):
    """Sender -> receivers: update `version` is abandoned at bucket `seq` (-1: the plan; `seq`
    past the last bucket: the commit round). No collective of `seq` or later will be posted."""

    protocol: int
    version: Count
    seq: OrNone
    reason: str


class Seal(msgspec.Struct, tag="seal", frozen=True, forbid_unknown_fields=True):
    """Sender -> receivers after the last collective: the update had `buckets` buckets, whose
    checksums are `checksums` (one per bucket, 0: none). Opens the commit round."""

    protocol: int
    version: Count
    buckets: Count
    checksums: Checksums


class Ack(msgspec.Struct, tag="ack", frozen=True, forbid_unknown_fields=True):
    """Receiver -> sender. Phase 1: every bucket arrived and verified (in place: and is loaded).
    Phase 2 (staged): the verified update is loaded."""

    protocol: int
    rank: Count
    version: Count
    buckets: Count
    bytes: Count
    tensors: Count
    seconds: Annotated[float, msgspec.Meta(ge=0)]
    phase: Phase = 1


class Commit(msgspec.Struct, tag="commit", frozen=True, forbid_unknown_fields=True):
    """Sender -> receivers: every receiver acknowledged `phase` of update `version`."""

    protocol: int
    version: Count
    phase: Phase


class Error(msgspec.Struct, tag="error", frozen=True, forbid_unknown_fields=True):
    """Either way: the peer failed; `message` names the problem, `traceback` is the remote one.
    `version` is the update it belongs to, so a late error of an aborted update cannot fail the
    next one; -1 names none and belongs to no update (a side that failed before any update
    opened tells nobody: nobody asked)."""

    protocol: int
    rank: Count
    seq: OrNone
    message: str
    traceback: str = ""
    version: OrNone = -1


class SenderHello(msgspec.Struct, tag="sender_hello", frozen=True, forbid_unknown_fields=True):
    """Sender `rank` (1..M-1) -> the coordinator (sender 0) once it has joined."""

    protocol: int
    rank: Count
    bucket_bytes: Positive
    backend: Word


class Offer(msgspec.Struct, tag="offer", frozen=True, forbid_unknown_fields=True):
    """Sender `rank` -> the coordinator, opening its side of update `version`: the tensors it
    can send. `owned`: it owns exactly these (else they are candidates, balanced by bytes)."""

    protocol: int
    rank: Count
    version: Count
    tensors: Tensors
    owned: bool = True
    parts: Annotated[dict[Name, Block], msgspec.Meta(max_length=MAX_TENSORS)] = {}
    """Tensors this sender holds one block of only (its shard of a sharded tensor: FSDP), by
    name; `tensors` gives their full dtype and shape. Shard to shard sends from these blocks."""


class Sent(msgspec.Struct, tag="sent", frozen=True, forbid_unknown_fields=True):
    """Sender `rank` -> the coordinator after its last collective of update `version` was posted:
    the checksum of each of its buckets, by seq (0: none)."""

    protocol: int
    rank: Count
    version: Count
    checksums: Annotated[dict[Count, Checksum], msgspec.Meta(max_length=MAX_BUCKETS)]


Message = (Hello | Plan | Repeat | BucketHeader | Ready | Go | Digest | Abort | Seal | Ack | Commit
           | Error | SenderHello | Offer | Sent)


def belongs(msg: Message, version: int) -> bool:
    """The version rule: is `msg` a message of update `version`?

    A message belongs to an update when it names that update's version; every failure is its
    update's. One naming none (version -1) belongs to no update: were such an `Error` taken by
    whichever update is open, a stale failure would fail the next update. `Hello` and
    `SenderHello` belong to no update (they open sessions).
    """
    got = getattr(msg, "version", None)
    return got is not None and got >= 0 and got == version


class UnreadablePlan(ProtocolError):
    """A frame that claims to be the `Plan` of update `version` but does not decode (a value
    past its bounds, another protocol): its update is known, so it can be refused as such."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


class _Opening(msgspec.Struct, tag="plan"):
    """All that is read of a frame that does not decode as a `Plan`: the update it opens
    (every other field skipped unchecked)."""

    version: Count


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_opening = msgspec.msgpack.Decoder(_Opening)


def encode(msg: Message) -> bytes:
    """Encode one message to a msgpack frame."""
    return _encoder.encode(msg)


def decode(frame: bytes | memoryview) -> Message:
    """Decode one frame into a `Message`, or raise `ProtocolError` naming what is wrong: a frame
    over `MAX_FRAME_BYTES`, bytes that are no message, a value past the types' bounds (with its
    path), or another protocol version (of the message, or of a header nested in a `Plan`).
    `UnreadablePlan` where the frame is tagged a `Plan` whose version can still be read."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"control frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return _checked(frame)
    except ProtocolError as e:
        version = _plan_version(frame)
        if version is None:
            raise
        raise UnreadablePlan(str(e), version) from None


def _plan_version(frame: bytes | memoryview) -> int | None:
    """The version a frame tagged as a `Plan` names (None: another tag, or none readable)."""
    try:
        return _opening.decode(frame).version
    except (msgspec.DecodeError, RecursionError):  # a ValidationError is a DecodeError
        return None


def _checked(frame: bytes | memoryview) -> Message:
    """`decode` of a frame within `MAX_FRAME_BYTES`."""
    try:
        msg = _decoder.decode(frame)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid message: {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable frame: {e}") from None
    except RecursionError:  # msgspec skipping a deeply nested value while it looks for the tag
        raise ProtocolError("undecodable frame: nested too deeply") from None
    if msg.protocol != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {msg.protocol} received, this side speaks {PROTOCOL_VERSION}"
        )
    if isinstance(msg, Plan):
        for i, h in enumerate(msg.buckets):
            if h.protocol != PROTOCOL_VERSION:
                raise ProtocolError(f"bucket {i} of the plan speaks protocol {h.protocol}, "
                                    f"this side {PROTOCOL_VERSION}")
    return msg
