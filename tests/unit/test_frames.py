"""Hostile control frames, one table, both directions, over real ZeroMQ sockets (127.0.0.1).

Each row is one frame a peer could put on the wire, and the reason each end counts when it drops
it: the trainer's `SenderChannel` (frames from a receiver's DEALER) and a `ReceiverChannel`
(frames from the trainer's ROUTER). Every row asserts that exactly that reason was counted and
that the wait it arrived in went on: the same `recv` returns the next valid message. `None`: the
row does not apply that way (e.g. only the trainer binds new sessions).

No test sleeps and then asserts; every wait is bounded.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import zmq

from tests.conftest import free_port
from vllm_nccl_sync.wire import frames
from vllm_nccl_sync.wire.channel import ReceiverChannel, SenderChannel
from vllm_nccl_sync.wire.frames import META, NO_EPOCH, FrameMeta
from vllm_nccl_sync.wire.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Go,
    Hello,
    Message,
    ProtocolError,
    Ready,
    encode,
)

P = PROTOCOL_VERSION
SECRET = bytes.fromhex("f0" * 32)
OTHER = bytes.fromhex("0f" * 32)
HELLO = Hello(P, 1, 0, 0, 1, 1024, "gloo")


@dataclass
class End:
    """One direction of a joined trainer/receiver pair, seen from the frame's sender."""

    direction: bytes
    secret: bytes | None
    session: bytes
    epoch: bytes
    rank: int
    last: int
    """The last counter this way, already accepted."""
    take: Callable[[], int]
    """A fresh counter, taken from the real sender's sequence (so its next frame stays valid)."""
    raw: Callable[[list[bytes], bytes | None], None]
    """Put `parts` on the wire: from the pair's own socket, or (for the trainer) from a new
    connection whose routing id is the given session."""
    good: Callable[[int], Message]
    """Send valid message number i the normal way; returns it."""
    recv: Callable[[float], Message]
    """One wait of the receiving end, up to a deadline."""
    rejections: Callable[[], Counter[str]]

    def tag(self, payload: bytes, *, secret: bytes | None | str = "same", **meta) -> bytes:
        """A tag for `payload`, valid this way unless `meta` (session, epoch, counter, rank)
        or `secret` say otherwise."""
        fields = {"session": self.session, "epoch": self.epoch, "rank": self.rank, **meta}
        fields.setdefault("counter", self.take())
        return frames.build_tag(self.secret if secret == "same" else secret, self.direction,
                            FrameMeta(**fields), payload)

    def frame(self, msg: Message | bytes, **kw) -> list[bytes]:
        payload = msg if isinstance(msg, bytes) else encode(msg)
        return [self.tag(payload, **kw), payload]


READY = encode(Ready(P, 1, 0))


def _framing(e: End, version: int) -> list[bytes]:
    meta = META.pack(version, e.session, e.epoch, e.take(), e.rank)
    return [meta + frames.mac(e.secret, e.direction, meta, READY), READY]


def _altered(e: End) -> list[bytes]:
    tag, payload = e.frame(READY)
    return [tag, payload[:-1] + bytes([payload[-1] ^ 1])]


def _reflected(e: End) -> list[bytes]:
    """A valid frame of the other direction, sent back the way it came."""
    back = frames.TO_SENDER if e.direction == frames.TO_RECEIVER else frames.TO_RECEIVER
    return [frames.build_tag(e.secret, back, FrameMeta(e.session, e.epoch, e.take(), e.rank), READY),
            READY]


def _tag_cut(e: End, n: int) -> list[bytes]:
    tag, payload = e.frame(READY)
    return [tag[:n] if n < len(tag) else tag + bytes(n - len(tag)), payload]


FRESH = b"S" + secrets.token_bytes(15)  # a session the trainer never saw

# id: (reason at the trainer, reason at a receiver, the pair's secret, the hostile frame, via)
ROWS: dict[str, tuple[str | None, str | None, bytes | None, Callable[[End], list[bytes]], bool]] = {
    "oversized": ("oversized", "oversized", SECRET,
                  lambda e: [b"t" * 77, bytes(MAX_FRAME_BYTES + 1)], False),
    "three parts": ("malformed", "malformed", SECRET, lambda e: [*e.frame(READY), b"x"], False),
    "one part": ("malformed", "malformed", SECRET, lambda e: [e.frame(READY)[1]], False),
    "short tag": ("malformed", "malformed", SECRET, lambda e: _tag_cut(e, 12), False),
    "long tag": ("malformed", "malformed", SECRET,
                 lambda e: _tag_cut(e, META.size + frames.MAC_BYTES + 5), False),
    "empty tag (old wire)": ("malformed", "malformed", SECRET, lambda e: [b"", READY], False),
    "MAC missing": ("bad MAC", "bad MAC", SECRET, lambda e: e.frame(READY, secret=None), False),
    "MAC unexpected": ("bad MAC", "bad MAC", None, lambda e: e.frame(READY, secret=SECRET),
                       False),
    "MAC wrong": ("bad MAC", "bad MAC", SECRET, lambda e: e.frame(READY, secret=OTHER), False),
    "payload altered": ("bad MAC", "bad MAC", SECRET, _altered, False),
    "reflected": ("bad MAC", "bad MAC", SECRET, _reflected, False),
    "framing 2": ("malformed", "malformed", SECRET, lambda e: _framing(e, 2), False),
    "wrong session": ("session/routing id mismatch", "wrong session", SECRET,
                      lambda e: e.frame(READY, session=FRESH), False),
    "wrong rank": ("rank mismatch", "wrong session", SECRET,
                   lambda e: e.frame(Ready(P, 2, 0), rank=2), False),
    "replayed counter": ("replayed", "replayed", SECRET,
                         lambda e: e.frame(READY, counter=e.last), False),
    "counter 0": ("replayed", "replayed", SECRET, lambda e: e.frame(READY, counter=0), False),
    "wrong epoch": ("wrong trainer instance", "wrong trainer instance", SECRET,
                    lambda e: e.frame(READY, epoch=b"E" * 16), False),
    "no epoch": (None, "wrong trainer instance", SECRET,
                 lambda e: e.frame(READY, epoch=NO_EPOCH), False),
    "undecodable": ("undecodable", None, SECRET, lambda e: e.frame(b"\xc1"), False),
    "message of another rank": ("rank mismatch", None, SECRET,
                                lambda e: e.frame(Ready(P, 2, 0)), False),
    "no Hello first": ("no session", None, SECRET,
                       lambda e: e.frame(READY, session=FRESH, epoch=NO_EPOCH, counter=0), True),
    "new session with an epoch": ("stale session", None, SECRET,
                                  lambda e: e.frame(HELLO, session=FRESH, counter=0), True),
}
CASES = [pytest.param(way, row, id=f"{way}-{row}") for row, (to_s, to_r, *_) in ROWS.items()
         for way, reason in (("to-trainer", to_s), ("to-receiver", to_r)) if reason is not None]


@pytest.fixture
def pair():
    """A trainer and a receiver of rank 1, joined (the receiver has learned the epoch); returns
    a factory of `End`s for a direction and a secret. Everything is closed after."""
    made: list = []

    def make(way: str, secret: bytes | None) -> End:
        port = free_port()
        trainer = SenderChannel("127.0.0.1", port, secret)
        rx = ReceiverChannel("127.0.0.1", port, 1, secret)
        made.extend([rx, trainer])
        rx.send(HELLO)
        assert trainer.recv(time.monotonic() + 10) == (1, HELLO)
        trainer.send(1, Go(P, 1, 0))
        assert rx.recv(10.0) == Go(P, 1, 0)
        s = trainer._sessions[rx.session]
        if way == "to-trainer":
            def take() -> int:
                rx._sent += 1
                return rx._sent - 1

            def raw(parts, via):
                if via is None:
                    return rx._sock.send_multipart(parts)
                sock = zmq.Context.instance().socket(zmq.DEALER)
                made.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IDENTITY, via)
                sock.connect(f"tcp://127.0.0.1:{port}")
                sock.send_multipart(parts)

            def good(i: int) -> Message:
                rx.send(Ready(P, 1, i))
                return Ready(P, 1, i)

            def recv(deadline: float) -> Message:
                rank, msg = trainer.recv(deadline)
                assert rank == 1
                return msg

            return End(frames.TO_SENDER, secret, rx.session, trainer.epoch, 1, rx._sent - 1,
                       take, raw, good, recv, lambda: trainer.rejections.copy())

        def take() -> int:
            s.sent += 1
            return s.sent

        def good(i: int) -> Message:
            trainer.send(1, Go(P, 1, i))
            return Go(P, 1, i)

        return End(frames.TO_RECEIVER, secret, rx.session, trainer.epoch, 1, s.sent, take,
                   lambda parts, via: trainer._sock.send_multipart([rx.session, *parts]),
                   good, lambda deadline: rx.recv(max(deadline - time.monotonic(), 0)),
                   lambda: rx.rejections.copy())

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize("way, row", CASES)
def test_a_hostile_frame_is_dropped_counted_and_the_wait_goes_on(pair, way, row):
    to_trainer, to_receiver, secret, build, fresh = ROWS[row]
    reason = to_trainer if way == "to-trainer" else to_receiver
    end = pair(way, secret)
    before = end.rejections()
    end.raw(build(end), FRESH if fresh else None)
    deadline = time.monotonic() + 10
    i = 0
    # One valid message after it: the wait that drops the hostile frame returns this one. (A
    # frame from another connection may arrive after it: then send again until it is seen.)
    while end.rejections() == before:
        assert time.monotonic() < deadline, f"the {row!r} frame was never dropped"
        i += 1
        _next(end, i, deadline)
    assert end.rejections() - before == Counter({reason: 1})
    _next(end, i + 1, deadline)  # and the channel goes on working


def _next(end: End, i: int, deadline: float) -> None:
    """Send valid message `i` the normal way; the receiving end's next wait returns it."""
    sent = end.good(i)
    got = end.recv(deadline)
    assert got == sent, (got, sent)


def test_every_row_is_tried_both_ways_where_it_applies():
    """The table covers each check of `frames.check_frame` and of both ends' own rules."""
    reasons = Counter(r for to_s, to_r, *_ in ROWS.values() for r in (to_s, to_r) if r)
    assert set(reasons) == {"oversized", "malformed", "bad MAC", "session/routing id mismatch",
                            "wrong session", "rank mismatch", "replayed", "wrong trainer instance",
                            "undecodable", "no session", "stale session"}
    assert sum(1 for to_s, to_r, *_ in ROWS.values() if to_s and to_r) >= 15


def test_an_authenticated_undecodable_frame_fails_the_receivers_wait(pair):
    """The one asymmetry: a frame that passes every check of a receiver but does not decode
    came from the authenticated trainer, so `recv` raises instead of dropping it."""
    end = pair("to-receiver", SECRET)
    end.raw(end.frame(b"\xc1"), None)
    with pytest.raises(ProtocolError, match="undecodable"):
        end.recv(time.monotonic() + 10)
    assert end.rejections() == Counter()
    _next(end, 1, time.monotonic() + 10)


def test_check_names_each_problem_without_sockets():
    """`frames.check_frame` alone, in its order: size before tag before MAC before framing."""
    meta = FrameMeta(b"S" * 16, b"E" * 16, 5, 3)
    payload = encode(Ready(P, 3, 0))
    tag = frames.build_tag(SECRET, frames.TO_SENDER, meta, payload)
    assert frames.check_frame(SECRET, frames.TO_SENDER, [tag, payload]) == meta
    assert frames.check_frame(SECRET, frames.TO_RECEIVER, [tag, payload]).reason == "bad MAC"
    big = bytes(MAX_FRAME_BYTES + 1)
    assert frames.check_frame(SECRET, frames.TO_SENDER, [b"", big]).reason == "oversized"
    assert frames.check_frame(SECRET, frames.TO_SENDER, [tag[:-32], payload]) == frames.Rejection(
        "bad MAC", "a secret is configured on one side only")
    assert frames.check_frame(None, frames.TO_SENDER, [tag, payload]).detail.startswith("a secret")
    assert frames.check_frame(None, frames.TO_SENDER, [tag[:-32], payload]) == meta
    assert frames.check_frame(SECRET, frames.TO_SENDER, [tag[:5], payload]) == frames.Rejection(
        "malformed", "tag of 5 bytes")
    assert frames.check_frame(SECRET, frames.TO_SENDER, [tag]) == frames.Rejection(
        "malformed", "1 frames, expected 2")
