"""Control frames: the `[tag, payload]` format both channel ends speak, built and checked once.

Every frame is `[tag, payload]` (a ROUTER adds the routing id in front), `payload` being one
encoded message (`encode_payload`: an `Error`'s `message` cut to `ERROR_MESSAGE_CHARS` and its
`traceback` to its last `ERROR_TRACEBACK_CHARS` characters; `bounded` again on receipt) and `tag`

    meta = framing version (1 B) | session (16 B) | epoch (16 B) | counter (8 B) | rank (4 B)
    tag  = meta | HMAC-SHA256(secret, domain | direction | meta | payload)   (no MAC without secret)

`direction` (`TO_SENDER` "R>S" or `TO_RECEIVER` "S>R") is inside the MAC, so a frame cannot be
reflected back. `check_frame` runs the checks every frame passes whichever way it goes, in this order,
before its payload is decoded: frame count, payload size (<= MAX_FRAME_BYTES, before any hashing),
tag length, MAC (`hmac.compare_digest`), framing version. What the session, epoch, counter and
rank must be is each end's own rule (`channel.py`). A frame failing a check becomes a
`Rejection`, which the channel counts (`Rejections`, by reason) and logs with the peer; the wait
it arrived in goes on.

What a shared secret covers (a peer without it can reach the port but not the protocol):
- forging or altering any message, either way; joining as a receiver; pushing to a receiver;
- replaying a captured frame to a receiver (session + counter + pinned epoch): never accepted;
- replaying to the trainer: any frame of a session this trainer has seen (counters), frames of
  an earlier trainer instance (epoch), frames moved to another session or rank;
- squatting a rank: ranks are bound to authenticated sessions, not to socket identities.

What it does not cover:
- confidentiality: frames are readable on the wire (use CURVE, `channel.py`, or a trusted network);
- the data plane: the broadcast bytes and the group's TCPStore rendezvous are not
  authenticated; keep them on a trusted interface;
- a captured `Hello` (the only frame sent before the receiver knows the epoch) replayed to a new
  trainer instance that never saw its session: it binds that rank to the attacker's connection
  until the real receiver's own `Hello` re-binds it -- a denial of service, never data;
- an eavesdropper who learns a session id connecting with it: it takes that receiver's routing
  over (ROUTER_HANDOVER) until the receiver reconnects; again a denial of service (CURVE hides
  session ids);
- resource use by unauthenticated peers: ZeroMQ buffers a whole multipart message before it is
  checked; CURVE stops such peers at the handshake;
- without a secret: nothing is authenticated; sessions and counters then only catch stale frames.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from vllm_nccl_sync.outcomes import ERROR_MESSAGE_CHARS, clip, clip_tail
from vllm_nccl_sync.wire.protocol import MAX_FRAME_BYTES, Error, Message, ProtocolError, encode

log = logging.getLogger(__name__)

FRAMING = 1
"""Version of the `[tag, payload]` framing (independent of `PROTOCOL_VERSION`)."""
META = struct.Struct(">B16s16sQI")
"""framing, session, epoch, counter, rank."""
MAC_BYTES = 32
NO_EPOCH = bytes(16)
"""The epoch of a receiver's frames before it has heard from the trainer."""
TO_SENDER, TO_RECEIVER = b"R>S", b"S>R"
MAX_WIRE_BYTES = MAX_FRAME_BYTES + 64
"""ZeroMQ's MAXMSGSIZE on both ends: a larger frame makes libzmq drop the connection it came on."""
ERROR_TRACEBACK_CHARS = 8_000
"""An `Error`'s `traceback` is clipped to its last this many characters."""

_DOMAIN = b"vllm-nccl-sync/channel/1 "
_LOG_FIRST, _LOG_EVERY = 20, 1000  # log the first rejections, then one in _LOG_EVERY


@dataclass(frozen=True, slots=True)
class FrameMeta:
    """What a frame's tag says: whose session, which trainer instance, which frame, which rank."""

    session: bytes
    epoch: bytes
    counter: int
    rank: int


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a frame is dropped: `reason` (counted; the texts are stable) and a `detail`."""

    reason: str
    detail: str = ""


def bounded(msg: Message) -> Message:
    """`msg` with the free texts of an `Error` clipped (other messages unchanged)."""
    if isinstance(msg, Error) and (len(msg.message) > ERROR_MESSAGE_CHARS
                                   or len(msg.traceback) > ERROR_TRACEBACK_CHARS):
        msg = msgspec.structs.replace(
            msg, message=clip(msg.message), traceback=clip_tail(msg.traceback, ERROR_TRACEBACK_CHARS)
        )
    return msg


def encode_payload(msg: Message) -> bytes:
    """The payload of `msg` (an `Error`'s texts clipped); `ProtocolError` if it would be over
    `MAX_FRAME_BYTES` (never a frame the peer would drop)."""
    payload = encode(bounded(msg))
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"{type(msg).__name__} encodes to {len(payload)} bytes, over {MAX_FRAME_BYTES}"
        )
    return payload


def mac(secret: bytes | None, direction: bytes, meta: bytes, payload) -> bytes:
    """HMAC-SHA256 of a frame going `direction` (b"" without a secret)."""
    if not secret:
        return b""
    h = hmac.new(secret, _DOMAIN + direction, hashlib.sha256)
    h.update(meta)
    h.update(payload)
    return h.digest()


def mac_matches(secret: bytes | None, direction: bytes, meta: bytes, payload, tag) -> bool:
    """Whether `tag` is `mac(...)` of these (in constant time): the one MAC check."""
    return hmac.compare_digest(bytes(tag), mac(secret, direction, meta, payload))


def build_tag(secret: bytes | None, direction: bytes, meta: FrameMeta, payload) -> bytes:
    """The tag of `payload` sent `direction` with `meta`."""
    packed = META.pack(FRAMING, meta.session, meta.epoch, meta.counter, meta.rank)
    return packed + mac(secret, direction, packed, payload)


def check_frame(secret: bytes | None, direction: bytes, parts: Sequence) -> FrameMeta | Rejection:
    """The meta of a frame `[tag, payload]` (buffers) that came `direction`, or why it is
    refused: a wrong frame count, an oversized payload (refused before any hashing), a tag of the
    wrong length, a MAC missing, unexpected or wrong, or another framing version."""
    if len(parts) != 2:
        return Rejection("malformed", f"{len(parts)} frames, expected 2")
    tag, payload = parts
    if len(payload) > MAX_FRAME_BYTES:
        return Rejection("oversized", f"{len(payload)} bytes")
    if len(tag) != META.size + (MAC_BYTES if secret else 0):
        if len(tag) in (META.size, META.size + MAC_BYTES):
            return Rejection("bad MAC", "a secret is configured on one side only")
        return Rejection("malformed", f"tag of {len(tag)} bytes")
    packed = bytes(tag[: META.size])
    if not mac_matches(secret, direction, packed, payload, tag[META.size :]):
        return Rejection("bad MAC")
    framing, session, epoch, counter, rank = META.unpack(packed)
    if framing != FRAMING:
        return Rejection("malformed", f"framing {framing}")
    return FrameMeta(session, epoch, counter, rank)


class Rejections:
    """Counts dropped frames by reason and logs them (rate-limited) with the peer."""

    def __init__(self) -> None:
        self.by_reason: Counter[str] = Counter()
        self.total = 0
        self.last = ""

    def __call__(self, reason: str, peer: str, detail: str = "") -> None:
        """Count one frame from `peer` dropped for `reason`; returns None (nothing accepted)."""
        self.total += 1
        self.by_reason[reason] += 1
        self.last = f"{reason} from {peer}" + (f": {detail}" if detail else "")
        if self.total <= _LOG_FIRST or self.total % _LOG_EVERY == 0:
            log.warning("dropped control frame #%d from %s: %s%s", self.total, peer, reason,
                        f" ({detail})" if detail else "")

    def mark(self) -> Counter[str]:
        """The counts so far, for `hint`."""
        return self.by_reason.copy()

    def hint(self, mark: Counter[str]) -> str:
        """What was dropped since `mark()`, for a timeout message."""
        new = self.by_reason - mark
        if not new:
            return ""
        what = ", ".join(f"{n} {reason}" for reason, n in new.most_common())
        tip = "; check that both sides use the same secret" if new["bad MAC"] else ""
        return f" ({what} frame(s) dropped meanwhile, last {self.last}{tip})"
