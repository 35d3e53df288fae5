"""The same-host planes' handoff (`planes.handoff`) on real Unix sockets and real ZeroMQ
channels, in one process: memory goes many segments to a packet, each with its own
descriptors; a receiver waiting for the trainer takes memory however much of it there is; a
socket that failed is no longer served. Timeouts here bound waits that nothing will end, never a
race against the clock."""

from __future__ import annotations

import os
import threading

import pytest

from tests.conftest import free_port
from tests.unit.test_channel import SECRET, join
from vllm_nccl_sync.planes import handoff
from vllm_nccl_sync.planes.handoff import Hub, Join, Link, Memory, Segment
from vllm_nccl_sync.wire.channel import ReceiverChannel, SenderChannel
from vllm_nccl_sync.wire.protocol import PROTOCOL_VERSION, Go


@pytest.fixture
def pair():
    """A hub (the sender's end, rank 0) with one receiver's link (rank 1) connected to it."""
    hubs: list[Hub] = []
    links: list[Link] = []

    def connect(timeout_s: float = 20.0) -> tuple[Hub, Link]:
        hub = Hub(None, timeout_s)
        got: dict[str, Link] = {}
        t = threading.Thread(target=lambda: got.setdefault(
            "link", Link(Join(1, hub.name, 1), 1, None, timeout_s)))
        t.start()
        hub.accept(range(1, 2))
        t.join(timeout_s)
        hubs.append(hub)
        links.append(got["link"])
        return hub, got["link"]

    yield connect
    for link in links:
        link.close()
    for hub in hubs:
        hub.close()


@pytest.fixture
def served(pair):
    """A hub and link (`pair`), and a trainer's control channel with the receiver's, the link
    served while the receiver waits (as `Receiver` does)."""
    hub, link = pair()
    port = free_port()
    trainer = SenderChannel("127.0.0.1", port, SECRET)
    rx = ReceiverChannel("127.0.0.1", port, 1, SECRET)
    try:
        join(trainer, rx)
        rx.serve(link.fileno(), link.take)
        yield hub, link, trainer, rx
    finally:
        rx.close()
        trainer.close()


def test_memory_goes_many_segments_to_a_packet_each_with_its_own_descriptors(pair, monkeypatch):
    hub, link = pair()
    sent: list[int] = []
    real = handoff._Socket.send
    monkeypatch.setattr(handoff._Socket, "send",
                        lambda self, p, fds=(): (sent.append(len(fds)), real(self, p, fds)))
    memory = [handoff.new_memory(4096 * (1 + n % 5)) for n in range(600)]
    try:
        hub.hand_over([(n, f"h{n}".encode(), [fd]) for n, fd in enumerate(memory)])
    finally:
        for fd in memory:
            os.close(fd)
    assert sent == [253, 253, 94]  # the kernel's most per packet
    for n in range(600):
        handle, fds = link.segment(n)
        assert handle == f"h{n}".encode() and len(fds) == 1
        assert os.fstat(fds[0]).st_size == 4096 * (1 + n % 5)  # its own, in order
    with pytest.raises(ValueError, match="memory segment 600 was never exported"):
        link.segment(600)
    monkeypatch.setattr(handoff, "_FORGET", 100)
    sent.clear()
    hub.forget(list(range(0, 600, 2)))  # their storages died
    assert sent == [0, 0, 0]  # 300 segments, 100 to a packet
    assert link.take() and sorted(link.announced) == list(range(1, 600, 2))


def test_a_receiver_waiting_for_the_trainer_takes_memory_past_the_socket_buffer(served):
    """Memory many times the socket's buffer: the sender's sends complete because the receiver
    takes it while it waits for the trainer's next message (which the sender sends after)."""
    hub, link, trainer, rx = served
    go = Go(protocol=PROTOCOL_VERSION, version=1, seq=0)
    memory = [(n, bytes([n % 251]) * 8000, []) for n in range(400)]  # 3.2 MB of handles

    def send() -> None:
        hub.hand_over(memory)
        trainer.send(1, go)

    t = threading.Thread(target=send)
    t.start()
    assert rx.recv(30.0) == go
    t.join(30.0)
    assert not hub.gone
    assert all(link.segment(n)[0] == h for n, h, _ in memory)


def test_memory_nobody_takes_fails_its_send_at_the_timeout_and_names_the_receiver(pair):
    """Without a receiver waiting, a send past the buffer fails at the timeout: that receiver is
    `gone` (named), and it refuses a plan naming what it never got."""
    hub, link = pair(timeout_s=0.5)
    hub.hand_over([(n, b"x" * 8000, []) for n in range(400)])
    assert "its handoff socket failed" in hub.gone[1]
    with pytest.raises(ValueError, match="memory segment 399 was never exported"):
        link.segment(399)


@pytest.mark.parametrize("bad, why", [
    (Memory([Segment(0, b"", 1)]), "descriptors it does not announce"),
    (Memory([Segment(0, b"", -1), Segment(1, b"", 1)]), "negative number of descriptors"),
])
def test_a_handoff_socket_that_failed_is_no_longer_served(served, bad, why):
    hub, link, _, rx = served
    hub.links[1].send(bad)  # no descriptor comes with it
    hub.links[1].send(Memory([Segment(1, b"", 0)]))  # (after a refused one: not taken)
    with pytest.raises(TimeoutError):
        rx.recv(0.2)
    assert rx._served == {}  # taken once, refused, then no longer polled
    assert why in link.failed and not link.announced
    with pytest.raises(ValueError, match="the sender's handoff socket failed"):
        link.segment(0)


def test_a_closed_handoff_socket_is_no_longer_served(served):
    hub, link, _, rx = served
    hub.close()
    with pytest.raises(TimeoutError):
        rx.recv(0.2)
    assert rx._served == {} and "closed the handoff socket" in link.failed
