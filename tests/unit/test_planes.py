"""The data planes behind one interface: found by name, each stating its policies and what a peer
can do to it; the gloo plane end to end in one process (ranks in threads, 127.0.0.1); the
deadman."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import threading
import time

import msgspec
import pytest
import torch

import vllm_nccl_sync.planes
from tests.conftest import free_port
from vllm_nccl_sync.outcomes import PeerFailed
from vllm_nccl_sync.planes import registry
from vllm_nccl_sync.planes.base import Transport
from vllm_nccl_sync.planes.deadman import Deadman
from vllm_nccl_sync.planes.registry import PLANES, open_transport, plane
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


def test_the_registry_names_every_plane_and_only_the_configs():
    """Every module of `planes/` that defines a plane (a concrete `Transport`) is in `PLANES`
    under the name its class states, and the names are exactly those the config accepts; any
    other class of a plane's name is a variant of the registered one (a receiver's way of
    joining it: `receive_process`)."""
    found: dict[str, list[type]] = {}
    for info in pkgutil.iter_modules(vllm_nccl_sync.planes.__path__):
        module = importlib.import_module(f"vllm_nccl_sync.planes.{info.name}")
        for cls in vars(module).values():
            if (inspect.isclass(cls) and issubclass(cls, Transport) and not inspect.isabstract(cls)
                    and cls.__module__ == module.__name__):
                found.setdefault(cls.backend, []).append(cls)
    assert sorted(found) == sorted(PLANES) == sorted(BACKENDS)
    for name, classes in found.items():
        registered = plane(name)
        assert registered in classes and all(issubclass(c, registered) for c in classes), name
    assert len(found["gloo"]) == 2  # gloo and its receive-process variant: the check above ran


def test_an_unknown_plane_is_refused_listing_the_known_ones():
    known = r"the known ones: \['gloo', 'ipc', 'nccl', 'shm'\]"
    for name in ("rdma", "../x", "", None):
        with pytest.raises(ValueError, match=f"no data plane {name!r}; {known}"):
            plane(name)
    with pytest.raises(ValueError, match=known):
        open_transport(_unchecked("rdma"), 0)


def _unchecked(backend: str) -> SyncConfig:
    """A config whose backend no plane has (one the constructor would refuse)."""
    cfg = SyncConfig(control_port=1, group_port=2, world_size=2)
    msgspec.structs.force_setattr(cfg, "backend", backend)
    return cfg


class Mute(Transport):
    """A plane that does not say what a peer can do to it."""

    backend = "mute"
    digest_per_bucket = False
    canary_bytes = 0


class Misnamed(Mute):
    peer_harm = "a peer can do nothing"


def test_a_plane_must_state_what_a_peer_can_do_and_its_own_name(monkeypatch):
    monkeypatch.setitem(PLANES, "mute", (__name__, "Mute"))
    with pytest.raises(TypeError, match=r"does not state \['peer_harm'\]"):
        plane("mute")
    monkeypatch.setitem(PLANES, "mute", (__name__, "Misnamed"))
    assert plane("mute") is Misnamed
    monkeypatch.setitem(PLANES, "quiet", (__name__, "Misnamed"))
    with pytest.raises(TypeError, match="calls itself 'mute'"):
        plane("quiet")
    monkeypatch.setitem(PLANES, "quiet", (__name__, "_ranks"))
    with pytest.raises(TypeError, match="is not a Transport"):
        plane("quiet")
    assert registry.plane("gloo").backend == "gloo"


def test_the_contract_opens_no_plane_itself():
    """`Transport` is the abstract contract: a plane is opened by name, never through it."""
    with pytest.raises(TypeError, match="abstract"):
        Transport(SyncConfig(control_port=1, group_port=2, world_size=2), 0)


def _ranks(cfg: SyncConfig) -> list[Transport]:
    """Every rank of `cfg`'s plane, each opened by name (`open_transport`), rank 0 in this
    thread and each other in one of its own."""
    box: dict = {}
    threads = [threading.Thread(target=lambda r=r: box.setdefault(r, open_transport(cfg, r)))
               for r in range(1, cfg.world_size)]
    for th in threads:
        th.start()
    try:
        box[0] = open_transport(cfg, 0)
    finally:
        for th in threads:
            th.join(60)
    return [box[r] for r in range(cfg.world_size)]


@pytest.fixture
def gloo_pair():
    cfg = SyncConfig(control_port=free_port(), group_port=free_port(), world_size=2, timeout_s=20)
    pair = _ranks(cfg)
    yield pair
    for t in pair:
        t.close()


def test_open_transport_opens_the_named_plane_and_class_spies_see_it(gloo_pair, monkeypatch):
    """`open_transport(cfg, ...)` gives the plane of `cfg.backend`; a spy set on
    `Transport.broadcast` (as tests do) sees every plane's broadcasts."""
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


class _Refusing:
    """A gloo group whose sends to `peer` fail as they are posted, as gloo's own do once it saw
    that peer's connection close ("Connection closed by peer", raised by `send`)."""

    def __init__(self, pg, peer: int) -> None:
        self._pg, self._peer = pg, peer

    def send(self, tensors, dst: int, tag: int):
        if dst == self._peer:
            raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")
        return self._pg.send(tensors, dst, tag)


def test_a_peer_refused_at_post_is_skipped_and_the_others_stay_in_step():
    """A send gloo refuses at once (the peer's connection closed) ends neither the broadcast nor
    the update: the other receivers still get the bucket, the failure is raised naming the peer
    when the broadcast is waited for, and later broadcasts skip it, so every receiver's count
    stays the sender's and bucket k arrives as bucket k (behind by one, it would take bucket
    k+1's bytes for bucket k)."""
    cfg = SyncConfig(control_port=free_port(), group_port=free_port(), world_size=4,
                     timeout_s=20)
    tx, *rxs = _ranks(cfg)
    try:
        tx.pg = _Refusing(tx.pg, 1)
        for k in range(3):
            data = torch.full((256,), k + 1, dtype=torch.uint8)
            rooms = [torch.zeros(256 + rx.canary_bytes, dtype=torch.uint8) for rx in rxs[1:]]
            sent = tx.broadcast(data)
            for rx, room in zip(rxs[1:], rooms, strict=True):
                assert rx.broadcast(room, length=256).wait()
                assert torch.equal(room[:256], data) and not room[256:].any(), (rx.rank, k)
            if k == 0:
                with pytest.raises(PeerFailed, match="rank 1 failed") as e:
                    sent.wait()
                assert e.value.rank == 1
            else:
                assert sent.wait()
        assert tx.lost == {1}
    finally:
        for t in (tx, *rxs):
            t.close()


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
    t.deadman = Deadman()
    return t, t.deadman.watch(t.abort, "test-deadman")


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
    assert t.deadman.deadline is None and t.broken == ""  # disarmed on leaving the block
    t.close()
    deadman.join(10)
    assert not deadman.is_alive()
    assert group.aborts == 1 and t.broken == "closed"  # a healthy communicator is freed once


def test_the_deadman_waits_while_extended_then_acts_once_and_ends_on_close():
    deadman, reasons = Deadman(), []
    thread = deadman.watch(reasons.append, "test-deadman")
    with deadman.armed(0.3, "update 4"):
        for _ in range(5):  # 0.5 s in all, each step well inside the extended deadline
            time.sleep(0.1)
            deadman.extend(0.3)
        assert reasons == []
        _until(lambda: reasons, "the deadman to act")
        assert deadman.deadline is None  # it acts once per armed deadline
    assert reasons == ["update 4 did not finish within the deadline"]
    deadman.extend(0.01)  # disarmed: nothing to push on
    assert deadman.deadline is None
    deadman.close()
    thread.join(10)
    assert not thread.is_alive() and reasons == ["update 4 did not finish within the deadline"]
