"""Control plane: the typed wire protocol spoken over ZeroMQ.

Every message is a `msgspec.Struct` of one closed tagged union (`Message`), encoded with msgpack
and decoded with a typed decoder, so a frame from the network can only ever become one of these
plain records: no pickle, nothing executable. Each message carries `protocol`.

One update (sender S, every receiver R):

    S -> R  Plan                   every tensor (a state dict) and the headers of the buckets
                                   known up front: all of them for a state dict, the first
                                   `window` for a stream
    R -> S  Ready(k) | Error       every header up to k checked against the buffer and the model
    S -> R  Go(k) | Abort          every receiver said Ready(k): the collectives up to k will run
    stream only, while buckets flow: S -> R BucketHeader(j); R -> S Ready(j); S -> R Go(j)
    per bucket k, back to back, no round trip:
    S => R  broadcast of exactly header k's `length` bytes (data plane)
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

Several senders (ranks 0..M-1, `SyncConfig.senders`): sender 0 is the coordinator and runs all of
the above with the receivers; every other sender joins its ROUTER (`SenderHello`), opens each
update with an `Offer` of its tensors, gets the `Plan` (each header's `src` names the sender whose
own data-plane group carries the bucket), answers `Ready`, posts its buckets once a `Go` covers
them, sends each `Digest` to the coordinator (relayed to the receivers unchanged) and a `Sent`
after its last one, and ends with the coordinator's `Commit` or `Abort`. One sender: none of this.
"""

from __future__ import annotations

import msgspec

from vllm_nccl_sync.outcomes import ProtocolError

PROTOCOL_VERSION = 5
"""Bumped on every incompatible change of these messages or of the checksums they carry
(5: the CPU bucket checksum sums rows of 512 bytes)."""

MAX_FRAME_BYTES = 16 * 1024 * 1024
"""Upper bound of one control frame; larger frames are rejected before decoding."""


class Slot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tensor (or one chunk of a tensor larger than a bucket) inside a bucket.

    `offset`/`nbytes` locate the bytes in the bucket; `start` is the byte offset of these bytes in
    the full tensor (0 unless the tensor is split over several buckets).
    """

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    start: int = 0


class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A full tensor as the trainer will send it: HF name, wire dtype, full shape."""

    name: str
    dtype: str
    shape: list[int]


class AdapterSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A LoRA adapter as the target of an update (PEFT's names and config).

    The update's tensors are the adapter's (`base_model.model...lora_A.weight` names); the engine
    adds the adapter under `name`/`id`, or replaces the weights of the one it already holds.
    """

    name: str
    id: int
    rank: int
    alpha: float
    target_modules: list[str]


class Hello(msgspec.Struct, tag="hello", frozen=True, forbid_unknown_fields=True):
    """Receiver -> sender once it has joined: who it is and what it can take."""

    protocol: int
    rank: int
    replica: int
    tp_rank: int
    tp_size: int
    bucket_bytes: int
    backend: str
    checksums: bool = True
    """This receiver refuses buckets that no sender checksum covers (its own policy)."""
    dtype: str = ""
    """The dtype the engine holds its floating-point weights in ("": not known); the trainer
    casts to it where the cast is faithful."""


class BucketHeader(msgspec.Struct, tag="bucket", frozen=True, forbid_unknown_fields=True):
    """Bucket `seq` of update `version` is `length` bytes holding `slots`: inside the `Plan`, or
    sender -> receivers on its own for the later buckets of a stream."""

    protocol: int
    version: int
    seq: int
    length: int
    is_last: bool
    slots: list[Slot]
    force: bool = False
    """Accept a `version` not newer than the one the engine holds (rollback on purpose)."""
    staged: bool = False
    """Load nothing until the last bucket arrived and verified (needs memory for a full copy)."""
    src: int = 0
    """The sender whose data-plane group carries this bucket (0 with one sender)."""


class Plan(msgspec.Struct, tag="plan", frozen=True, forbid_unknown_fields=True):
    """Sender -> receivers: opens every update. `tensors`: every tensor of a state dict (empty
    for a stream); `buckets`: the headers known up front (seq 0, 1, ...; all of them for a state
    dict, the first window for a stream, whose later headers follow as `BucketHeader`s).

    Each receiver checks the tensors and every header against its buffer and model, and answers
    once: `Ready(seq=last header)` or `Error`, so a wrong model is refused before any byte moves.
    `full`: the plan claims to cover the whole model.
    """

    protocol: int
    version: int
    tensors: list[TensorSpec]
    full: bool = False
    force: bool = False
    adapter: AdapterSpec | None = None
    """None: the update replaces base weights; else it adds or replaces this LoRA adapter."""
    buckets: list[BucketHeader] = []
    """Headers of buckets 0, 1, ... of this update (at least bucket 0)."""
    staged: bool = False
    """Load nothing until the last bucket arrived and verified (needs memory for a full copy)."""


class Ready(msgspec.Struct, tag="ready", frozen=True, forbid_unknown_fields=True):
    """Receiver -> sender: every header up to `seq` is valid; the receiver will join their
    collectives once a `Go` covers them."""

    protocol: int
    rank: int
    seq: int
    version: int = -1


class Go(msgspec.Struct, tag="go", frozen=True, forbid_unknown_fields=True):
    """Sender -> receivers: every receiver is ready for every bucket up to `seq`; their
    collectives will all be posted, in order, whatever happens afterwards."""

    protocol: int
    version: int
    seq: int


class Digest(msgspec.Struct, tag="digest", frozen=True, forbid_unknown_fields=True):
    """Sender -> receivers on gloo, after bucket `seq`'s collective was posted: `checksum`
    (`integrity.checksum`, 0: none) of its wire bytes, computed while they fly. A receiver checks
    it before loading anything from the bucket. On NCCL the checksums come in the `Seal` only
    (computed on the GPU, read once per update)."""

    protocol: int
    version: int
    seq: int
    checksum: int


class Abort(msgspec.Struct, tag="abort", frozen=True, forbid_unknown_fields=True):
    """Sender -> receivers: update `version` is abandoned at bucket `seq` (-1: the plan; `seq`
    past the last bucket: the commit round). No collective of `seq` or later will be posted."""

    protocol: int
    version: int
    seq: int
    reason: str


class Seal(msgspec.Struct, tag="seal", frozen=True, forbid_unknown_fields=True):
    """Sender -> receivers after the last collective: the update had `buckets` buckets, whose
    checksums are `checksums` (one per bucket, 0: none). Opens the commit round."""

    protocol: int
    version: int
    buckets: int
    checksums: list[int]


class Ack(msgspec.Struct, tag="ack", frozen=True, forbid_unknown_fields=True):
    """Receiver -> sender. Phase 1: every bucket arrived and verified (in place: and is loaded).
    Phase 2 (staged): the verified update is loaded."""

    protocol: int
    rank: int
    version: int
    buckets: int
    bytes: int
    tensors: int
    seconds: float
    phase: int = 1


class Commit(msgspec.Struct, tag="commit", frozen=True, forbid_unknown_fields=True):
    """Sender -> receivers: every receiver acknowledged `phase` of update `version`."""

    protocol: int
    version: int
    phase: int


class Error(msgspec.Struct, tag="error", frozen=True, forbid_unknown_fields=True):
    """Either way: the peer failed; `message` names the problem, `traceback` is the remote one.
    `version` is the update it belongs to (-1: none yet), so a late error of an aborted update
    cannot fail the next one."""

    protocol: int
    rank: int
    seq: int
    message: str
    traceback: str = ""
    version: int = -1


class SenderHello(msgspec.Struct, tag="sender_hello", frozen=True, forbid_unknown_fields=True):
    """Sender `rank` (1..M-1) -> the coordinator (sender 0) once it has joined."""

    protocol: int
    rank: int
    bucket_bytes: int
    backend: str


class Offer(msgspec.Struct, tag="offer", frozen=True, forbid_unknown_fields=True):
    """Sender `rank` -> the coordinator, opening its side of update `version`: the tensors it
    can send. `owned`: it owns exactly these (else they are candidates, balanced by bytes)."""

    protocol: int
    rank: int
    version: int
    tensors: list[TensorSpec]
    owned: bool = True


class Sent(msgspec.Struct, tag="sent", frozen=True, forbid_unknown_fields=True):
    """Sender `rank` -> the coordinator after its last collective of update `version` was posted:
    the checksum of each of its buckets, by seq (0: none)."""

    protocol: int
    rank: int
    version: int
    checksums: dict[int, int]


Message = (Hello | Plan | BucketHeader | Ready | Go | Digest | Abort | Seal | Ack | Commit | Error
           | SenderHello | Offer | Sent)

def belongs(msg: Message, version: int) -> bool:
    """The version rule: is `msg` a message of update `version`?

    A message belongs to an update when it names that update's version. An `Error` naming no
    update (version -1: its sender failed before it learned which update was opening) belongs to
    whichever update is open. `Hello` and `SenderHello` belong to no update (they open sessions).
    """
    got = getattr(msg, "version", None)
    if got is None:
        return False
    return got == version or (got == -1 and isinstance(msg, Error))


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """Encode one message to a msgpack frame."""
    return _encoder.encode(msg)


def decode(frame: bytes | memoryview) -> Message:
    """Decode one frame into a `Message`, or raise `ProtocolError` naming what is wrong."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"control frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
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
    return msg
