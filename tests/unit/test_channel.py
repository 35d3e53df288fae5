"""The control channel on real ZeroMQ sockets (127.0.0.1): bounded sends, dropped connections,
send_all past dead or slow peers, bounded error texts.

No test sleeps and then asserts; state is observed with bounded polling loops."""

from __future__ import annotations

import os
import re
import time

import pytest
import zmq

from vllm_nccl_sync.trainer.sync import free_port
from vllm_nccl_sync.wire import channel, sockets
from vllm_nccl_sync.wire.channel import ReceiverChannel, SenderChannel, clip
from vllm_nccl_sync.wire.protocol import PROTOCOL_VERSION as P
from vllm_nccl_sync.wire.protocol import Abort, Error, Go, Hello, encode

SECRET = bytes.fromhex("5ec7e7" * 8)


def hello(rank: int) -> Hello:
    return Hello(protocol=P, rank=rank, replica=0, tp_rank=0, tp_size=1, bucket_bytes=1024,
                 backend="gloo")


def abort(reason: str) -> Abort:
    return Abort(protocol=P, version=1, seq=0, reason=reason)


def until(cond, timeout: float = 10.0, what: str = "condition", step=None):
    """Poll `cond()` until true (returns its value); fails the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if step is not None:
            step()
        else:
            time.sleep(0.01)
    pytest.fail(f"timed out waiting for {what}")


def join(trainer: SenderChannel, *rxs: ReceiverChannel) -> None:
    """Each receiver says Hello; wait until the trainer has bound all their sessions."""
    for rx in rxs:
        rx.send(hello(rx.rank))
    deadline = time.monotonic() + 10
    while any(trainer._by_rank.get(rx.rank) != rx.session for rx in rxs):
        trainer.recv(deadline)


@pytest.fixture
def net():
    """A trainer on a free port and a factory of receivers connected to it; all closed after."""
    port = free_port()
    trainer = SenderChannel("127.0.0.1", port, SECRET)
    made: list[ReceiverChannel] = []

    def receiver(rank: int) -> ReceiverChannel:
        made.append(ReceiverChannel("127.0.0.1", port, rank, SECRET))
        return made[-1]

    yield trainer, receiver
    for rx in made:
        rx.close()
    trainer.close()


# ---------------------------------------------------------------- dropped connections

def test_a_connection_dropped_by_an_oversized_frame_is_reported_and_sends_are_bounded(net):
    trainer, receiver = net
    rx = receiver(1)
    join(trainer, rx)
    trainer.send(1, Go(protocol=P, version=1, seq=0))
    assert rx.recv(5.0) == Go(protocol=P, version=1, seq=0)
    assert rx.dropped == ""
    # A frame over MAXMSGSIZE: libzmq on the receiver's side drops the connection for good.
    trainer._sock.send_multipart([rx.session, b"t" * 77, b"\x00" * (channel.MAX_WIRE_BYTES + 1)])
    text = until(lambda: rx.dropped, what="the monitor to report the drop")
    assert "connection to the trainer was dropped" in text and str(channel.MAX_WIRE_BYTES) in text
    # libzmq tears the DEALER's pipe down a moment after the event; once it has, nothing can
    # queue a frame any more (a frame sent in between would be lost, as on any dropped link).
    until(lambda: not rx._sock.poll(0, zmq.POLLOUT), what="the pipe to be gone")
    err = Error(protocol=P, rank=1, seq=0, message="boom")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        rx.send(err, timeout_s=0.5)
    assert time.monotonic() - t0 < 5  # bounded (0.5 s asked; slack for a loaded machine)
    assert re.search(r"could not send Error to the trainer .* within 0\.5 s: the connection "
                     r"to the trainer was dropped", str(e.value))
    with pytest.raises(TimeoutError, match="within 0.3 s: the connection to the trainer was "
                                           "dropped"):
        rx.recv(0.3)
    assert rx.dropped == text  # for good: libzmq does not reconnect after a protocol error


def test_a_restarted_trainer_clears_dropped():
    port = free_port()
    trainer = SenderChannel("127.0.0.1", port, SECRET)
    rx = ReceiverChannel("127.0.0.1", port, 1, SECRET)
    try:
        join(trainer, rx)
        trainer.close()
        until(lambda: "trainer went away" in rx.dropped, what="the drop to be seen")
        trainer = until(lambda: _bind(port), what="the port to be free again")
        rx.send(hello(1))  # queued on the pipe, which survives a reconnect
        join(trainer, rx)
        until(lambda: rx.dropped == "", what="the reconnect to clear dropped")
    finally:
        rx.close()
        trainer.close()


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_a_failed_curve_handshake_is_reported():
    port = free_port()
    trainer = SenderChannel("127.0.0.1", port, SECRET, curve=True)
    rx = ReceiverChannel("127.0.0.1", port, 1, b"wrong secret" * 2, curve=True)
    try:
        until(lambda: rx.dropped, what="the failed handshake to be seen")
        assert "handshake with the trainer failed" in rx.dropped
        with pytest.raises(TimeoutError, match="handshake with the trainer failed"):
            rx.recv(0.1)
    finally:
        rx.close()
        trainer.close()


def _bind(port: int) -> SenderChannel | None:
    try:
        return SenderChannel("127.0.0.1", port, SECRET)
    except zmq.ZMQError:
        return None


def test_channels_close_their_monitors(net):
    """Many receivers opened and closed leave no file descriptors or threads behind."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc")
    trainer, _ = net
    port = int(trainer.endpoint.rsplit(":", 1)[1])

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def tasks() -> int:
        return len(os.listdir("/proc/self/task"))

    warm = ReceiverChannel("127.0.0.1", port, 1, SECRET)  # the shared context's threads
    warm.close()
    before_fds, before_tasks = fds(), tasks()
    for i in range(60):
        rx = ReceiverChannel("127.0.0.1", port, 2 + i, SECRET)
        rx.send(hello(rx.rank))
        rx.close()
        rx.close()  # idempotent
    until(lambda: fds() <= before_fds + 2, what=f"fds back to {before_fds} (now {fds()})",
          step=lambda: _pump(trainer))
    assert tasks() <= before_tasks


def _pump(trainer: SenderChannel) -> None:
    """Let the trainer read (and check) whatever arrived, briefly."""
    try:
        trainer.recv(time.monotonic() + 0.02)
    except TimeoutError:
        pass


# ---------------------------------------------------------------- send_all, send

def test_send_all_reaches_every_live_rank_past_a_dead_one(net):
    trainer, receiver = net
    rxs = {r: receiver(r) for r in (1, 2, 3)}
    join(trainer, *rxs.values())
    rxs[1].close()  # its process gone: the trainer notices when the connection closes
    i = 0
    while True:
        i += 1
        missed = trainer.send_all([1, 2, 3], abort(f"abort {i}"))  # never raises
        for r in (2, 3):  # every attempt reaches the live ranks
            assert rxs[r].recv(5.0) == abort(f"abort {i}")
        if missed:
            break
        assert i < 500, "the trainer never noticed the closed receiver"
    assert missed == [1]
    assert "not connected" in trainer.unreachable[1]
    with pytest.raises(zmq.ZMQError, match="rank 1 is not connected") as e:
        trainer.send(1, abort("direct"))
    assert e.value.errno == zmq.EHOSTUNREACH


def test_send_all_names_ranks_without_a_session(net):
    trainer, receiver = net
    rx = receiver(2)
    join(trainer, rx)
    assert trainer.send_all([1, 2, 7], abort("x")) == [1, 7]
    assert rx.recv(5.0) == abort("x")
    with pytest.raises(zmq.ZMQError, match="no session"):
        trainer.send(1, abort("x"))


def test_a_full_queue_holds_up_neither_send_all_nor_send(monkeypatch):
    """Rank 1 never reads: once its queue is full, send times out and send_all goes past it."""
    real = sockets.new_socket

    def small_queues(kind):
        sock = real(kind)
        sock.setsockopt(zmq.SNDHWM, 1)
        sock.setsockopt(zmq.RCVHWM, 1)
        return sock

    monkeypatch.setattr(sockets, "new_socket", small_queues)
    port = free_port()
    trainer = SenderChannel("127.0.0.1", port, SECRET)
    rxs = {r: ReceiverChannel("127.0.0.1", port, r, SECRET) for r in (1, 2, 3)}
    try:
        join(trainer, *rxs.values())
        big = abort("x" * (1 << 20))
        for n in range(1000):  # fills its queue and the kernel's buffers (a few MiB)
            t0 = time.monotonic()
            try:
                trainer.send(1, big, timeout_s=0.2)
            except TimeoutError as e:  # nothing moved for 0.2 s: stuck until rank 1 reads
                assert re.search(r"rank 1 within 0\.2 s: its queue stayed full", str(e))
                break
        else:
            pytest.fail("rank 1's queue never filled")
        assert trainer.send_all([1, 2, 3], abort("all"), timeout_s=0.2) == [1]
        assert time.monotonic() - t0 < 5  # bounded (0.4 s asked; slack for a loaded machine)
        assert "queue stayed full" in trainer.unreachable[1]
        for r in (2, 3):
            assert rxs[r].recv(5.0) == abort("all")
    finally:
        for rx in rxs.values():
            rx.close()
        trainer.close()


# ---------------------------------------------------------------- bounded texts

def test_error_texts_are_clipped_both_ways(net):
    trainer, receiver = net
    rx = receiver(1)
    join(trainer, rx)
    huge = "m" * 500_000 + "M" * 500_000
    rx.send(Error(protocol=P, rank=1, seq=3, message=huge, traceback="t" * 999_999 + "END"))
    rank, got = trainer.recv(time.monotonic() + 5)
    assert rank == 1 and isinstance(got, Error) and got.seq == 3
    assert len(got.message) <= channel.ERROR_MESSAGE_CHARS
    assert got.message.startswith("mmm") and got.message.endswith("MMM")
    assert re.search(r"\[\d+ chars cut\]", got.message)
    assert len(got.traceback) <= channel.ERROR_TRACEBACK_CHARS and got.traceback.endswith("END")
    # An Error that bypassed the clip (an older peer) is clipped on receipt too.
    trainer._send_payload(1, encode(Error(protocol=P, rank=0, seq=0, message=huge)))
    got = rx.recv(5.0)
    assert isinstance(got, Error) and len(got.message) <= channel.ERROR_MESSAGE_CHARS


def test_clip():
    assert clip("short") == "short"
    assert clip("x" * 2000) == "x" * 2000
    for n, limit in [(2001, 2000), (10**6, 2000), (5000, 100), (123456, 64)]:
        text = "".join(chr(97 + i % 26) for i in range(n))
        out = clip(text, limit)
        assert len(out) == limit
        head, cut, tail = re.fullmatch(r"(.*) \u2026 \[(\d+) chars cut\] \u2026 (.*)", out).groups()
        assert text.startswith(head) and text.endswith(tail)
        assert len(head) + int(cut) + len(tail) == n
    assert clip("x" * 100, 10) == "x" * 10  # no room for the marker: a plain cut
