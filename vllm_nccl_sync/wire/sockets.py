"""ZeroMQ plumbing of the control channel: the package's context, socket options, CURVE keys,
peer names, and the monitor that says why a receiver's connection to the trainer is down."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from vllm_nccl_sync.wire.frames import MAX_WIRE_BYTES

log = logging.getLogger(__name__)

DROPPED = (f"the connection to the trainer was dropped (a control frame over the "
           f"{MAX_WIRE_BYTES}-byte limit, or the trainer went away)")
"""Why a receiver's connection is down after a disconnect."""

_MONITOR_HWM = 10_000  # monitor events kept unread (drained at every channel call and wait)
_WATCH = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

_ctx: zmq.Context | None = None
_ctx_pid = 0


def context() -> zmq.Context:
    """A context of this package's own (no ZAP handler of anyone else applies to our sockets)."""
    global _ctx, _ctx_pid
    if _ctx is None or _ctx_pid != os.getpid():
        _ctx, _ctx_pid = zmq.Context(), os.getpid()
    return _ctx


def new_socket(kind: int) -> zmq.Socket:
    """A socket of `kind` that lingers not and refuses frames over `MAX_WIRE_BYTES`."""
    sock = context().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES)
    return sock


def curve_enabled(curve: bool | None, secret: bytes | None) -> bool:
    """Whether to use CURVE (None: `VLLM_NCCL_SYNC_CURVE=1`); `ValueError` if it cannot be."""
    if curve is None:
        curve = os.environ.get("VLLM_NCCL_SYNC_CURVE", "") == "1"
    if curve and not secret:
        raise ValueError("CURVE needs a shared secret (its keys are derived from it)")
    if curve and not zmq.has("curve"):
        raise ValueError("CURVE requested but this libzmq has no CURVE support (libsodium)")
    return bool(curve)


def curve_server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The trainer's CURVE key pair (z85 public, z85 secret), derived from the shared secret."""
    seed = hmac.new(secret, b"vllm-nccl-sync/curve-server", hashlib.sha256).digest()
    sk = z85.encode(seed)
    return zmq.curve_public(sk), sk


def peer(frame: zmq.Frame, routing_id: bytes | None = None) -> str:
    """The address a frame came from (and its routing id's first bytes), for logs."""
    try:
        addr = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        addr = "?"
    rid = f" id={routing_id[:8].hex()}" if routing_id is not None else ""
    return f"{addr}{rid}"


class LinkWatch:
    """The connection events of a DEALER (a socket monitor, attached before it connects): why
    its link to the trainer is down ("" while up, or not yet tried)."""

    def __init__(self, sock: zmq.Socket, rank: int, endpoint: str) -> None:
        self.dropped = ""
        self._rank, self._endpoint = rank, endpoint
        addr = f"inproc://vllm-nccl-sync-monitor-{secrets.token_hex(8)}"
        sock.monitor(addr, _WATCH)
        self.socket = context().socket(zmq.PAIR)
        """The monitor's end, to poll beside the DEALER."""
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, _MONITOR_HWM)
        self.socket.connect(addr)

    def read(self) -> str:
        """Read the pending events (never blocks); returns `dropped`."""
        while True:
            try:
                ev = parse_monitor_message(self.socket.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return self.dropped
            kind = ev["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self.dropped:
                    log.info("rank %d reconnected to the trainer (%s)", self._rank, self._endpoint)
                self.dropped = ""
            elif kind == zmq.EVENT_DISCONNECTED:
                if not self.dropped:  # keep a handshake failure's more precise reason
                    self.dropped = DROPPED
                    log.warning("rank %d: %s (%s)", self._rank, DROPPED, self._endpoint)
            else:
                why = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication failed",
                       zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error"}.get(kind, "no detail")
                text = (f"the handshake with the trainer failed ({why}: a CURVE/secret "
                        "mismatch, or no trainer of this package on that port)")
                if text != self.dropped:  # libzmq retries every reconnect interval: log once
                    log.warning("rank %d: %s (%s)", self._rank, text, self._endpoint)
                self.dropped = text

    def close(self, sock: zmq.Socket) -> None:
        """Stop monitoring `sock` (still open) and close the monitor's end (idempotent)."""
        if not sock.closed:
            try:
                sock.monitor(None, 0)  # stops libzmq's end of the monitor
            except zmq.ZMQError:
                pass
        if not self.socket.closed:
            self.socket.close()
