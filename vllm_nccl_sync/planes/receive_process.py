"""A receiver's gloo group in a process of its own (`SyncConfig.receive_process`).

The worker keeps its two bucket buffers in memory it shares with a child process
(`python -m vllm_nccl_sync.planes.receive_process`, one per worker), and the child alone is a
rank of the trainer's gloo group: each `broadcast` the worker posts becomes a request to the
child, which receives the bytes straight into the shared buffer and answers once they are there.
The worker checks and loads them as before (canary, checksum, `Digest`); nothing else changes.

What it buys:
- a sender that broadcasts more than the receiver's whole buffer aborts the child inside gloo
  (`EnforceNotMet`), not the engine: the worker's wait ends at once with the child's exit named,
  the update fails with nothing of that bucket loaded, and the next join starts a new child;
- the engine's threads never hand Python's lock to a receive thread (gloo's waits run in the
  child): `benchmarks/receive_thread.py` measured what a receive thread costs a stepping thread;
- an `abort` ends a pending receive at once (the child is killed), which plain gloo cannot do.

The child dies with the worker: it exits when its socket to the worker closes. Every wait on it
is bounded (`timeout_s`, plus `GRACE_S` for the child to report gloo's own timeout).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from typing import Any

import msgspec
import torch

from vllm_nccl_sync.outcomes import PeerFailed
from vllm_nccl_sync.planes.base import Handle
from vllm_nccl_sync.planes.gloo import GlooTransport
from vllm_nccl_sync.wire.config import SyncConfig

GRACE_S = 30.0
"""Time the worker gives the child beyond `timeout_s` to answer (start-up, gloo's own timeout)."""
_MSG_BYTES = 1 << 16
"""Largest message between the worker and its child (a config, a request, an error text)."""


def _send(sock: socket.socket, msg: list[Any], fds: list[int] | None = None) -> None:
    socket.send_fds(sock, [msgspec.msgpack.encode(msg)], fds or [])


def _recv(sock: socket.socket) -> tuple[list[Any] | None, list[int]]:
    """The next message and the descriptors it carried; None once the other end is gone."""
    data, fds, _, _ = socket.recv_fds(sock, _MSG_BYTES, 4)
    return (msgspec.msgpack.decode(data) if data else None), fds


class _Child:
    """The worker's end of its receive process: the process, its socket, its answers."""

    def __init__(self, cfg: SyncConfig, rank: int) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_nccl_sync.planes.receive_process", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        self.sock = mine
        self.done: dict[int, str] = {}
        """Answers taken but not yet asked for: request id -> error text ("" when received)."""
        self.lock = threading.Lock()  # one request at a time on the socket

    def request(self, msg: list[Any], fds: list[int] | None = None) -> None:
        """Send the child `msg` (`TimeoutError` if its socket stays full for `GRACE_S`)."""
        with self.lock:
            self.sock.settimeout(GRACE_S)
            _send(self.sock, msg, fds)

    def answer(self, key: int, timeout_s: float, what: str) -> str:
        """The child's answer to request `key` (its error text, "" if none) within `timeout_s`;
        `RuntimeError` naming how the child ended if it did, `TimeoutError` if it said nothing."""
        deadline = time.monotonic() + timeout_s
        while key not in self.done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the receive process (pid {self.proc.pid}) did not answer "
                                   f"{what} within {timeout_s:.1f} s")
            self.sock.settimeout(left)
            try:
                msg, _ = _recv(self.sock)
            except TimeoutError:
                continue
            except OSError:
                msg = None
            if msg is None:
                raise RuntimeError(f"the receive process ended during {what}: {self.ended()}")
            self.done[msg[0]] = msg[1]
        return self.done.pop(key)

    def ended(self) -> str:
        """How the child ended, in words (waits up to 5 s for its exit status)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)
        code = self.proc.returncode
        if code is None:
            return f"pid {self.proc.pid} closed its socket but has not exited"
        if code < 0:
            name = signal.Signals(-code).name
            hint = (" (gloo aborts on a broadcast longer than the posted buffer: a sender sent "
                    "more than this receiver's bucket holds)" if name == "SIGABRT" else "")
            return f"pid {self.proc.pid} was ended by {name}{hint}"
        return f"pid {self.proc.pid} exited with status {code}"

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    def close(self) -> None:
        """Ask the child to leave its group; kill it if it has not exited within 5 s."""
        with contextlib.suppress(OSError):
            self.request([-1, "close"])
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait(5.0)
        self.sock.close()


def _cuda_register(t: torch.Tensor) -> None:
    """Page-lock host tensor `t` for CUDA (copies out of it are then DMA transfers)."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of a receive buffer failed ({err})")


class _Received:
    """A receive posted to the child: `wait` returns once the bytes are in the shared buffer."""

    def __init__(self, transport: ProcessTransport, key: int, src: int) -> None:
        self._transport, self._key, self._src = transport, key, src

    def wait(self) -> bool:
        t = self._transport
        try:
            err = t.pg.answer(self._key, t.timeout_s + GRACE_S, f"receive {self._key}")
        except (RuntimeError, TimeoutError) as e:
            if t.broken:
                raise RuntimeError(f"transfer group aborted: {t.broken}") from None
            t.abort(str(e))
            raise RuntimeError(str(e)) from None
        if err:
            raise PeerFailed(err, self._src)
        return True


class ProcessTransport(GlooTransport):
    """A gloo receiver whose group lives in a child process (see the module docstring). Its
    receives land in `receive_buffers`, which the ReceivePlane must use."""

    def _join(self, cfg: SyncConfig) -> Any:
        if self.rank == 0:
            raise ValueError("receive_process is a receiver's: the sender joins gloo itself")
        self.timeout_s = cfg.timeout_s
        """How long one receive may take (the group's own timeout; the child's answer gets
        `GRACE_S` more)."""
        self._keys = 0
        self._buffers: list[tuple[int, int, int]] = []
        """(id, address, bytes) of each buffer the child maps."""
        self._pinned: list[torch.Tensor] = []
        child = _Child(cfg, self.rank)
        try:
            child.request([0, "join", cfg.to_dict(), self.rank])
            err = child.answer(0, 2 * cfg.timeout_s + GRACE_S, "the join of its gloo group")
        except BaseException:
            child.kill()
            child.close()
            raise
        if err:
            child.close()
            raise RuntimeError(f"the receive process could not join the gloo group: {err}")
        return child

    def receive_buffers(self, count: int, nbytes: int, pin: bool = False) -> list[torch.Tensor]:
        """`count` buffers of `nbytes` in memory shared with the child (which maps each);
        `pin`: registered with CUDA as page-locked (unregistered at `close`)."""
        out = []
        for _ in range(count):
            fd = os.memfd_create("vllm_nccl_sync-bucket", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, nbytes)
                mem = mmap.mmap(fd, nbytes)
                key = self._next()
                self.pg.request([key, "buffer", nbytes], [fd])
            finally:
                os.close(fd)
            self._answered(key, "a buffer's mapping")
            t = torch.frombuffer(mem, dtype=torch.uint8)
            self._buffers.append((key, t.data_ptr(), nbytes))
            if pin:
                _cuda_register(t)
                self._pinned.append(t)
            out.append(t)
        return out

    def _next(self) -> int:
        self._keys += 1
        return self._keys

    def _answered(self, key: int, what: str) -> None:
        err = self.pg.answer(key, GRACE_S, what)
        if err:
            raise RuntimeError(f"the receive process refused {what}: {err}")

    def _post(self, tensor: torch.Tensor, src: int, to: Collection[int] | None) -> Handle:
        ptr, n = tensor.data_ptr(), tensor.numel()
        where = next(((key, ptr - a) for key, a, size in self._buffers
                      if a <= ptr and ptr + n <= a + size), None)
        if where is None:
            raise ValueError("a receive process fills its receive_buffers() only")
        key = self._next()
        self.pg.request([key, "recv", where[0], where[1], n, src, None if to is None else list(to)])
        return _Received(self, key, src)

    def _abort_group(self, pg: Any) -> None:
        """Kill the child: its pending receives end at once (the worker's waits see it)."""
        pg.kill()

    def _release(self) -> None:
        self.pg.close()
        for t in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self._pinned = []

    @property
    def child_pid(self) -> int:
        """The receive process's pid."""
        return self.pg.proc.pid


# ------------------------------------------------------------------------- the child's side

class _Answers:
    """The child's answers: at once for a request done at once, in order of posting for
    receives (a thread waits for each in turn)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.posted: queue.Queue[tuple[int, Handle] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, key: int, got: Handle | str) -> None:
        if isinstance(got, str):
            self.say(key, got)
        else:
            self.posted.put((key, got))

    def say(self, key: int, err: str) -> None:
        with self.lock, contextlib.suppress(OSError):
            _send(self.sock, [key, err])

    def _run(self) -> None:
        while (item := self.posted.get()) is not None:
            key, handle = item
            try:
                handle.wait()
                err = ""
            except Exception as e:  # noqa: BLE001 - said to the worker, which raises it
                err = str(e)
            self.say(key, err)

    def close(self, timeout_s: float) -> None:
        self.posted.put(None)
        self.thread.join(timeout_s)


def _serve(sock: socket.socket) -> None:
    """The child: join the group, then post each requested receive into the shared buffer it
    names, answering each once it completes, until told to close; if the worker is gone, exit
    at once (nobody is left to answer)."""
    msg, _ = _recv(sock)
    if msg is None:
        return
    key, _, raw, rank = msg
    torch.set_num_threads(1)
    try:
        cfg = SyncConfig.from_dict(raw)
        transport = GlooTransport(cfg, rank)
    except Exception as e:  # noqa: BLE001 - said to the worker, which raises it
        _send(sock, [key, f"{type(e).__name__}: {e}"])
        return
    _send(sock, [key, ""])
    answers = _Answers(sock)
    buffers: dict[int, torch.Tensor] = {}
    while True:
        msg, fds = _recv(sock)
        if msg is None:
            os._exit(0)
        if msg[1] == "close":
            break
        answers.put(msg[0], _take(msg, fds, transport, buffers))
    answers.close(cfg.timeout_s + GRACE_S)
    transport.close()


def _take(msg: list[Any], fds: list[int], transport: GlooTransport,
          buffers: dict[int, torch.Tensor]) -> Handle | str:
    """One request: a buffer mapped ("": done), or a receive posted (its handle); the error's
    text if it cannot be done."""
    key, kind, *args = msg
    try:
        if kind == "buffer":
            [nbytes], [fd] = args, fds
            buffers[key] = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
            os.close(fd)
            return ""
        buf, offset, n, src, to = args
        return transport.broadcast(buffers[buf][offset : offset + n], src, to=to)
    except Exception as e:  # noqa: BLE001 - said to the worker, which raises it
        return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
