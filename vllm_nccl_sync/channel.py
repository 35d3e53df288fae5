"""Control plane: ZeroMQ sockets carrying `protocol.Message`s, with timeouts, sessions and HMAC.

The sender binds one ROUTER socket to the configured address (loopback by default); each receiver
connects a DEALER. Every frame is `[tag, payload]`, `payload` being one encoded message and `tag`

    meta = framing version (1 B) | session (16 B) | epoch (16 B) | counter (8 B) | rank (4 B)
    tag  = meta | HMAC-SHA256(secret, domain | direction | meta | payload)   (no MAC without secret)

- `session`: random, chosen by each `ReceiverChannel` and used as its ZeroMQ routing id. The rank
  a message comes from is the authenticated `rank` of its session, never a socket identity.
- `epoch`: random, chosen by each `SenderChannel`; a receiver echoes it once it has heard from the
  trainer (zeros before). `counter`: strictly increasing per session and direction.
- `direction` ("R>S" or "S>R") is inside the MAC, so a frame cannot be reflected back.

Checks, in this order, before a payload is decoded: frame count, payload size (<= MAX_FRAME_BYTES,
before any hashing; ZeroMQ's MAXMSGSIZE disconnects a peer that sends a larger frame, the socket
lives on), tag length, MAC (`hmac.compare_digest`), session/routing id, rank, epoch, counter. A
frame failing any check is dropped, counted (`rejected`, `rejections` by reason) and logged with
the peer (routing id and address), rate-limited; the wait it arrived in goes on. A receiver's new
session is accepted only through a `Hello` naming the same rank.

What a shared secret covers (a peer without it can reach the port but not the protocol):
- forging or altering any message, either way; joining as a receiver; pushing to a receiver;
- replaying a captured frame to a receiver (session + counter + pinned epoch): never accepted;
- replaying to the trainer: any frame of a session this trainer has seen (counters), frames of
  an earlier trainer instance (epoch), frames moved to another session or rank;
- squatting a rank: ranks are bound to authenticated sessions, not to socket identities.

What it does not cover:
- confidentiality: frames are readable on the wire (use CURVE below, or a trusted network);
- the data plane: the broadcast bytes and the group's TCPStore rendezvous (gloo/NCCL) are not
  authenticated; keep them on a trusted interface;
- a captured `Hello` (the only frame sent before the receiver knows the epoch) replayed to a new
  trainer instance that never saw its session: it binds that rank to the attacker's connection
  until the real receiver's own `Hello` re-binds it; the attacker can only make an update fail by
  timeout (every later frame must carry the epoch) -- a denial of service, never data;
- an eavesdropper who learns a session id (plain text on the wire) connecting with it: it takes
  that receiver's routing over (ROUTER_HANDOVER, which keeps real reconnects reliable) until the
  receiver reconnects; again a denial of service, never data (CURVE hides session ids);
- resource use by unauthenticated peers: ZeroMQ buffers a whole multipart message before it is
  checked (MAXMSGSIZE bounds each part, not the part count); CURVE stops such peers at the
  handshake;
- without a secret: nothing is authenticated; sessions and counters then only catch stale frames.

Optional CURVE (`curve=True`, or `VLLM_NCCL_SYNC_CURVE=1`; needs a secret and libsodium): the
trainer's CURVE key pair is derived from the secret, so only peers holding it complete the
handshake; traffic is encrypted and unauthenticated peers never deliver a frame. HMAC stays on.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import struct
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils import z85

from .protocol import MAX_FRAME_BYTES, Error, Hello, Message, ProtocolError, decode, encode

log = logging.getLogger(__name__)

FRAMING = 1
"""Version of the `[tag, payload]` framing (independent of `PROTOCOL_VERSION`)."""

_META = struct.Struct(">B16s16sQI")
_NO_EPOCH = bytes(16)
_DOMAIN = b"vllm-nccl-sync/channel/1 "
_TO_SENDER, _TO_RECEIVER = b"R>S", b"S>R"
_LOG_FIRST, _LOG_EVERY = 20, 1000  # log the first rejections, then one in _LOG_EVERY
_MAX_SESSIONS = 1 << 16
_RETIRED_KEEP = 4096
_ERROR_TEXT = 64 * 1024


def _mac(secret: bytes | None, direction: bytes, meta: bytes, payload) -> bytes:
    if not secret:
        return b""
    h = hmac.new(secret, _DOMAIN + direction, hashlib.sha256)
    h.update(meta)
    h.update(payload)
    return h.digest()


def _tag_problem(n: int, peer: str) -> tuple[str, str, str]:
    """Why a tag of `n` bytes is refused: a MAC missing or unexpected means a secret mismatch."""
    if n in (_META.size, _META.size + 32):
        return "bad MAC", peer, "a secret is configured on one side only"
    return "malformed", peer, f"tag of {n} bytes"


def _encode(msg: Message) -> bytes:
    """Encode `msg`, never producing a frame the peer would drop for its size."""
    payload = encode(msg)
    if len(payload) > MAX_FRAME_BYTES and isinstance(msg, Error):
        msg = msgspec.structs.replace(
            msg, message=msg.message[:_ERROR_TEXT], traceback=msg.traceback[-_ERROR_TEXT:]
        )
        payload = encode(msg)
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"{type(msg).__name__} encodes to {len(payload)} bytes, over {MAX_FRAME_BYTES}"
        )
    return payload


_ctx: zmq.Context | None = None
_ctx_pid = 0


def _context() -> zmq.Context:
    """A context of this package's own (no ZAP handler of anyone else applies to our sockets)."""
    global _ctx, _ctx_pid
    if _ctx is None or _ctx_pid != os.getpid():
        _ctx, _ctx_pid = zmq.Context(), os.getpid()
    return _ctx


def _curve_enabled(curve: bool | None, secret: bytes | None) -> bool:
    if curve is None:
        curve = os.environ.get("VLLM_NCCL_SYNC_CURVE", "") == "1"
    if curve and not secret:
        raise ValueError("CURVE needs a shared secret (its keys are derived from it)")
    if curve and not zmq.has("curve"):
        raise ValueError("CURVE requested but this libzmq has no CURVE support (libsodium)")
    return bool(curve)


def _curve_server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The trainer's CURVE key pair (z85 public, z85 secret), derived from the shared secret."""
    seed = hmac.new(secret, b"vllm-nccl-sync/curve-server", hashlib.sha256).digest()
    sk = z85.encode(seed)
    return zmq.curve_public(sk), sk


def _socket(kind: int) -> zmq.Socket:
    sock = _context().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 64)
    return sock


class _Rejections:
    """Counts dropped frames by reason and logs them (rate-limited) with the peer."""

    def __init__(self) -> None:
        self.by_reason: Counter[str] = Counter()
        self.total = 0
        self.last = ""

    def __call__(self, reason: str, peer: str, detail: str = "") -> None:
        self.total += 1
        self.by_reason[reason] += 1
        self.last = f"{reason} from {peer}"
        if self.total <= _LOG_FIRST or self.total % _LOG_EVERY == 0:
            log.warning("dropped control frame #%d from %s: %s%s", self.total, peer, reason,
                        f" ({detail})" if detail else "")

    def mark(self) -> Counter[str]:
        return self.by_reason.copy()

    def hint(self, mark: Counter[str]) -> str:
        """What was dropped since `mark()`, for a timeout message."""
        new = self.by_reason - mark
        if not new:
            return ""
        what = ", ".join(f"{n} {reason}" for reason, n in new.most_common())
        tip = "; check that both sides use the same secret" if new["bad MAC"] else ""
        return f" ({what} frame(s) dropped meanwhile, last {self.last}{tip})"


def _peer(frame: zmq.Frame, routing_id: bytes | None = None) -> str:
    try:
        addr = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        addr = "?"
    rid = f" id={routing_id[:8].hex()}" if routing_id is not None else ""
    return f"{addr}{rid}"


@dataclass(slots=True)
class _Session:
    rank: int
    last_in: int  # highest counter received
    sent: int = 0  # counters sent so far


class SenderChannel:
    """The trainer's end: one ROUTER socket talking to every receiver by (authenticated) rank."""

    def __init__(
        self, host: str, port: int, secret: bytes | None = None, *, curve: bool | None = None
    ) -> None:
        self._secret = secret or None
        self._sock = _socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A receiver reconnecting (same session id) takes its routing id over at once; without
        # this, a reconnect racing the old connection's teardown would be ignored by libzmq.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if _curve_enabled(curve, self._secret):
            _, sk = _curve_server_keys(self._secret)
            self._sock.setsockopt(zmq.CURVE_SERVER, 1)
            self._sock.setsockopt(zmq.CURVE_SECRETKEY, sk)
        self._sock.bind(f"tcp://{host}:{port}")
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        """The endpoint actually bound (`tcp://host:port`)."""
        self.epoch = secrets.token_bytes(16)
        self._sessions: dict[bytes, _Session] = {}
        self._by_rank: dict[int, bytes] = {}
        self._retired: OrderedDict[bytes, None] = OrderedDict()
        self._reject = _Rejections()

    @property
    def rejected(self) -> int:
        """Frames dropped so far (failed a check or undecodable)."""
        return self._reject.total

    @property
    def rejections(self) -> Counter[str]:
        return self._reject.by_reason

    def _send_payload(self, rank: int, payload: bytes) -> None:
        sid = self._by_rank.get(rank)
        if sid is None:
            raise zmq.ZMQError(zmq.EHOSTUNREACH, f"rank {rank} has no session (no Hello received)")
        s = self._sessions[sid]
        s.sent += 1
        meta = _META.pack(FRAMING, sid, self.epoch, s.sent, rank)
        tag = meta + _mac(self._secret, _TO_RECEIVER, meta, payload)
        self._sock.send_multipart([sid, tag, payload])

    def send(self, rank: int, msg: Message) -> None:
        self._send_payload(rank, _encode(msg))

    def send_all(self, ranks: list[int], msg: Message) -> None:
        payload = _encode(msg)
        for r in ranks:
            self._send_payload(r, payload)

    def recv(self, deadline: float) -> tuple[int, Message]:
        """Next valid message and its sender's rank; `TimeoutError` at `deadline` (monotonic)."""
        mark = self._reject.mark()
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(max(int(left * 1000), 1)):
                raise TimeoutError(
                    "no control message from the receivers before the deadline"
                    + self._reject.hint(mark)
                )
            got = self._accept(self._sock.recv_multipart(copy=False))
            if got is not None:
                return got

    def _accept(self, frames: list[zmq.Frame]) -> tuple[int, Message] | None:
        rid = frames[0].bytes
        peer = _peer(frames[-1], rid)
        if len(frames) != 3:
            return self._reject("malformed", peer, f"{len(frames) - 1} frames, expected 2")
        tag, payload = frames[1].buffer, frames[2].buffer
        if len(payload) > MAX_FRAME_BYTES:
            return self._reject("oversized", peer, f"{len(payload)} bytes")
        if len(tag) != _META.size + (32 if self._secret else 0):
            return self._reject(*_tag_problem(len(tag), peer))
        meta = bytes(tag[: _META.size])
        if not hmac.compare_digest(bytes(tag[_META.size :]),
                                   _mac(self._secret, _TO_SENDER, meta, payload)):
            return self._reject("bad MAC", peer)
        framing, sid, epoch, counter, rank = _META.unpack(meta)
        if framing != FRAMING:
            return self._reject("malformed", peer, f"framing {framing}")
        if sid != rid:
            return self._reject("session/routing id mismatch", peer)
        if epoch not in (self.epoch, _NO_EPOCH):
            return self._reject("wrong trainer instance", peer, f"rank {rank}")
        s = self._sessions.get(sid)
        if s is not None and s.rank != rank:
            return self._reject("rank mismatch", peer, f"session of rank {s.rank} says {rank}")
        if s is not None and counter <= s.last_in:
            return self._reject("replayed", peer, f"rank {rank} counter {counter} <= {s.last_in}")
        if s is None and (sid in self._retired or epoch != _NO_EPOCH):
            return self._reject("stale session", peer, f"rank {rank}")
        if s is None and len(self._sessions) >= _MAX_SESSIONS:
            return self._reject("too many sessions", peer)
        if s is not None:
            s.last_in = counter
        try:
            msg = decode(payload)
        except ProtocolError as e:
            return self._reject("undecodable", peer, str(e)[:200])
        if getattr(msg, "rank", rank) != rank:
            return self._reject("rank mismatch", peer, f"session rank {rank}, message {msg.rank}")
        if s is None:
            if not isinstance(msg, Hello):
                return self._reject("no session", peer, f"{type(msg).__name__} before Hello")
            self._bind(rank, sid, counter, peer)
        return rank, msg

    def _bind(self, rank: int, sid: bytes, counter: int, peer: str) -> None:
        old = self._by_rank.get(rank)
        if old is not None:
            log.info("rank %d opened a new session from %s, retiring its previous one", rank, peer)
            del self._sessions[old]
            self._retired[old] = None
            if len(self._retired) > _RETIRED_KEEP:
                self._retired.popitem(last=False)
        self._sessions[sid] = _Session(rank, counter)
        self._by_rank[rank] = sid

    def close(self) -> None:
        self._sock.close()


class ReceiverChannel:
    """A receiver's end: one DEALER socket whose routing id is a fresh random session id."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        secret: bytes | None = None,
        *,
        curve: bool | None = None,
    ) -> None:
        if not 0 <= rank < 2**32:
            raise ValueError(f"rank {rank} out of range")
        self._secret = secret or None
        self.rank = rank
        self.session = b"S" + secrets.token_bytes(15)  # a routing id must not start with 0
        self._sock = _socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, self.session)
        if _curve_enabled(curve, self._secret):
            server_pk, _ = _curve_server_keys(self._secret)
            pk, sk = zmq.curve_keypair()
            self._sock.setsockopt(zmq.CURVE_SERVERKEY, server_pk)
            self._sock.setsockopt(zmq.CURVE_PUBLICKEY, pk)
            self._sock.setsockopt(zmq.CURVE_SECRETKEY, sk)
        self.endpoint = f"tcp://{host}:{port}"
        self._sock.connect(self.endpoint)
        self._epoch = _NO_EPOCH
        self._sent = 0
        self._last_in = 0
        self._reject = _Rejections()

    @property
    def rejected(self) -> int:
        """Frames dropped so far (failed a check)."""
        return self._reject.total

    @property
    def rejections(self) -> Counter[str]:
        return self._reject.by_reason

    def send(self, msg: Message) -> None:
        payload = _encode(msg)
        meta = _META.pack(FRAMING, self.session, self._epoch, self._sent, self.rank)
        self._sent += 1
        self._sock.send_multipart([meta + _mac(self._secret, _TO_SENDER, meta, payload), payload])

    def recv(self, timeout_s: float) -> Message:
        """Next message from the sender. Raises `TimeoutError`, or `ProtocolError` if malformed.

        Frames failing a check are dropped (and counted) without ending the wait; an
        authenticated frame that does not decode is the sender's fault and raises.
        """
        deadline = time.monotonic() + timeout_s
        mark = self._reject.mark()
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(max(int(left * 1000), 1)):
                raise TimeoutError(
                    f"no control message from the sender within {timeout_s:.1f} s"
                    + self._reject.hint(mark)
                )
            payload = self._accept(self._sock.recv_multipart(copy=False))
            if payload is not None:
                return decode(payload)

    def _accept(self, frames: list[zmq.Frame]) -> memoryview | None:
        peer = f"{_peer(frames[-1])} ({self.endpoint})"
        if len(frames) != 2:
            return self._reject("malformed", peer, f"{len(frames)} frames, expected 2")
        tag, payload = frames[0].buffer, frames[1].buffer
        if len(payload) > MAX_FRAME_BYTES:
            return self._reject("oversized", peer, f"{len(payload)} bytes")
        if len(tag) != _META.size + (32 if self._secret else 0):
            return self._reject(*_tag_problem(len(tag), peer))
        meta = bytes(tag[: _META.size])
        if not hmac.compare_digest(bytes(tag[_META.size :]),
                                   _mac(self._secret, _TO_RECEIVER, meta, payload)):
            return self._reject("bad MAC", peer)
        framing, sid, epoch, counter, rank = _META.unpack(meta)
        if framing != FRAMING:
            return self._reject("malformed", peer, f"framing {framing}")
        if sid != self.session or rank != self.rank:
            return self._reject("wrong session", peer, f"for rank {rank}")
        if epoch == _NO_EPOCH or self._epoch not in (_NO_EPOCH, epoch):
            return self._reject("wrong trainer instance", peer)
        if counter <= self._last_in:
            return self._reject("replayed", peer, f"counter {counter} <= {self._last_in}")
        self._epoch, self._last_in = epoch, counter
        return payload

    def close(self) -> None:
        self._sock.close()
