"""How a same-host plane's memory reaches its receivers: over a Unix socket, from a peer the
kernel names.

The sender listens on an abstract Unix socket (a random name, no file); the name travels in the
group's rendezvous store (`Join`, authenticated with the config's secret when there is one).
Each receiver connects, and from then on each side knows who the other is from the kernel
(`SO_PEERCRED`: pid, uid), never from what the peer says about itself. The sender accepts a
receiver of its own user or root (who could open its memory anyway) that proves it knows the
secret, if one is configured. Memory travels as open file descriptors (`SCM_RIGHTS`): a receiver
never opens anything by a name or path a peer gave it, so it cannot be made to read what the
peer itself could not hand over, and each descriptor is checked after it arrived (`checked_fd`:
a regular file in shared memory, owned by the sender's user, of the size announced). CUDA IPC
handles (`ipc`) travel the same way, as bytes, so they too come only from the peer that joined.

Every socket operation has the config's timeout. Messages are msgspec structs, one per packet
(`SOCK_SEQPACKET` keeps their boundaries); descriptors that arrive with anything but the message
that announces them are closed. Memory goes many segments to a packet (up to the kernel's 253
descriptors), and a receiver takes packets whenever it waits for the trainer's next message
(`Link.take`, served by its control channel): a push exporting thousands of storages never
fills the socket's buffer while its receivers wait for the plan.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import socket
import stat
import struct
import time
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from vllm_nccl_sync.wire.frames import MAC_BYTES, mac, mac_matches

log = logging.getLogger(__name__)

_TMPFS_MAGIC = 0x01021994
"""`statfs.f_type` of shared memory (tmpfs: `/dev/shm`, `memfd_create`)."""
NAME_PREFIX = b"\0vllm_nccl_sync-"
"""Every handoff socket's abstract name starts with this; a receiver refuses any other."""
_MAX_MESSAGE = 1 << 16
_MAX_FDS = 253
"""The most descriptors one packet carries (the kernel's `SCM_MAX_FD`)."""
_FORGET = 4096
"""Segments per `Forget` packet (each well within `_MAX_MESSAGE`)."""
_JOIN, _HELLO = b"handoff join", b"handoff hello"
"""MAC directions (`wire.frames.mac`) of the join record and a receiver's answer."""


class Creds(NamedTuple):
    """A connected peer as the kernel reports it (`SO_PEERCRED`)."""

    pid: int
    uid: int
    gid: int


class Challenge(msgspec.Struct, tag=True, frozen=True):
    """Sender to a receiver that connected: a nonce to prove the secret on."""

    nonce: bytes


class Hello(msgspec.Struct, tag=True, frozen=True):
    """Receiver to sender: its rank, and (with a secret) the MAC of the nonce and rank."""

    rank: int
    proof: bytes


class Segment(msgspec.Struct, array_like=True, frozen=True):
    """One piece of memory to map. `segment` -1 is the group's own (control block and bucket
    buffers); others are storages to read in place. `handle` is the plane's (msgpack bytes);
    `fds` how many of its packet's descriptors are this segment's (in order)."""

    segment: int
    handle: bytes
    fds: int


class Memory(msgspec.Struct, tag=True, frozen=True):
    """Sender to receiver: memory to map, its descriptors with this packet."""

    segments: list[Segment]

    @property
    def fds(self) -> int:
        return sum(s.fds for s in self.segments)


class Forget(msgspec.Struct, tag=True, frozen=True):
    """Sender to receiver: these segments' storages died; no plan names them again."""

    segments: list[int]


class Attached(msgspec.Struct, tag=True, frozen=True):
    """Receiver to sender: it mapped the group's memory."""

    rank: int


Packet = Challenge | Hello | Memory | Forget | Attached
_decoder = msgspec.msgpack.Decoder(Packet)


class Join(msgspec.Struct, frozen=True):
    """What the sender publishes in the store: where to connect, and what it agreed to."""

    magic: int
    socket: bytes
    bucket_bytes: int


def seal_join(join: Join, secret: bytes | None) -> bytes:
    """`join` as the store holds it: msgpack, then its MAC (none without a secret)."""
    body = msgspec.msgpack.encode(join)
    return body + mac(secret, _JOIN, b"", body)


def open_join(raw: bytes, secret: bytes | None) -> Join:
    """The `Join` in `raw`; `ValueError` if its MAC does not verify (or it does not decode)."""
    n = MAC_BYTES if secret else 0
    body, tag = raw[: len(raw) - n], raw[len(raw) - n :]
    if not mac_matches(secret, _JOIN, b"", body, tag):
        raise ValueError("the sender's join record in the rendezvous store does not carry this "
                         "config's secret: refused")
    try:
        return msgspec.msgpack.decode(body, type=Join)
    except msgspec.DecodeError as e:
        raise ValueError(f"the sender's join record does not decode: {e}") from None


def _rank(rank: int) -> bytes:
    return rank.to_bytes(8, "little")


def creds(sock: socket.socket) -> Creds:
    """Who is at the other end of `sock`, as the kernel says."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return Creds(*struct.unpack("3i", raw))


def _fs_type(fd: int) -> int:
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on x86_64 and arm64
    if ctypes.CDLL(None, use_errno=True).fstatfs(fd, buf) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return struct.unpack_from("l", buf)[0]


def checked_fd(fd: int, nbytes: int, owner: int, what: str) -> None:
    """`ValueError` naming `what` unless descriptor `fd` is a regular file in shared memory,
    owned by user `owner`, holding exactly `nbytes` bytes (and not none)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or _fs_type(fd) != _TMPFS_MAGIC:
        raise ValueError(f"{what} is not shared memory: refused")
    if st.st_uid != owner:
        raise ValueError(f"{what} belongs to another user than the sender: refused")
    if st.st_size != nbytes or nbytes == 0:
        raise ValueError(f"{what} holds {st.st_size} bytes, announced {nbytes}: refused")


def new_memory(nbytes: int) -> int:
    """A descriptor of `nbytes` of new shared memory, zeroed, with no name anywhere."""
    fd = os.memfd_create("vllm_nccl_sync", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd


class _Socket:
    """One connected handoff socket: packets with their descriptors, every call bounded."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        sock.settimeout(timeout_s)
        self.sock = sock
        self.timeout_s = timeout_s
        self.peer = creds(sock)

    def send(self, packet: Packet, fds: Sequence[int] = ()) -> None:
        socket.send_fds(self.sock, [msgspec.msgpack.encode(packet)], list(fds))

    def recv(self) -> tuple[Packet, list[int]]:
        """The next packet and its descriptors; `ValueError` for one that does not decode or
        carries descriptors it does not announce (they are closed), `ConnectionError` at EOF."""
        data, fds, flags, _ = socket.recv_fds(self.sock, _MAX_MESSAGE, _MAX_FDS)
        try:
            if not data:
                raise ConnectionError("the peer closed the handoff socket")
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ValueError("a handoff packet longer than allowed")
            packet = _decoder.decode(data)
            if isinstance(packet, Memory) and min((s.fds for s in packet.segments), default=0) < 0:
                raise ValueError("a Memory packet announces a negative number of descriptors")
            if len(fds) != (packet.fds if isinstance(packet, Memory) else 0):
                raise ValueError(f"a {type(packet).__name__} packet came with {len(fds)} "
                                 "descriptors it does not announce")
        except (ValueError, msgspec.DecodeError) as e:
            _close(fds)
            raise ValueError(f"handoff: {e}") from None
        except BaseException:
            _close(fds)
            raise
        return packet, fds

    def close(self) -> None:
        self.sock.close()


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class Hub:
    """The sender's end: a listening socket, then one connected socket per receiver rank."""

    def __init__(self, secret: bytes | None, timeout_s: float) -> None:
        self.secret = secret
        self.timeout_s = timeout_s
        self.name = NAME_PREFIX + secrets.token_hex(12).encode()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(self.name)
        self._listener.listen(64)
        self.links: dict[int, _Socket] = {}
        self.gone: dict[int, str] = {}
        """Receivers whose socket failed, and why (they refuse plans naming later segments)."""

    def accept(self, ranks: range) -> None:
        """Accept one receiver of each rank in `ranks` within the timeout; a connection that
        fails the checks (user, secret, rank) is closed and does not count. `TimeoutError`
        naming the ranks missing."""
        deadline = time.monotonic() + self.timeout_s
        while any(r not in self.links for r in ranks):
            self._listener.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                missing = [r for r in ranks if r not in self.links]
                raise TimeoutError(f"shared plane: ranks {missing} did not join within "
                                   f"{self.timeout_s:.1f} s") from None
            link = _Socket(conn, min(self.timeout_s, max(deadline - time.monotonic(), 1e-3)))
            try:
                rank = self._admit(link, ranks)
            except (ValueError, OSError) as e:
                log.warning("shared plane: refused a connection from pid %d: %s",
                            link.peer.pid, e)
                link.close()
                continue
            link.sock.settimeout(self.timeout_s)
            link.timeout_s = self.timeout_s
            self.links[rank] = link

    def _admit(self, link: _Socket, ranks: range) -> int:
        """The rank a connecting receiver takes: of this user or root (the kernel's word), a
        rank still to join, proving the secret on a fresh nonce; `ValueError` otherwise."""
        if link.peer.uid not in (os.getuid(), 0):
            raise ValueError(f"uid {link.peer.uid} is neither the sender's nor root")
        nonce = os.urandom(16)
        link.send(Challenge(nonce))
        hello, _ = link.recv()
        if not isinstance(hello, Hello) or hello.rank not in ranks or hello.rank in self.links:
            raise ValueError(f"not the Hello of a rank still to join: {hello!r:.80}")
        if not mac_matches(self.secret, _HELLO, nonce, _rank(hello.rank), hello.proof):
            raise ValueError(f"rank {hello.rank} does not prove this config's secret")
        return hello.rank

    def send(self, rank: int, packet: Packet, fds: Sequence[int] = ()) -> None:
        """Send to one receiver; a failure marks it `gone` (never raises)."""
        link = self.links.get(rank)
        if link is None or rank in self.gone:
            return
        try:
            link.send(packet, fds)
        except OSError as e:
            self.gone[rank] = f"its handoff socket failed ({e})"

    def publish(self, packet: Packet, fds: Sequence[int] = ()) -> None:
        """Send to every receiver."""
        for rank in self.links:
            self.send(rank, packet, fds)

    def forget(self, segments: list[int]) -> None:
        """Tell every receiver these segments' storages died, `_FORGET` to a packet."""
        for i in range(0, len(segments), _FORGET):
            self.publish(Forget(segments[i : i + _FORGET]))

    def hand_over(self, memory: list[tuple[int, bytes, list[int]]]) -> None:
        """Send every receiver `memory` (segment, handle, descriptors), as few packets as the
        kernel's bounds allow; a receiver whose socket fails is marked `gone`."""
        packet: list[Segment] = []
        fds: list[int] = []
        size = 0
        for segment, handle, its in memory:
            if packet and (len(fds) + len(its) > _MAX_FDS
                           or size + len(handle) + 32 > _MAX_MESSAGE // 2):
                self.publish(Memory(packet), fds)
                packet, fds, size = [], [], 0
            packet.append(Segment(segment, handle, len(its)))
            fds += its
            size += len(handle) + 32
        if packet:
            self.publish(Memory(packet), fds)

    def attached(self) -> None:
        """Wait (bounded) until every receiver said it mapped the group's memory."""
        for rank, link in self.links.items():
            msg, _ = link.recv()
            if msg != Attached(rank):
                raise ValueError(f"shared plane: rank {rank} answered {msg!r:.80}, not Attached")

    def close(self) -> None:
        self._listener.close()
        for link in self.links.values():
            link.close()


class Link:
    """A receiver's end: connected to the sender whose `Join` named the socket. Keeps the
    memory it announced (`Memory`) until it is forgotten or the link closes."""

    def __init__(self, join: Join, rank: int, secret: bytes | None, timeout_s: float) -> None:
        if not join.socket.startswith(NAME_PREFIX) or len(join.socket) > 64:
            raise ValueError("the sender's join record names a socket that is not this "
                             "package's: refused")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(timeout_s)
        try:
            sock.connect(join.socket)
        except OSError as e:
            sock.close()
            raise ValueError(f"cannot reach the sender's handoff socket: {e.strerror or e}") from None
        self._sock = _Socket(sock, timeout_s)
        self.sender = self._sock.peer
        """The sender's process and user, from the kernel."""
        self.announced: dict[int, tuple[bytes, list[int]]] = {}
        self.failed = ""
        try:
            challenge, _ = self._sock.recv()
            if not isinstance(challenge, Challenge):
                raise ValueError("the sender did not open with a Challenge")
            proof = mac(secret, _HELLO, challenge.nonce, _rank(rank))
            self._sock.send(Hello(rank, proof))
        except BaseException:
            self.close()
            raise

    def group_memory(self) -> tuple[bytes, list[int]]:
        """The group's own memory (the first `Memory` the sender sends): handle, descriptors."""
        self._take(block=True)
        got = self.announced.pop(-1, None)
        if got is None:
            raise ValueError("the sender did not hand over the group's memory first")
        return got

    def fileno(self) -> int:
        return self._sock.sock.fileno()

    def take(self) -> bool:
        """Take the packets waiting, without blocking; False once the socket failed (closed,
        or a packet refused: `failed` says why, and no segment is announced after it)."""
        if not self.failed:
            try:
                self._take(block=False)
            except (ValueError, OSError) as e:
                self.failed = str(e)
        return not self.failed

    def attached(self, rank: int) -> None:
        self._sock.send(Attached(rank))

    def segment(self, n: int) -> tuple[bytes, list[int]]:
        """Segment `n` as the sender announced it (everything it sent so far is taken first:
        a plan comes after the memory it names); `ValueError` if it never announced it."""
        if not self.take():
            raise ValueError(f"the sender's handoff socket failed: {self.failed}")
        got = self.announced.get(n)
        if got is None:
            raise ValueError(f"memory segment {n} was never exported by the sender")
        return got

    def _take(self, block: bool) -> None:
        """Take the packets waiting (at least one if `block`, within the timeout)."""
        sock = self._sock.sock
        try:
            while True:
                sock.settimeout(self._sock.timeout_s if block else 0.0)
                try:
                    packet, fds = self._sock.recv()
                except BlockingIOError:
                    return
                block = False
                self._keep(packet, fds)
        finally:
            sock.settimeout(self._sock.timeout_s)

    def _keep(self, packet: Packet, fds: list[int]) -> None:
        if isinstance(packet, Memory):
            for s in packet.segments:
                its, fds = fds[: s.fds], fds[s.fds :]
                if s.segment in self.announced:  # the first handle given stays
                    _close(its)
                else:
                    self.announced[s.segment] = (s.handle, its)
        elif isinstance(packet, Forget):
            for s in packet.segments:
                _close(self.announced.pop(s, (b"", []))[1])
        else:
            _close(fds)
            raise ValueError(f"handoff: unexpected {type(packet).__name__} from the sender")

    def close(self) -> None:
        for _, fds in self.announced.values():
            _close(fds)
        self.announced.clear()
        self._sock.close()
