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
before any hashing), tag length, MAC (`hmac.compare_digest`), session/routing id, rank, epoch,
counter. A frame failing any check is dropped, counted (`rejected`, `rejections` by reason) and
logged with the peer (routing id and address), rate-limited; the wait it arrived in goes on. A
receiver's new session is accepted only through a `Hello` naming the same rank (another sender's:
a `SenderHello`).

A frame over ZeroMQ's MAXMSGSIZE (`MAX_WIRE_BYTES`) never reaches these checks: libzmq drops the
connection it came on (the socket lives on). On the trainer's side the receiver's DEALER then
reconnects; a receiver's DEALER that got such a frame stays disconnected for good (libzmq does not
reconnect after a protocol error). A socket monitor on the DEALER records such drops (and failed
handshakes): `ReceiverChannel.dropped` says what happened ("" while connected; a successful
handshake, e.g. a reconnect to a restarted trainer, clears it), and the timeouts of `recv` and
`send` name it.

Every send is bounded: `ReceiverChannel.send` and `SenderChannel.send` wait at most `timeout_s`
(a DEALER without a connection, or a peer whose queue is full, would otherwise block forever) and
raise `TimeoutError` naming why; `SenderChannel.send` raises `zmq.ZMQError` (EHOSTUNREACH) for a
rank with no live connection. `SenderChannel.send_all` never raises for a peer: it tries every rank
(one whose queue is full does not hold up the others) and returns the ranks it could not reach,
so an `Abort` reaches every live receiver whatever happened to the others. "Reached" means queued
for a connection ZeroMQ still holds: a peer that died a moment ago may not have been noticed yet.
Frames of an earlier, aborted update that are still queued are not this module's concern: every
message carries its update's version, and the sender and receivers skip those of other updates.

Error texts are bounded: an `Error`'s `message` is cut to `ERROR_MESSAGE_CHARS` and its
`traceback` to its last `ERROR_TRACEBACK_CHARS` characters, when sent and when received (`clip`).

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
import math
import os
import secrets
import struct
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from vllm_nccl_sync.outcomes import ERROR_MESSAGE_CHARS, clip, clip_tail
from vllm_nccl_sync.wire.protocol import (
    MAX_FRAME_BYTES,
    Error,
    Hello,
    Message,
    ProtocolError,
    SenderHello,
    decode,
    encode,
)

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
_MONITOR_HWM = 10_000  # monitor events kept unread (drained at every channel call and wait)

MAX_WIRE_BYTES = MAX_FRAME_BYTES + 64
"""ZeroMQ's MAXMSGSIZE on both ends: a larger frame makes libzmq drop the connection it came on."""
ERROR_TRACEBACK_CHARS = 8_000
"""An `Error`'s `traceback` is clipped to its last this many characters."""

_DROPPED = (f"the connection to the trainer was dropped (a control frame over the "
            f"{MAX_WIRE_BYTES}-byte limit, or the trainer went away)")


def _bounded(msg: Message) -> Message:
    """`msg` with the free texts of an `Error` clipped (other messages unchanged)."""
    if isinstance(msg, Error) and (len(msg.message) > ERROR_MESSAGE_CHARS
                                   or len(msg.traceback) > ERROR_TRACEBACK_CHARS):
        msg = msgspec.structs.replace(
            msg, message=clip(msg.message), traceback=clip_tail(msg.traceback, ERROR_TRACEBACK_CHARS)
        )
    return msg


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
    """Encode `msg` (an `Error`'s texts clipped), never producing a frame the peer would drop."""
    payload = encode(_bounded(msg))
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
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES)
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
        self.last = f"{reason} from {peer}" + (f": {detail}" if detail else "")
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
        try:
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # A receiver reconnecting (same session id) takes its routing id over at once;
            # without this, a reconnect racing the old connection's teardown would be ignored.
            self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            if _curve_enabled(curve, self._secret):
                _, sk = _curve_server_keys(self._secret)
                self._sock.setsockopt(zmq.CURVE_SERVER, 1)
                self._sock.setsockopt(zmq.CURVE_SECRETKEY, sk)
            self._sock.bind(f"tcp://{host}:{port}")
        except BaseException:  # e.g. the port in use: do not leave the socket behind
            self._sock.close()
            raise
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        """The endpoint actually bound (`tcp://host:port`)."""
        self.epoch = secrets.token_bytes(16)
        self._sessions: dict[bytes, _Session] = {}
        self._by_rank: dict[int, bytes] = {}
        self._retired: OrderedDict[bytes, None] = OrderedDict()
        self._reject = _Rejections()
        self.unreachable: dict[int, str] = {}
        """Ranks the last `send_all` could not reach, and why."""

    @property
    def rejected(self) -> int:
        """Frames dropped so far (failed a check or undecodable)."""
        return self._reject.total

    @property
    def rejections(self) -> Counter[str]:
        return self._reject.by_reason

    def _send_payload(self, rank: int, payload: bytes, timeout_ms: int = 5000) -> None:
        """Queue one frame for `rank`, waiting at most `timeout_ms` (0: not at all) for room.

        Raises `zmq.Again` (queue still full) or `zmq.ZMQError` (EHOSTUNREACH: no session, or
        ZeroMQ holds no connection for it).
        """
        sid = self._by_rank.get(rank)
        if sid is None:
            raise zmq.ZMQError(zmq.EHOSTUNREACH, f"rank {rank} has no session (no Hello received)")
        s = self._sessions[sid]
        s.sent += 1
        meta = _META.pack(FRAMING, sid, self.epoch, s.sent, rank)
        tag = meta + _mac(self._secret, _TO_RECEIVER, meta, payload)
        self._sock.setsockopt(zmq.SNDTIMEO, max(timeout_ms, 0))
        self._sock.send_multipart([sid, tag, payload])

    def send(self, rank: int, msg: Message, timeout_s: float = 5.0) -> None:
        """Send `msg` to `rank`, waiting at most `timeout_s` for room in its queue.

        Raises `TimeoutError` if its queue stayed full, `zmq.ZMQError` (EHOSTUNREACH) if it has
        no session or no live connection, `ProtocolError` if `msg` is too large to send.
        """
        payload = _encode(msg)
        try:
            self._send_payload(rank, payload, int(timeout_s * 1000))
        except zmq.Again:
            raise TimeoutError(
                f"could not send {type(msg).__name__} to rank {rank} within {timeout_s:.1f} s: "
                "its queue stayed full (the receiver is not reading)"
            ) from None
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH or self._by_rank.get(rank) is None:
                raise
            raise zmq.ZMQError(
                zmq.EHOSTUNREACH, f"rank {rank} is not connected (its receiver went away)"
            ) from None

    def send_all(self, ranks: list[int], msg: Message, timeout_s: float = 1.0) -> list[int]:
        """Send `msg` to every rank in `ranks`; returns the ranks it could not reach (in order).

        Never raises for a peer (only `ProtocolError`, before anything is sent, if `msg` is too
        large). Every rank is tried at once without waiting; ranks whose queue is full are
        retried until `timeout_s` has passed, so a slow peer never holds up the others. Why each
        rank was missed is in `unreachable` (also logged).
        """
        payload = _encode(msg)
        missed: dict[int, str] = {}
        full: list[int] = []

        def attempt(r: int) -> None:
            try:
                self._send_payload(r, payload, 0)
                missed.pop(r, None)
            except zmq.Again:
                full.append(r)
                missed[r] = "its queue stayed full (the receiver is not reading)"
            except zmq.ZMQError as e:
                missed[r] = ("not connected (its receiver went away)"
                             if e.errno == zmq.EHOSTUNREACH and r in self._by_rank else str(e))

        for r in dict.fromkeys(ranks):
            attempt(r)
        deadline = time.monotonic() + timeout_s
        pause = 0.001
        while full and time.monotonic() < deadline:
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(pause * 2, 0.05)
            retry, full = full, []
            for r in retry:
                attempt(r)
        self.unreachable = missed
        for r, why in missed.items():
            log.warning("could not send %s to rank %d: %s", type(msg).__name__, r, why)
        return [r for r in dict.fromkeys(ranks) if r in missed]

    def recv(self, deadline: float) -> tuple[int, Message]:
        """Next valid message and its sender's rank; `TimeoutError` at `deadline` (monotonic)."""
        mark = self._reject.mark()
        while True:
            left = deadline - time.monotonic()
            if not self._sock.poll(max(math.ceil(left * 1000), 0)):
                if time.monotonic() < deadline:
                    continue
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
        msg = _bounded(msg)
        if getattr(msg, "rank", rank) != rank:
            return self._reject("rank mismatch", peer, f"session rank {rank}, message {msg.rank}")
        if s is None:
            if not isinstance(msg, (Hello, SenderHello)):  # a receiver's or another sender's
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


_WATCH = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


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
        curve = _curve_enabled(curve, self._secret)
        self.endpoint = f"tcp://{host}:{port}"
        self._epoch = _NO_EPOCH
        self._sent = 0
        self._last_in = 0
        self._reject = _Rejections()
        self._dropped = ""
        self._monitor: zmq.Socket | None = None
        self._sock = _socket(zmq.DEALER)
        try:
            self._sock.setsockopt(zmq.IDENTITY, self.session)
            if curve:
                server_pk, _ = _curve_server_keys(self._secret)
                pk, sk = zmq.curve_keypair()
                self._sock.setsockopt(zmq.CURVE_SERVERKEY, server_pk)
                self._sock.setsockopt(zmq.CURVE_PUBLICKEY, pk)
                self._sock.setsockopt(zmq.CURVE_SECRETKEY, sk)
            # A monitor (inproc PAIR) reports the DEALER's connection events: how else would we
            # know that libzmq dropped the connection (module docstring)? Attached before connect.
            addr = f"inproc://vllm-nccl-sync-monitor-{secrets.token_hex(8)}"
            self._sock.monitor(addr, _WATCH)
            self._monitor = _context().socket(zmq.PAIR)
            self._monitor.setsockopt(zmq.LINGER, 0)
            self._monitor.setsockopt(zmq.RCVHWM, _MONITOR_HWM)
            self._monitor.connect(addr)
            self._poller = zmq.Poller()
            self._polled = self._sock  # the socket as registered (tests may wrap `_sock`)
            self._poller.register(self._polled, zmq.POLLIN)
            self._poller.register(self._monitor, zmq.POLLIN)
            self._sock.connect(self.endpoint)
        except BaseException:
            self.close()
            raise

    @property
    def rejected(self) -> int:
        """Frames dropped so far (failed a check)."""
        return self._reject.total

    @property
    def rejections(self) -> Counter[str]:
        return self._reject.by_reason

    @property
    def dropped(self) -> str:
        """Why the connection to the trainer is down ("" while it is up, or not yet tried)."""
        self._watch()
        return self._dropped

    def _watch(self) -> None:
        """Read the monitor's pending events (never blocks)."""
        while True:
            try:
                ev = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = ev["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._dropped:
                    log.info("rank %d reconnected to the trainer (%s)", self.rank, self.endpoint)
                self._dropped = ""
            elif kind == zmq.EVENT_DISCONNECTED:
                if not self._dropped:  # keep a handshake failure's more precise reason
                    self._dropped = _DROPPED
                    log.warning("rank %d: %s (%s)", self.rank, _DROPPED, self.endpoint)
            else:
                why = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication failed",
                       zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error"}.get(kind, "no detail")
                text = (f"the handshake with the trainer failed ({why}: a CURVE/secret "
                        "mismatch, or no trainer of this package on that port)")
                if text != self._dropped:  # libzmq retries every reconnect interval: log once
                    log.warning("rank %d: %s (%s)", self.rank, text, self.endpoint)
                self._dropped = text

    def send(self, msg: Message, timeout_s: float = 5.0) -> None:
        """Send `msg` to the trainer, waiting at most `timeout_s` for room to queue it.

        Raises `TimeoutError` naming why (no connection: `dropped`; or a full queue), or
        `ProtocolError` if `msg` is too large to send. Queued is not delivered: a frame queued
        just as the connection drops is lost.
        """
        payload = _encode(msg)
        meta = _META.pack(FRAMING, self.session, self._epoch, self._sent, self.rank)
        self._sent += 1
        self._watch()
        self._sock.setsockopt(zmq.SNDTIMEO, max(int(timeout_s * 1000), 0))
        try:
            self._sock.send_multipart(
                [meta + _mac(self._secret, _TO_SENDER, meta, payload), payload]
            )
        except zmq.Again:
            self._watch()
            why = self._dropped or ("its queue stayed full (the trainer is not reading, or was "
                                    "never reached)")
            raise TimeoutError(
                f"could not send {type(msg).__name__} to the trainer ({self.endpoint}) within "
                f"{timeout_s:.1f} s: {why}"
            ) from None

    def recv(self, timeout_s: float, *, fail_on_drop: bool = False) -> Message:
        """Next message from the sender. Raises `TimeoutError`, or `ProtocolError` if malformed.

        Frames failing a check are dropped (and counted) without ending the wait; an
        authenticated frame that does not decode is the sender's fault and raises. A frame
        already queued is returned even with `timeout_s` 0. With `fail_on_drop` (mid-update,
        where a lost connection means a lost update), a dropped connection raises
        `ConnectionError` at once instead of waiting out `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        mark = self._reject.mark()
        while True:
            left = deadline - time.monotonic()
            ready = dict(self._poller.poll(max(math.ceil(left * 1000), 0)))
            if self._monitor in ready:
                self._watch()
                if fail_on_drop and self._dropped and self._polled not in ready:
                    raise ConnectionError(self._dropped)
            if self._polled not in ready:
                if time.monotonic() < deadline:
                    continue
                self._watch()
                raise TimeoutError(
                    f"no control message from the sender within {timeout_s:.1f} s"
                    + self._reject.hint(mark)
                    + (f": {self._dropped}" if self._dropped else "")
                )
            payload = self._accept(self._sock.recv_multipart(copy=False))
            if payload is not None:
                return _bounded(decode(payload))

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
        """Close the socket and its monitor (idempotent)."""
        if not self._sock.closed:
            try:
                self._sock.monitor(None, 0)  # stops libzmq's end of the monitor
            except zmq.ZMQError:
                pass
            self._sock.close()
        if self._monitor is not None and not self._monitor.closed:
            self._monitor.close()
