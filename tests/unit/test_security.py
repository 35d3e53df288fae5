"""Security of the control plane: no pickle, HMAC-authenticated sessions, replay, binding, sizes.

A peer without the shared secret can reach the trainer's port but not the protocol: each of its
frames is dropped, logged with its address and counted, it never becomes a receiver and it cannot
push to one. Captured frames do not replay. The trainer binds only the configured address, and a
frame over the size bound is dropped before it is hashed or decoded, the socket living on.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import fcntl
import logging
import pathlib
import socket
import struct
import threading
import time

import pytest
import torch
import zmq

import vllm_nccl_sync
import vllm_nccl_sync.engine.receiver as receiver_mod
from tests.conftest import free_port
from vllm_nccl_sync import PushClient, SyncConfig
from vllm_nccl_sync.engine.receiver import Receiver
from vllm_nccl_sync.planes.base import Transport
from vllm_nccl_sync.planes.registry import open_transport
from vllm_nccl_sync.wire import channel, frames
from vllm_nccl_sync.wire.channel import ReceiverChannel, SenderChannel
from vllm_nccl_sync.wire.integrity import checksum
from vllm_nccl_sync.wire.packing import plan_buckets
from vllm_nccl_sync.wire.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Ack,
    BucketHeader,
    Commit,
    Digest,
    Error,
    Go,
    Hello,
    Plan,
    ProtocolError,
    Ready,
    Seal,
    Slot,
    encode,
)

P = PROTOCOL_VERSION
SECRET = bytes.fromhex("a1" * 32)
WRONG = bytes.fromhex("b2" * 32)
HELLO = Hello(P, 1, 0, 0, 1, 1024, "gloo")
LOG = "vllm_nccl_sync.wire"


def rogue_frames(rank: int = 1) -> list:
    return [Hello(P, rank, 0, 0, 1, 1024, "gloo"), Ready(P, rank, 0),
            Ack(P, rank, 1, 1, 0, 0, 0.0), Error(P, rank, 0, "rogue", "")]


def wait_bound(trainer: SenderChannel, rx: ReceiverChannel, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while trainer._by_rank.get(rx.rank) != rx.session:
        trainer.recv(deadline)


# ---------------------------------------------------------------- (a) no pickle

FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "shelve", "marshal",
                     "joblib", "jsonpickle"}
FORBIDDEN_ATTRS = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}


def unpickling_in(source: str) -> list[str]:
    """Imports of pickle-like codecs and calls that unpickle (pyzmq's *_pyobj, torch.load)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[0] in FORBIDDEN_MODULES:
                found.append(mod)
            if mod == "torch" and any(a.name == "load" for a in node.names):
                found.append("from torch import load")
        elif isinstance(node, ast.Attribute):
            if node.attr in FORBIDDEN_ATTRS or ast.unparse(node) == "torch.load":
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Name) and node.id in {"eval", "exec"}:
            found.append(node.id)
    return found


def test_no_pickle_anywhere_in_the_package():
    """No module of the package imports a pickle-like codec or unpickles (torch.load, pyobj)."""
    assert unpickling_in("import pickle\nfrom dill import loads\ns.recv_pyobj()\ntorch.load(f)")
    root = pathlib.Path(vllm_nccl_sync.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) >= 8
    found = {p.name: f for p in files if (f := unpickling_in(p.read_text()))}
    assert found == {}, found


# ---------------------------------------------------------------- (b) HMAC: rogue receivers

@pytest.mark.parametrize("rogue_secret", [None, WRONG], ids=["no-secret", "wrong-secret"])
def test_trainer_drops_every_frame_of_a_peer_without_the_secret(rogue_secret, caplog):
    port = free_port()
    trainer = SenderChannel("127.0.0.1", port, SECRET)
    rogue = ReceiverChannel("127.0.0.1", port, 1, rogue_secret)
    raw = zmq.Context.instance().socket(zmq.DEALER)  # the old wire: identity = rank, bare frames
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.IDENTITY, b"1")
    raw.connect(f"tcp://127.0.0.1:{port}")
    try:
        with caplog.at_level(logging.WARNING, logger=LOG):
            for msg in rogue_frames():
                rogue.send(msg)
                raw.send_multipart([b"", encode(msg)])
            raw.send_multipart([b"\x00" * 77, encode(HELLO)])
            sent = 2 * len(rogue_frames()) + 1
            with pytest.raises(TimeoutError, match="bad MAC.*same secret"):
                trainer.recv(time.monotonic() + 1.0)
        assert trainer.rejected == sent
        assert trainer.rejections["bad MAC"] == len(rogue_frames()) + 1  # MAC missing or wrong
        assert trainer.rejections["malformed"] == len(rogue_frames())  # the old wire's empty tag
        assert trainer._by_rank == {} and trainer._sessions == {}  # it never became a receiver
        with pytest.raises(zmq.ZMQError, match="no session"):
            trainer.send(1, Go(P, 1, 0))
        logged = [m for r in caplog.records if "dropped control frame" in (m := r.getMessage())]
        assert len(logged) == sent
        assert all("127.0.0.1" in m and "id=" in m for m in logged)  # the peer is named
        assert any(f"id={rogue.session[:8].hex()}" in m for m in logged)
    finally:
        rogue.close()
        raw.close()
        trainer.close()


def test_rogue_cannot_join_or_steer_a_real_update():
    """A rogue squats rank 1 before the real receiver connects and keeps talking during the
    update: the trainer joins only the real receiver, and the update arrives intact."""
    port = free_port()
    cfg = SyncConfig(control_port=port, group_port=free_port(), world_size=2,
                     bucket_bytes=4096, timeout_s=10.0, secret=SECRET.hex())
    client = PushClient(cfg)
    rogue = ReceiverChannel("127.0.0.1", port, 1, WRONG)
    squat = zmq.Context.instance().socket(zmq.DEALER)
    squat.setsockopt(zmq.LINGER, 0)
    squat.setsockopt(zmq.IDENTITY, b"1")
    squat.connect(f"tcp://127.0.0.1:{port}")
    rogue.send(Hello(P, 1, 0, 0, 1, 999, "nccl"))  # would fail connect() if it were believed
    squat.send_multipart([b"", encode(Hello(P, 1, 0, 0, 1, 999, "nccl"))])
    time.sleep(0.2)  # both are connected (and heard) before the real receiver
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("hellos", client.connect()))
    th.start()
    rx = Receiver(cfg, 1, replica=3)
    th.join(30)
    try:
        assert box["hellos"][1].replica == 3 and box["hellos"][1].bucket_bytes == 4096
        for msg in rogue_frames():  # sits in the trainer's queue during the update
            rogue.send(msg)
        g = torch.Generator().manual_seed(0)
        weights = {"a": torch.randn(1000, generator=g), "b": torch.randn(7, generator=g)}
        loaded: dict = {}

        class Loader:
            def begin(self): ...
            def finish(self): ...
            def abort(self): ...

            def load(self, named):
                loaded.update({n: t.clone() for n, t in named})

        out: dict = {}
        th = threading.Thread(target=lambda: out.setdefault("r", client.push(weights, version=1)))
        th.start()
        summary = rx.receive(Loader(), timeout_s=10)
        th.join(30)
        assert summary["ok"], summary
        assert [a.rank for a in out["r"].acks] == [1]
        for n, t in weights.items():
            assert torch.equal(loaded[n], t)
        with pytest.raises(TimeoutError):  # whatever of the rogue's is still queued
            client.channel.recv(time.monotonic() + 0.5)
        assert client.channel.rejected == 1 + 1 + len(rogue_frames())  # every rogue frame
        assert client.channel._by_rank == {1: rx.channel.session}
    finally:
        rx.close()
        client.close()
        rogue.close()
        squat.close()


def test_wrong_secret_receiver_cannot_join():
    """A receiver given the wrong secret: the trainer's connect fails naming the secret."""
    port = free_port()
    base = dict(control_port=port, group_port=free_port(), world_size=2, bucket_bytes=4096,
                timeout_s=1.5)
    client = PushClient(SyncConfig(**base, secret=SECRET.hex()))
    err: dict = {}

    def connect():
        try:
            client.connect()
        except TimeoutError as e:
            err["e"] = e

    th = threading.Thread(target=connect)
    th.start()
    rx = Receiver(SyncConfig(**base, secret=WRONG.hex()), 1)
    th.join(30)
    try:
        assert "bad MAC" in str(err["e"]) and "same secret" in str(err["e"])
        summary = rx.receive(_NoLoader(), timeout_s=0.5)
        assert not summary["ok"] and "no control message" in summary["error"]
    finally:
        rx.close()
        client.close()


# ---------------------------------------------------------------- (b) HMAC: rogue senders

class _StandIn:
    """Data plane stand-in with gloo's policies: the tests here are about the control plane."""

    broken = ""
    digest_per_bucket = True
    canary_bytes = 8
    shares_buffers = False
    backend = "stand-in"
    export, mapped, keep_mapped = Transport.export, Transport.mapped, Transport.keep_mapped  # none
    hand_over, side_socket = Transport.hand_over, Transport.side_socket
    receive_buffers = Transport.receive_buffers  # memory of its own

    def __init__(self, cfg, rank, device=None):
        self.device = torch.device("cpu")

    def broadcast(self, tensor, src=0, *, length=None, to=None):
        tensor[:length].fill_(7)
        return self

    armed = staticmethod(lambda seconds, what: contextlib.nullcontext())

    def extend(self, seconds):
        pass

    def abort(self, reason):
        pass

    def wait(self):
        return True

    def close(self):
        pass


def _stand_in(monkeypatch) -> None:
    """Receivers made from here on get `_StandIn` as their data plane (through whichever of the
    plane's front doors the receiver module uses)."""
    for door in ("Transport", "open_transport"):
        if hasattr(receiver_mod, door):
            monkeypatch.setattr(receiver_mod, door, _StandIn)


class _NoLoader:
    def __init__(self):
        self.calls = []

    def begin(self):
        self.calls.append("begin")

    def load(self, named):
        self.calls.append([n for n, _ in named])
        return {n for n, _ in named}

    def finish(self):
        self.calls.append("finish")

    def abort(self):
        self.calls.append("abort")


def _update(version: int) -> list:
    """The frames of a one-bucket update of one small tensor, commit round included (what
    `_StandIn` broadcasts: the bytes 7, hence the checksum)."""
    (b,) = plan_buckets([("w", torch.ones(4))], 1024)
    digest = checksum(torch.full((b.length,), 7, dtype=torch.uint8))
    return [Plan(P, version, [], buckets=[b.header(version, 0, True, P)]), Go(P, version, 0),
            Digest(P, version, 0, digest), Seal(P, version, 1, [digest]), Commit(P, version, 1)]


def _seal(secret, sid, epoch, counter, rank, payload, direction=frames.TO_RECEIVER):
    tag = frames.build_tag(secret, direction, frames.FrameMeta(sid, epoch, counter, rank), payload)
    return [sid, tag, payload]


def test_receiver_rejects_a_sender_without_the_secret(monkeypatch):
    """A rogue on the trainer's address (receivers connect out): it sees the receiver's session
    id on the wire and sends a whole update under another secret; nothing is loaded."""
    _stand_in(monkeypatch)
    port = free_port()
    cfg = SyncConfig(control_port=port, group_port=free_port(), world_size=2, bucket_bytes=1024,
                     timeout_s=0.5, secret=SECRET.hex())
    rogue = zmq.Context.instance().socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.bind(f"tcp://127.0.0.1:{port}")
    rx = Receiver(cfg, 1)
    try:
        assert rogue.poll(5000)
        sid = rogue.recv_multipart()[0]  # the receiver's Hello: readable, not forgeable
        for counter, msg in enumerate(_update(1), 1):
            rogue.send_multipart(_seal(WRONG, sid, b"E" * 16, counter, 1, encode(msg)))
            rogue.send_multipart(_seal(None, sid, b"E" * 16, counter, 1, encode(msg)))
        loader = _NoLoader()
        summary = rx.receive(loader, timeout_s=0.5)
        assert not summary["ok"]
        assert "no control message from the sender" in summary["error"]
        assert "bad MAC" in summary["error"] and "same secret" in summary["error"]
        assert loader.calls == [] and rx.state.version == -1
        assert rx.channel.rejected == 2 * len(_update(1))
    finally:
        rx.close()
        rogue.close()


def test_receiver_with_the_wrong_secret_rejects_the_trainers_frames(monkeypatch):
    _stand_in(monkeypatch)
    port = free_port()
    base = dict(control_port=port, group_port=free_port(), world_size=2, bucket_bytes=1024,
                timeout_s=0.5)
    trainer = SenderChannel("127.0.0.1", port, SECRET)
    rx = Receiver(SyncConfig(**base, secret=WRONG.hex()), 1)
    try:
        with pytest.raises(TimeoutError, match="bad MAC"):
            trainer.recv(time.monotonic() + 1.0)  # its Hello is refused ...
        trainer._bind(1, rx.channel.session, 0, "test")  # ... route to it anyway
        for msg in _update(1):
            trainer.send(1, msg)
        loader = _NoLoader()
        summary = rx.receive(loader, timeout_s=0.5)
        assert not summary["ok"] and "bad MAC" in summary["error"], summary
        assert loader.calls == [] and rx.channel.rejections["bad MAC"] == len(_update(1))
    finally:
        rx.close()
        trainer.close()


# ---------------------------------------------------------------- (b) replay

class _Tap:
    """Wraps a socket's send_multipart to keep a copy of every frame list sent."""

    def __init__(self, sock):
        self.frames: list[list[bytes]] = []
        self._real = sock.send_multipart
        self.sock = sock

    def __call__(self, frames, *a, **kw):
        self.frames.append([bytes(f) for f in frames])
        return self._real(frames, *a, **kw)


def test_replayed_frames_are_dropped_by_the_receiver(monkeypatch):
    """Every frame of update 1, replayed verbatim in the middle of update 2, is dropped; update 2
    completes. Frames captured for another receiver's session are dropped as well."""
    _stand_in(monkeypatch)
    port = free_port()
    cfg = SyncConfig(control_port=port, group_port=free_port(), world_size=3, bucket_bytes=1024,
                     timeout_s=0.5, secret=SECRET.hex())
    trainer = SenderChannel("127.0.0.1", port, SECRET)
    tap = _Tap(trainer._sock)
    monkeypatch.setattr(trainer, "_sock", _Proxy(trainer._sock, send_multipart=tap))
    rx, other = Receiver(cfg, 1), Receiver(cfg, 2)
    try:
        wait_bound(trainer, rx.channel)
        wait_bound(trainer, other.channel)
        *frames1, commit1 = _update(1)
        for msg in frames1:
            trainer.send(1, msg)
            trainer.send(2, msg)
        assert _receive_then_commit(trainer, rx, commit1)["ok"]
        trainer.send(2, commit1)
        captured = [f for f in tap.frames if f[0] == rx.channel.session]
        for_other = [f for f in tap.frames if f[0] == other.channel.session]
        h2, *rest2 = _update(2)
        trainer.send(1, h2)
        for f in captured:  # the whole of update 1 again, between the plan and Go of update 2
            tap._real(f)
        for f in for_other:  # another session's frames, pushed into this receiver's connection
            tap._real([rx.channel.session, *f[1:]])
        *rest2, commit2 = rest2
        for msg in rest2:
            trainer.send(1, msg)
        summary = _receive_then_commit(trainer, rx, commit2)
        assert summary["ok"] and summary["version"] == 2, summary
        assert rx.channel.rejections["replayed"] == len(captured)
        assert rx.channel.rejections["wrong session"] == len(for_other)
    finally:
        rx.close()
        other.close()
        trainer.close()


def _receive_then_commit(trainer: SenderChannel, rx: Receiver, commit: Commit) -> dict:
    """`rx.receive` of the update queued so far; the trainer sends `commit` once rx's Ack has
    come (as a sender does: a Commit queued before the Ack is out of protocol)."""
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("r", rx.receive(_NoLoader(), timeout_s=5)))
    th.start()
    try:
        deadline = time.monotonic() + 10
        while not box:
            try:
                rank, msg = trainer.recv(min(deadline, time.monotonic() + 0.2))
            except TimeoutError:
                assert time.monotonic() < deadline, "no Ack, and receive() did not end"
                continue
            if rank == rx.rank and isinstance(msg, Ack):
                trainer.send(rank, commit)
                break
    finally:
        th.join(30)
    return box["r"]


class _Proxy:
    """A stand-in socket forwarding everything but the attributes given."""

    def __init__(self, sock, **override):
        self.__dict__.update(override, _sock=sock)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _until_dropped(trainer: SenderChannel, reason: str, send, timeout: float = 10.0) -> None:
    """Send (again, while a reconnect may be under way) until `trainer` drops one more frame for
    `reason`; it must accept none of them."""
    target = trainer.rejections[reason] + 1
    deadline = time.monotonic() + timeout
    while trainer.rejections[reason] < target:
        assert time.monotonic() < deadline, f"no frame dropped for {reason!r}"
        send()
        with pytest.raises(TimeoutError):
            trainer.recv(min(deadline, time.monotonic() + 0.3))


def _rebind(port: int) -> SenderChannel:
    """A new trainer on `port` once the closed one's listener is gone (closing is asynchronous)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return SenderChannel("127.0.0.1", port, SECRET)
        except zmq.ZMQError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_replayed_frames_are_dropped_by_the_trainer():
    port = free_port()
    trainer = SenderChannel("127.0.0.1", port, SECRET)
    rx = ReceiverChannel("127.0.0.1", port, 1, SECRET)
    tap = _Tap(rx._sock)
    rx._sock = _Proxy(rx._sock, send_multipart=tap)
    try:
        rx.send(HELLO)
        wait_bound(trainer, rx)
        trainer.send(1, Go(P, 1, 0))  # the receiver learns the epoch
        rx.recv(2.0)
        rx.send(Ready(P, 1, 0))
        assert trainer.recv(time.monotonic() + 2) == (1, Ready(P, 1, 0))
        hello, ready = tap.frames

        def rogue_with(identity: bytes) -> zmq.Socket:
            s = zmq.Context.instance().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, identity)
            s.connect(f"tcp://127.0.0.1:{port}")
            return s

        # From another connection: the routing id is not the frame's session.
        r1 = rogue_with(b"Sx" + bytes(14))
        _until_dropped(trainer, "session/routing id mismatch", lambda: r1.send_multipart(ready))
        # With the live session's id (seen on the wire): it takes the routing id over, but what
        # it can send are used counters.
        r2 = rogue_with(rx.session)
        _until_dropped(trainer, "replayed", lambda: r2.send_multipart(ready))
        r2.close()
        # The receiver gone: the same.
        rx.close()
        r3 = rogue_with(rx.session)
        _until_dropped(trainer, "replayed", lambda: r3.send_multipart(ready))
        _until_dropped(trainer, "replayed", lambda: r3.send_multipart(hello))
        # A new trainer instance (restarted on the same port) refuses frames bound to the old one;
        # the captured Hello itself is the documented limit (see channel.py): it binds, harmlessly.
        trainer.close()
        trainer2 = _rebind(port)
        _until_dropped(trainer2, "wrong trainer instance", lambda: r3.send_multipart(ready))
        r3.send_multipart(hello)
        rank, msg = trainer2.recv(time.monotonic() + 5)
        assert (rank, msg) == (1, HELLO)
        _until_dropped(trainer2, "wrong trainer instance", lambda: r3.send_multipart(ready))
        _until_dropped(trainer2, "replayed", lambda: r3.send_multipart(hello))
        for sock in (r1, r3):
            sock.close()
        trainer2.close()
    finally:
        rx.close()
        trainer.close()


def test_rank_is_bound_to_the_session():
    """An authenticated receiver's message naming another rank than its session is dropped."""
    port = free_port()
    trainer = SenderChannel("127.0.0.1", port, SECRET)
    rx = ReceiverChannel("127.0.0.1", port, 1, SECRET)
    try:
        rx.send(HELLO)
        wait_bound(trainer, rx)
        rx.send(Ready(P, 2, 0))
        rx.send(Ack(P, 2, 1, 1, 0, 0, 0.0))
        with pytest.raises(TimeoutError, match="rank mismatch"):
            trainer.recv(time.monotonic() + 1)
        assert trainer.rejections["rank mismatch"] == 2
    finally:
        rx.close()
        trainer.close()


# ---------------------------------------------------------------- (c) bind address

def _non_loopback_ipv4() -> list[str]:
    out = []
    for _, name in socket.if_nameindex():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            ip = socket.inet_ntoa(packed[20:24])  # SIOCGIFADDR
        except OSError:
            continue
        finally:
            s.close()
        if not ip.startswith("127."):
            out.append(ip)
    return out


def _reachable(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        try:
            s.connect((ip, port))
            return True
        except OSError as e:
            assert isinstance(e, ConnectionRefusedError) or e.errno in (errno.ECONNREFUSED,), e
            return False


def test_trainer_binds_only_the_configured_address():
    port = free_port()
    client = PushClient(SyncConfig(control_port=port, group_port=free_port(), world_size=2))
    try:
        assert client.channel.endpoint == f"tcp://127.0.0.1:{port}"
        assert client.channel._sock.getsockopt_string(zmq.LAST_ENDPOINT) == client.channel.endpoint
        assert _reachable("127.0.0.1", port)
        others = _non_loopback_ipv4()
        if not others:
            pytest.skip("this machine has no non-loopback IPv4 address to probe")
        for ip in others:
            assert not _reachable(ip, port), f"control port reachable on {ip}"
    finally:
        client.close()


def test_group_rendezvous_binds_only_the_configured_address():
    others = _non_loopback_ipv4()
    if not others:
        pytest.skip("this machine has no non-loopback IPv4 address to probe")
    cfg = SyncConfig(control_port=free_port(), group_port=free_port(), world_size=2, timeout_s=10)
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault(0, open_transport(cfg, 0)))
    th.start()
    box[1] = open_transport(cfg, 1)
    th.join(30)
    try:
        for ip in others:
            assert not _reachable(ip, cfg.group_port), f"group rendezvous reachable on {ip}"
    finally:
        box[0].close()
        box[1].close()


# ---------------------------------------------------------------- (d) bounded sizes

def test_oversized_frames_are_dropped_before_hashing_and_the_socket_lives(monkeypatch):
    port = free_port()
    trainer = SenderChannel("127.0.0.1", port, SECRET)
    rx = ReceiverChannel("127.0.0.1", port, 1, SECRET)
    try:
        rx.send(HELLO)
        wait_bound(trainer, rx)
        work = {"mac": 0, "decode": 0}
        real_mac, real_decode = frames.mac, channel.decode

        def counting(name, fn):
            def wrapped(*a):
                work[name] += 1
                return fn(*a)
            return wrapped

        monkeypatch.setattr(frames, "mac", counting("mac", real_mac))
        monkeypatch.setattr(channel, "decode", counting("decode", real_decode))
        # Over MAX_FRAME_BYTES but under ZeroMQ's MAXMSGSIZE: reaches the channel, which drops it
        # before any hashing or decoding.
        big = b"\x00" * (MAX_FRAME_BYTES + 1)
        rx._sock.send_multipart([b"t" * 77, big])
        with pytest.raises(TimeoutError, match="oversized"):
            trainer.recv(time.monotonic() + 3)
        assert work == {"mac": 0, "decode": 0} and trainer.rejections["oversized"] == 1
        rx.send(Ready(P, 1, 0))  # the same connection goes on working
        assert trainer.recv(time.monotonic() + 3) == (1, Ready(P, 1, 0))
        # Over MAXMSGSIZE: ZeroMQ drops that connection (never the socket); the peer reconnects.
        rx._sock.send_multipart([b"t" * 77, b"\x00" * (MAX_FRAME_BYTES + 1024)])
        deadline = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < deadline:
            rx.send(Ready(P, 1, 1))
            try:
                got = trainer.recv(time.monotonic() + 0.3)
            except TimeoutError:
                pass
        assert got == (1, Ready(P, 1, 1))
        # And the other way round.
        trainer._sock.send_multipart([rx.session, b"t" * 77, big])
        trainer.send(1, Go(P, 1, 0))
        assert rx.recv(3.0) == Go(P, 1, 0)
        assert rx.rejections["oversized"] == 1
    finally:
        rx.close()
        trainer.close()


def test_never_sends_a_frame_the_peer_would_drop():
    huge = "x" * (MAX_FRAME_BYTES + 10)
    payload = frames.encode_payload(Error(P, 1, 0, huge, huge))  # an error report is cut to size
    assert len(payload) <= MAX_FRAME_BYTES
    slots = [Slot(f"t{i}" * 50, "float32", [1], 64 * i, 4) for i in range(100_000)]
    with pytest.raises(ProtocolError, match="over"):
        frames.encode_payload(BucketHeader(P, 1, 0, 0, True, slots))


# ---------------------------------------------------------------- optional CURVE

@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_mode_encrypts_and_keeps_out_peers_without_the_secret():
    port = free_port()
    trainer = SenderChannel("127.0.0.1", port, SECRET, curve=True)
    rx = ReceiverChannel("127.0.0.1", port, 1, SECRET, curve=True)
    wrong = ReceiverChannel("127.0.0.1", port, 2, WRONG, curve=True)
    plain = ReceiverChannel("127.0.0.1", port, 3, SECRET, curve=False)
    try:
        for r in (rx, wrong, plain):
            r.send(Hello(P, r.rank, 0, 0, 1, 1024, "gloo"))
        assert trainer.recv(time.monotonic() + 5) == (1, Hello(P, 1, 0, 0, 1, 1024, "gloo"))
        trainer.send(1, Go(P, 1, 0))
        assert rx.recv(5.0) == Go(P, 1, 0)
        with pytest.raises(TimeoutError):
            trainer.recv(time.monotonic() + 1)
        assert trainer.rejected == 0  # the others never got past the CURVE handshake
        with pytest.raises(ValueError, match="secret"):
            SenderChannel("127.0.0.1", free_port(), None, curve=True)
    finally:
        for s in (rx, wrong, plain, trainer):
            s.close()


def test_without_a_secret_sessions_still_work():
    """No secret (the default): frames carry no MAC, sessions and counters still apply."""
    port = free_port()
    trainer = SenderChannel("127.0.0.1", port)
    rx = ReceiverChannel("127.0.0.1", port, 1)
    try:
        rx.send(HELLO)
        wait_bound(trainer, rx)
        trainer.send(1, Go(P, 1, 0))
        assert rx.recv(2.0) == Go(P, 1, 0)
        tag = frames.encode_payload(HELLO)
        rx._sock.send_multipart([frames.META.pack(1, rx.session, bytes(16), 0, 1), tag])
        with pytest.raises(TimeoutError, match="replayed"):  # counter 0 again
            trainer.recv(time.monotonic() + 0.5)
    finally:
        rx.close()
        trainer.close()
