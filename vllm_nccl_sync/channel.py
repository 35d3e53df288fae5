"""Control plane: ZeroMQ sockets carrying `protocol.Message`s, with timeouts and optional HMAC.

The sender binds one ROUTER socket; each receiver connects a DEALER whose identity is its rank.
Every frame is `[tag, payload]`: `tag` is an HMAC-SHA256 of the payload under the shared secret
(empty when no secret is configured). A frame whose tag does not verify is dropped and logged
before it is decoded, so a process without the secret cannot push or steer an update.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time

import zmq

from .protocol import MAX_FRAME_BYTES, Message, ProtocolError, decode, encode

log = logging.getLogger(__name__)


def _tag(secret: bytes | None, payload: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest() if secret else b""


def _verify(secret: bytes | None, tag: bytes, payload: bytes) -> bool:
    return hmac.compare_digest(tag, _tag(secret, payload))


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 64)
    return sock


class SenderChannel:
    """The trainer's end: one ROUTER socket talking to every receiver by rank."""

    def __init__(self, host: str, port: int, secret: bytes | None = None) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = _socket(self._ctx, zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(f"tcp://{host}:{port}")
        self._secret = secret
        self.rejected = 0

    def send(self, rank: int, msg: Message) -> None:
        payload = encode(msg)
        self._sock.send_multipart([str(rank).encode(), _tag(self._secret, payload), payload])

    def send_all(self, ranks: list[int], msg: Message) -> None:
        payload = encode(msg)
        tag = _tag(self._secret, payload)
        for r in ranks:
            self._sock.send_multipart([str(r).encode(), tag, payload])

    def recv(self, deadline: float) -> tuple[int, Message]:
        """Next valid message and its sender's rank; `TimeoutError` at `deadline` (monotonic)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000)):
                raise TimeoutError("no control message from the receivers before the deadline")
            frames = self._sock.recv_multipart()
            if len(frames) != 3 or not _verify(self._secret, frames[1], frames[2]):
                self.rejected += 1
                log.warning("dropped an unauthenticated or malformed control frame")
                continue
            try:
                rank = int(frames[0])
                return rank, decode(frames[2])
            except (ValueError, ProtocolError) as e:
                self.rejected += 1
                log.warning("dropped a control frame: %s", e)

    def close(self) -> None:
        self._sock.close()


class ReceiverChannel:
    """A receiver's end: one DEALER socket, identity = its rank in the transfer group."""

    def __init__(self, host: str, port: int, rank: int, secret: bytes | None = None) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = _socket(self._ctx, zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, str(rank).encode())
        self._sock.connect(f"tcp://{host}:{port}")
        self._secret = secret
        self.rejected = 0

    def send(self, msg: Message) -> None:
        payload = encode(msg)
        self._sock.send_multipart([_tag(self._secret, payload), payload])

    def recv(self, timeout_s: float) -> Message:
        """Next message from the sender. Raises `TimeoutError`, or `ProtocolError` if malformed.

        Frames failing authentication are dropped (and counted) without ending the wait.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000)):
                raise TimeoutError(f"no control message from the sender within {timeout_s:.1f} s")
            frames = self._sock.recv_multipart()
            if len(frames) != 2 or not _verify(self._secret, frames[0], frames[1]):
                self.rejected += 1
                log.warning("dropped an unauthenticated or malformed control frame")
                continue
            return decode(frames[1])

    def close(self) -> None:
        self._sock.close()
