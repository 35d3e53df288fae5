"""A receiver's gloo group in a process of its own (`SyncConfig.receive_process`): its lifetime.

Real processes and a real gloo group. The updates through it, and what a hostile sender or a
killed receive process does to one, are in `test_gloo_multiproc.py` and `test_hostile_peers.py`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from tests.conftest import free_port
from tests.unit.test_planes import _ranks
from vllm_nccl_sync import SyncConfig
from vllm_nccl_sync.planes.registry import open_transport

pytestmark = pytest.mark.multiproc
TIMEOUT = 60.0
"""The group's `timeout_s`: every bound below is far inside it, so nothing here waits it out."""


def _cfg() -> SyncConfig:
    return SyncConfig(control_port=free_port(), group_port=free_port(), world_size=2,
                      bucket_bytes=4096, timeout_s=TIMEOUT, receive_process=True)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _await(cond, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_receive_process_takes_gloo_and_one_sender_only():
    for kw in ({"backend": "nccl"}, {"backend": "shm"},
               {"senders": [("127.0.0.1", free_port())], "world_size": 3}):
        with pytest.raises(ValueError, match="receive_process takes the gloo plane and one"):
            SyncConfig(**{**dict(control_port=free_port(), group_port=free_port(),
                                 world_size=2, receive_process=True), **kw})


def test_bytes_land_in_shared_buffers_and_abort_ends_a_pending_receive():
    """A receive lands in the worker's shared buffer, in another process; a receive nobody
    sends ends as soon as the transport is aborted (plain gloo would wait out `timeout_s`), the
    receive process is gone, and the transport is broken (the next join starts a new one)."""
    cfg = _cfg()
    tx, rx = _ranks(cfg)  # the receiver's through its receive process
    try:
        assert rx.child_pid != os.getpid() and not _gone(rx.child_pid)
        [buf] = rx.receive_buffers(1, 4096)
        data = torch.randint(0, 256, (1000,), dtype=torch.uint8)
        sent = tx.broadcast(data)
        assert rx.broadcast(buf[:1000]).wait() and sent.wait()
        assert torch.equal(buf[:1000], data) and not buf[1000:].any()
        pending = rx.broadcast(buf[:1000])
        child = rx.child_pid
        t0 = time.monotonic()
        rx.abort("the test gives the update up")
        with pytest.raises(RuntimeError, match="transfer group aborted: the test gives"):
            pending.wait()
        assert time.monotonic() - t0 < TIMEOUT / 2
        _await(lambda: _gone(child), 10, "the killed receive process is still there")
        assert rx.broken and "the test gives" in rx.broken
        with pytest.raises(RuntimeError, match="broken"):
            rx.broadcast(buf[:10])
    finally:
        rx.close()
        tx.close()


def _worker(cfg: SyncConfig, pids) -> None:
    rx = open_transport(cfg, 1)
    pids.put(rx.child_pid)
    threading.Event().wait()  # until killed


def test_the_receive_process_exits_with_its_worker():
    """A worker SIGKILLed (no chance to close anything): its receive process exits too."""
    cfg = _cfg()
    ctx = mp.get_context("spawn")
    pids = ctx.Queue()
    worker = ctx.Process(target=_worker, args=(cfg, pids), daemon=True)
    worker.start()
    tx = open_transport(cfg, 0)
    try:
        child = pids.get(timeout=2 * TIMEOUT)
        assert not _gone(child)
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(TIMEOUT)
        _await(lambda: _gone(child), 30, "the receive process outlived its worker")
    finally:
        if worker.is_alive():
            worker.kill()
        tx.close()
