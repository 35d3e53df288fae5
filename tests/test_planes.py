"""The data planes behind one interface: found by name, each stating its policies and what a peer
can do to it; the gloo plane end to end in one process (ranks in threads, 127.0.0.1)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.conftest import free_port
from vllm_nccl_sync.planes import base
from vllm_nccl_sync.planes.base import Transport, open_transport, plane, register
from vllm_nccl_sync.wire.config import BACKENDS, SyncConfig


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_the_config_accepts_has_a_plane_stating_its_policies(name):
    cls = plane(name)
    assert issubclass(cls, Transport) and cls.backend == name
    assert isinstance(cls.digest_per_bucket, bool) and cls.canary_bytes >= 0
    assert "peer" in cls.peer_harm  # what a peer can (not) do to this process, in words


def test_the_planes_policies():
    gloo, nccl = plane("gloo"), plane("nccl")
    assert (gloo.digest_per_bucket, gloo.canary_bytes) == (True, 8)
    assert (nccl.digest_per_bucket, nccl.canary_bytes) == (False, 0)
    assert "aborts the receiving process" in gloo.peer_harm and "canary" in gloo.peer_harm
    assert "cannot crash" in nccl.peer_harm and "deadman" in nccl.peer_harm


def test_an_unknown_plane_is_named():
    with pytest.raises(ValueError, match="no data plane 'rdma'"):
        plane("rdma")
    with pytest.raises(ValueError, match="no data plane '../x'"):
        plane("../x")


def test_a_plane_must_state_what_a_peer_can_do(monkeypatch):
    monkeypatch.setattr(base, "_PLANES", dict(base._PLANES))

    class Mute(Transport):
        digest_per_bucket = False
        canary_bytes = 0

    with pytest.raises(TypeError, match=r"does not state \['peer_harm'\]"):
        register("mute")(Mute)
    assert "mute" not in base._PLANES


def _pair(cfg: SyncConfig) -> tuple[Transport, Transport]:
    """Rank 0 through `Transport(...)`, rank 1 through `open_transport(...)`."""
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault(0, Transport(cfg, 0)))
    th.start()
    try:
        box[1] = open_transport(cfg, 1)
    finally:
        th.join(60)
    return box[0], box[1]


@pytest.fixture
def gloo_pair():
    cfg = SyncConfig(control_port=free_port(), group_port=free_port(), world_size=2, timeout_s=20)
    pair = _pair(cfg)
    yield pair
    for t in pair:
        t.close()


def test_both_front_doors_open_the_named_plane_and_class_spies_see_it(gloo_pair, monkeypatch):
    """`Transport(cfg, ...)` and `open_transport(cfg, ...)` give the plane of `cfg.backend`; a
    spy set on `Transport.broadcast` (as tests do) sees every plane's broadcasts."""
    tx, rx = gloo_pair
    assert type(tx) is type(rx) is plane("gloo") and tx.device == torch.device("cpu")
    seen: list[int | None] = []
    real = Transport.broadcast

    def spy(self, tensor, src=0, *, length=None):
        seen.append(length)
        return real(self, tensor, src, length=length)

    monkeypatch.setattr(Transport, "broadcast", spy)
    data = torch.arange(200, dtype=torch.uint8)
    room = torch.zeros(200 + rx.canary_bytes, dtype=torch.uint8)  # the receiver posts more
    works = [tx.broadcast(data), rx.broadcast(room, length=200)]
    assert all(w.wait() for w in works)
    assert torch.equal(room[:200], data) and not room[200:].any()
    assert seen == [None, 200]
    assert (tx.bytes_moved, rx.bytes_moved, tx.collectives, rx.collectives) == (200, 200, 1, 1)


def test_broadcast_checks_and_abort_breaks_for_good(gloo_pair):
    tx, _ = gloo_pair
    with pytest.raises(ValueError, match="broadcast takes uint8 on cpu"):
        tx.broadcast(torch.zeros(4, dtype=torch.float32))
    assert tx.collectives == 0  # nothing posted, nothing counted
    tx.abort("test over")
    tx.abort("a second reason")  # idempotent: the first reason stays
    assert tx.broken == "test over"
    with pytest.raises(RuntimeError, match=r"broken \(test over\); join again"):
        tx.broadcast(torch.zeros(4, dtype=torch.uint8))
    with tx.armed(5.0, "nothing"):  # gloo records a deadline only
        tx.extend(5.0)
    tx.close()
    tx.close()


class _FakeGroup:
    """Stands in for an NCCL communicator: counts aborts."""

    def __init__(self) -> None:
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1


def _bare_nccl() -> tuple[Transport, threading.Thread]:
    """The NCCL plane's policy objects without a GPU: its deadman over a stand-in group."""
    t = object.__new__(plane("nccl"))
    t.rank, t.world_size, t.broken, t.pg, t._store = 0, 2, "", _FakeGroup(), None
    t._cond, t._deadline, t._what, t._closed = threading.Condition(), None, "", False
    deadman = threading.Thread(target=t._watch, daemon=True)
    deadman.start()
    return t, deadman


def _until(cond, what: str, timeout: float = 10.0) -> None:
    ev = threading.Event()
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        ev.wait(0.005)


def test_the_nccl_deadman_aborts_a_block_past_its_deadline():
    t, deadman = _bare_nccl()
    group = t.pg
    with t.armed(0.05, "bucket 3 of update 7"):
        _until(lambda: t.broken, "the deadman to act")  # a host wait stuck behind a collective
    assert t.broken == "bucket 3 of update 7 did not finish within the deadline"
    _until(lambda: group.aborts == 1, "the communicator's abort")  # `broken` is set just before
    t.close()  # already aborted: nothing more to free
    deadman.join(10)
    assert not deadman.is_alive() and group.aborts == 1 and t.pg is None


def test_the_nccl_deadman_leaves_a_block_done_in_time_and_close_frees_the_group():
    t, deadman = _bare_nccl()
    group = t.pg
    with t.armed(60, "update 1"):
        t.extend(60)
    assert t._deadline is None and t.broken == ""  # disarmed on leaving the block
    t.close()
    deadman.join(10)
    assert not deadman.is_alive()
    assert group.aborts == 1 and t.broken == "closed"  # a healthy communicator is freed once
