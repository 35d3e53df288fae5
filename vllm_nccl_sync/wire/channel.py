"""Control plane: ZeroMQ sockets carrying `protocol.Message`s, with timeouts, sessions and HMAC.

The sender binds one ROUTER socket to the configured address (loopback by default); each receiver
connects a DEALER. Frames are `frames.py`'s `[tag, payload]`; its checks (count, size, tag, MAC,
framing) come first, then each end's own rules on the tag's fields:

- `session`: random, chosen by each `ReceiverChannel` and used as its ZeroMQ routing id. The rank
  a message comes from is the authenticated `rank` of its session, never a socket identity.
- `epoch`: random, chosen by each `SenderChannel`; a receiver echoes it once it has heard from the
  trainer (zeros before). `counter`: strictly increasing per session and direction.

The trainer checks session/routing id, epoch, rank, counter; a receiver its session and rank,
epoch, counter. A frame failing any check is dropped, counted (`rejected`, `rejections` by
reason) and logged with the peer (routing id and address), rate-limited; the wait it arrived in
goes on. A receiver's new session is accepted only through a `Hello` naming the same rank
(another sender's: a `SenderHello`).

A frame over ZeroMQ's MAXMSGSIZE (`MAX_WIRE_BYTES`) never reaches these checks: libzmq drops the
connection it came on (the socket lives on). On the trainer's side the receiver's DEALER then
reconnects; a receiver's DEALER that got such a frame stays disconnected for good (libzmq does not
reconnect after a protocol error). A socket monitor on the DEALER records such drops (and failed
handshakes): `ReceiverChannel.dropped` says what happened ("" while connected; a successful
handshake, e.g. a reconnect to a restarted trainer, clears it), and the timeouts of `recv` and
`send` name it.

Every send is bounded: `ReceiverChannel.send` and `SenderChannel.send` wait at most `timeout_s`
and raise `TimeoutError` naming why; `SenderChannel.send` raises `zmq.ZMQError` (EHOSTUNREACH)
for a rank with no live connection. `SenderChannel.send_all` never raises for a peer: it tries
every rank (one whose queue is full does not hold up the others) and returns the ranks it could
not reach, so an `Abort` reaches every live receiver. "Reached" means queued for a connection
ZeroMQ still holds: a peer that died a moment ago may not have been noticed yet. Frames of an
earlier, aborted update that are still queued are not this module's concern: every message
carries its update's version, and both sides skip those of other updates (`belongs`).

Error texts are bounded both ways (`frames.encode_payload`, `frames.bounded`). What a shared
secret covers and what it does not: `frames.py`.

Optional CURVE (`curve=True`, or `VLLM_NCCL_SYNC_CURVE=1`; needs a secret and libsodium): the
trainer's CURVE key pair is derived from the secret, so only peers holding it complete the
handshake; traffic is encrypted and unauthenticated peers never deliver a frame. HMAC stays on.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from vllm_nccl_sync.outcomes import ERROR_MESSAGE_CHARS, clip
from vllm_nccl_sync.wire import frames, sockets
from vllm_nccl_sync.wire.frames import NO_EPOCH, FrameMeta, Rejection, Rejections
from vllm_nccl_sync.wire.protocol import Hello, Message, ProtocolError, SenderHello, decode

log = logging.getLogger(__name__)

_MAX_SESSIONS = 1 << 16
_RETIRED_KEEP = 4096

# Names of `frames` also importable from here (the channel's face; tests).
ERROR_TRACEBACK_CHARS, MAX_WIRE_BYTES = frames.ERROR_TRACEBACK_CHARS, frames.MAX_WIRE_BYTES
FRAMING, _META, _TO_RECEIVER, _mac = frames.FRAMING, frames.META, frames.TO_RECEIVER, frames.mac
__all__ = ["ERROR_MESSAGE_CHARS", "ERROR_TRACEBACK_CHARS", "MAX_WIRE_BYTES", "ReceiverChannel",
           "SenderChannel", "clip"]


@dataclass(slots=True)
class _Session:
    rank: int
    last_in: int  # highest counter received
    sent: int = 0  # counters sent so far


class _Counting:
    """What both ends report of the frames they dropped."""

    _reject: Rejections

    @property
    def rejected(self) -> int:
        """Frames dropped so far (failed a check, or undecodable)."""
        return self._reject.total

    @property
    def rejections(self) -> Counter[str]:
        """Frames dropped so far, by reason."""
        return self._reject.by_reason


class SenderChannel(_Counting):
    """The trainer's end: one ROUTER socket talking to every receiver by (authenticated) rank."""

    def __init__(
        self, host: str, port: int, secret: bytes | None = None, *, curve: bool | None = None
    ) -> None:
        self._secret = secret or None
        self._sock = sockets.new_socket(zmq.ROUTER)
        try:
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # A receiver reconnecting (same session id) takes its routing id over at once;
            # without this, a reconnect racing the old connection's teardown would be ignored.
            self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            if sockets.curve_enabled(curve, self._secret):
                _, sk = sockets.curve_server_keys(self._secret)
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
        self._reject = Rejections()
        self.unreachable: dict[int, str] = {}
        """Ranks the last `send_all` could not reach, and why."""

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
        tag = frames.build_tag(self._secret, frames.TO_RECEIVER,
                           FrameMeta(sid, self.epoch, s.sent, rank), payload)
        self._sock.setsockopt(zmq.SNDTIMEO, max(timeout_ms, 0))
        self._sock.send_multipart([sid, tag, payload])

    def send(self, rank: int, msg: Message, timeout_s: float = 5.0) -> None:
        """Send `msg` to `rank`, waiting at most `timeout_s` for room in its queue.

        Raises `TimeoutError` if its queue stayed full, `zmq.ZMQError` (EHOSTUNREACH) if it has
        no session or no live connection, `ProtocolError` if `msg` is too large to send.
        """
        payload = frames.encode_payload(msg)
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
        payload = frames.encode_payload(msg)
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

    def _accept(self, parts: list[zmq.Frame]) -> tuple[int, Message] | None:
        """The frame's rank and message, or None once it is dropped (and counted)."""
        rid = parts[0].bytes
        who = sockets.peer(parts[-1], rid)
        got = frames.check_frame(self._secret, frames.TO_SENDER, [p.buffer for p in parts[1:]])
        if isinstance(got, Rejection):
            return self._reject(got.reason, who, got.detail)
        sid, epoch, counter, rank = got.session, got.epoch, got.counter, got.rank
        if sid != rid:
            return self._reject("session/routing id mismatch", who)
        s = self._sessions.get(sid)
        refused = self._refused(s, sid, epoch, counter, rank)
        if refused:
            reason, detail = refused
            return self._reject(reason, who, detail)
        if s is not None:
            s.last_in = counter
        try:
            msg = decode(parts[2].buffer)
        except ProtocolError as e:
            return self._reject("undecodable", who, str(e)[:200])
        msg = frames.bounded(msg)
        if getattr(msg, "rank", rank) != rank:
            return self._reject("rank mismatch", who, f"session rank {rank}, message {msg.rank}")
        if s is None:
            if not isinstance(msg, (Hello, SenderHello)):  # a receiver's or another sender's
                return self._reject("no session", who, f"{type(msg).__name__} before Hello")
            self._bind(rank, sid, counter, who)
        return rank, msg

    def _refused(self, s: _Session | None, sid: bytes, epoch: int, counter: int, rank: int
                 ) -> tuple[str, str] | None:
        """Why a frame of session `s` (None: none yet) is dropped, as (reason, detail)."""
        if epoch not in (self.epoch, NO_EPOCH):
            return "wrong trainer instance", f"rank {rank}"
        if s is not None and s.rank != rank:
            return "rank mismatch", f"session of rank {s.rank} says {rank}"
        if s is not None and counter <= s.last_in:
            return "replayed", f"rank {rank} counter {counter} <= {s.last_in}"
        if s is None and (sid in self._retired or epoch != NO_EPOCH):
            return "stale session", f"rank {rank}"
        if s is None and len(self._sessions) >= _MAX_SESSIONS:
            return "too many sessions", ""
        return None

    def _bind(self, rank: int, sid: bytes, counter: int, who: str) -> None:
        old = self._by_rank.get(rank)
        if old is not None:
            log.info("rank %d opened a new session from %s, retiring its previous one", rank, who)
            del self._sessions[old]
            self._retired[old] = None
            if len(self._retired) > _RETIRED_KEEP:
                self._retired.popitem(last=False)
        self._sessions[sid] = _Session(rank, counter)
        self._by_rank[rank] = sid

    def close(self) -> None:
        self._sock.close()


class ReceiverChannel(_Counting):
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
        curve = sockets.curve_enabled(curve, self._secret)
        self.endpoint = f"tcp://{host}:{port}"
        self._epoch = NO_EPOCH
        self._sent = 0
        self._last_in = 0
        self._reject = Rejections()
        self._link: sockets.LinkWatch | None = None
        self._sock = sockets.new_socket(zmq.DEALER)
        try:
            self._sock.setsockopt(zmq.IDENTITY, self.session)
            if curve:
                server_pk, _ = sockets.curve_server_keys(self._secret)
                pk, sk = zmq.curve_keypair()
                self._sock.setsockopt(zmq.CURVE_SERVERKEY, server_pk)
                self._sock.setsockopt(zmq.CURVE_PUBLICKEY, pk)
                self._sock.setsockopt(zmq.CURVE_SECRETKEY, sk)
            # How else would we know that libzmq dropped the connection (module docstring)?
            self._link = sockets.LinkWatch(self._sock, rank, self.endpoint)
            self._poller = zmq.Poller()
            self._polled = self._sock  # the socket as registered (tests may wrap `_sock`)
            self._poller.register(self._polled, zmq.POLLIN)
            self._poller.register(self._link.socket, zmq.POLLIN)
            self._served: dict[int, Callable[[], bool]] = {}
            self._sock.connect(self.endpoint)
        except BaseException:
            self.close()
            raise

    @property
    def dropped(self) -> str:
        """Why the connection to the trainer is down ("" while it is up, or not yet tried)."""
        return self._link.read()

    def serve(self, fd: int, take: Callable[[], bool]) -> None:
        """Serve socket `fd` while waiting for a message: `take()` whenever it is readable,
        until it returns False (a data plane's own socket, whose sender may block on it)."""
        self._served[fd] = take
        self._poller.register(fd, zmq.POLLIN)

    def send(self, msg: Message, timeout_s: float = 5.0) -> None:
        """Send `msg` to the trainer, waiting at most `timeout_s` for room to queue it.

        Raises `TimeoutError` naming why (no connection: `dropped`; or a full queue), or
        `ProtocolError` if `msg` is too large to send. Queued is not delivered: a frame queued
        just as the connection drops is lost.
        """
        payload = frames.encode_payload(msg)
        tag = frames.build_tag(self._secret, frames.TO_SENDER,
                           FrameMeta(self.session, self._epoch, self._sent, self.rank), payload)
        self._sent += 1
        self._link.read()
        self._sock.setsockopt(zmq.SNDTIMEO, max(int(timeout_s * 1000), 0))
        try:
            self._sock.send_multipart([tag, payload])
        except zmq.Again:
            why = self._link.read() or ("its queue stayed full (the trainer is not reading, or "
                                        "was never reached)")
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
            for fd in self._served.keys() & ready.keys() if self._served else ():
                if not self._served[fd]():
                    del self._served[fd]
                    self._poller.unregister(fd)
            if self._link.socket in ready:
                dropped = self._link.read()
                if fail_on_drop and dropped and self._polled not in ready:
                    raise ConnectionError(dropped)
            if self._polled not in ready:
                if time.monotonic() < deadline:
                    continue
                dropped = self._link.read()
                raise TimeoutError(
                    f"no control message from the sender within {timeout_s:.1f} s"
                    + self._reject.hint(mark)
                    + (f": {dropped}" if dropped else "")
                )
            payload = self._accept(self._sock.recv_multipart(copy=False))
            if payload is not None:
                return frames.bounded(decode(payload))

    def _accept(self, parts: list[zmq.Frame]) -> memoryview | None:
        """The frame's payload, or None once it is dropped (and counted)."""
        who = f"{sockets.peer(parts[-1])} ({self.endpoint})"
        got = frames.check_frame(self._secret, frames.TO_RECEIVER, [p.buffer for p in parts])
        if isinstance(got, Rejection):
            return self._reject(got.reason, who, got.detail)
        if got.session != self.session or got.rank != self.rank:
            return self._reject("wrong session", who, f"for rank {got.rank}")
        if got.epoch == NO_EPOCH or self._epoch not in (NO_EPOCH, got.epoch):
            return self._reject("wrong trainer instance", who)
        if got.counter <= self._last_in:
            return self._reject("replayed", who, f"counter {got.counter} <= {self._last_in}")
        self._epoch, self._last_in = got.epoch, got.counter
        return parts[1].buffer

    def close(self) -> None:
        """Close the socket and its monitor (idempotent)."""
        if self._link is not None:
            self._link.close(self._sock)
        if not self._sock.closed:
            self._sock.close()
