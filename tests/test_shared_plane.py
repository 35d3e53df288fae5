"""The same-host shared-memory plane (`shm`): one segment mapped by every rank, the control block,
and what a faulty or hostile peer meets; real segments, real processes, real ZeroMQ sockets."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import threading

import msgspec
import pytest
import torch

from tests.conftest import free_port
from tests.procs import run_procs
from tests.test_gloo_multiproc import DigestLoader, digest, model_tensors
from tests.test_planes import _pair
from vllm_nccl_sync import PushClient, SyncConfig
from vllm_nccl_sync.engine.receiver import Receiver
from vllm_nccl_sync.outcomes import PeerFailed
from vllm_nccl_sync.planes import shared
from vllm_nccl_sync.planes.base import Transport, plane
from vllm_nccl_sync.planes.shared import Segment, create_segment, open_segment, unlink_segment

pytestmark = pytest.mark.multiproc


def _cfg(**kw) -> SyncConfig:
    base = dict(control_port=free_port(), group_port=free_port(), world_size=2, backend="shm",
                bucket_bytes=4096, timeout_s=20.0)
    return SyncConfig(**{**base, **kw})


def test_the_shared_planes_state_their_policies_and_take_one_sender():
    shm, ipc = plane("shm"), plane("ipc")
    assert shm.shares_buffers and ipc.shares_buffers and not plane("gloo").shares_buffers
    assert (shm.digest_per_bucket, shm.canary_bytes) == (True, 0)
    assert (ipc.digest_per_bucket, ipc.canary_bytes) == (False, 0)
    assert "cannot crash" in shm.peer_harm and "another GPU" in ipc.peer_harm
    with pytest.raises(ValueError, match="the shm plane takes one sender"):
        _cfg(world_size=3, senders=(("127.0.0.1", free_port()),))


def test_a_broadcast_moves_no_bytes_the_receiver_reads_the_senders_buffer():
    tx, rx = _pair(_cfg())
    try:
        assert not any(os.path.exists(f"/dev/shm/{s.name}") for s in tx._segments)  # unlinked
        out, into = tx.shared_buffers()[1], rx.shared_buffers()[1]
        out[:300] = torch.arange(300) % 251
        send = tx.broadcast(out[:300])
        recv = rx.broadcast(into[:300])
        assert recv.wait() and torch.equal(into[:300], torch.arange(300) % 251)
        rx.release(1)
        assert send.wait()  # every receiver gave the buffer back
        assert (tx.bytes_moved, rx.bytes_moved, tx.collectives) == (300, 300, 1)
        with pytest.raises(ValueError, match="only from the start of its shared buffers"):
            tx.broadcast(torch.zeros(8, dtype=torch.uint8))
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("sent", [299, 301])
def test_a_sender_publishing_another_length_than_the_header_is_refused(sent):
    tx, rx = _pair(_cfg())
    try:
        tx.broadcast(tx.shared_buffers()[0][:sent])
        with pytest.raises(RuntimeError, match=f"published {sent} bytes .* header said 300"):
            rx.broadcast(rx.shared_buffers()[0][:300]).wait()
    finally:
        tx.close()
        rx.close()


def test_a_receiver_that_never_gives_a_buffer_back_is_lost_at_the_timeout():
    tx, rx = _pair(_cfg(timeout_s=0.5))
    try:
        send = tx.broadcast(tx.shared_buffers()[0][:64])
        rx.broadcast(rx.shared_buffers()[0][:64]).wait()  # read, never released
        with pytest.raises(PeerFailed, match="rank 1 did not answer within 0.5 s"):
            send.wait()
        assert tx.lost == {1}
        tx.broadcast(tx.shared_buffers()[0][:64]).wait()  # later ones skip it
    finally:
        tx.close()
        rx.close()


def _attach_and_exit(cfg: SyncConfig) -> None:
    Transport(cfg, 1)
    os._exit(0)


def test_a_receiver_that_exits_is_lost_at_once_not_at_the_timeout():
    cfg = _cfg(timeout_s=300.0)
    proc = mp.get_context("spawn").Process(target=_attach_and_exit, args=(cfg,))
    proc.start()
    tx = Transport(cfg, 0)
    try:
        proc.join(60)
        assert proc.exitcode == 0
        with pytest.raises(PeerFailed, match="rank 1 exited"):
            tx.broadcast(tx.shared_buffers()[0][:64]).wait()
    finally:
        tx.close()


def test_segments_of_another_name_or_size_are_refused_before_mapping():
    seg, mem = create_segment(8192)
    try:
        assert os.stat(f"/dev/shm/{seg.name}").st_mode & 0o777 == 0o600
        open_segment(seg, 8192).close()
        with pytest.raises(ValueError, match="not one of this package's"):
            open_segment(Segment("psm_other", 8192), 4096)
        with pytest.raises(ValueError, match="not one of this package's"):
            open_segment(Segment(shared.PREFIX + "../../etc/passwd", 8192), 4096)
        with pytest.raises(ValueError, match="holds 8192 bytes, announced 16384"):
            open_segment(Segment(seg.name, 16384), 16384)  # a forged size
        with pytest.raises(ValueError, match="needed 12288"):
            open_segment(seg, 12288)
    finally:
        mem.close()
        unlink_segment(seg)


def test_a_join_record_of_another_bucket_size_is_refused(monkeypatch):
    """A sender whose buffers are not the size this receiver's config agreed to; it leaves no
    segment behind (named apart from any other run's on this host)."""
    monkeypatch.setattr(shared, "PREFIX", f"{shared.PREFIX}{os.getpid()}-")
    mine = _cfg(timeout_s=2.0)
    theirs = SyncConfig(**{**mine.to_dict(), "bucket_bytes": 8192})
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault(0, _try(lambda: Transport(theirs, 0))))
    th.start()
    with pytest.raises(ValueError, match=r"bucket_bytes 8192\) does not match this receiver's"):
        Transport(mine, 1)
    th.join(60)
    assert isinstance(box[0], Exception)  # the sender's join ends at its timeout
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(shared.PREFIX)]


def _try(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return e


# ---------------------------------------------------------------- whole updates, real processes


def _sender(cfg: dict, plan: list[tuple[int, bool]]) -> list[dict]:
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    out = []
    for v, staged in plan:
        try:
            r = client.push(model_tensors(seed=v), version=v, staged=staged)
            out.append({"ok": True, "acks": sorted(a.rank for a in r.acks)})
        except Exception as e:  # noqa: BLE001
            out.append({"ok": False, "error": str(e)})
    client.close()
    return out


def _receiver(cfg: dict, n: int, garble: int) -> list[dict]:
    """Receives `n` updates; the `garble`-th (0-based, -1: none) has one byte of its first
    bucket changed in the shared buffer after the sender checksummed it (another writer)."""
    from vllm_nccl_sync.engine import dataplane

    rx = Receiver(SyncConfig(**cfg), 1)
    real, count = dataplane.ReceivePlane.arrived, {"n": 0}

    def arrived(self, seq, length, work):
        if count["n"] == garble and seq == 0:
            work.wait()
            self.buffers[0][length // 2] ^= 0xFF
        return real(self, seq, length, work)

    dataplane.ReceivePlane.arrived = arrived
    kept = DigestLoader()
    out = []
    for i in range(n):
        count["n"] = i
        loader = DigestLoader()
        s = rx.receive(loader, timeout_s=60)
        if s["ok"]:
            kept = loader
        out.append({"summary": s, "digests": kept.digests, "loaded": bool(loader.digests)})
    rx.close()
    return out


def test_a_garbled_shared_buffer_is_never_loaded_and_the_next_update_heals():
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2, backend="shm",
               bucket_bytes=16 * 1024, timeout_s=30.0)
    plan = [(1, True), (2, True), (3, False)]
    sent, got = run_procs([(_sender, (cfg, plan)), (_receiver, (cfg, len(plan), 1))], 120)
    want = {v: {n: (digest(t), str(t.dtype), list(t.shape)) for n, t in model_tensors(v).items()}
            for v, _ in plan}
    assert [s["ok"] for s in sent] == [True, False, True]
    assert "checksum" in got[1]["summary"]["error"] and not got[1]["loaded"]
    assert got[1]["summary"]["version"] == 1 and got[1]["digests"] == want[1]  # kept version 1
    assert got[2]["summary"]["ok"] and got[2]["digests"] == want[3]
    assert msgspec.json.encode(got[2]["summary"]["version"]) == b"3"


def _dying_receiver(cfg: dict) -> None:
    """Joins, then dies (SIGKILL) once bucket 1 of the first update arrived, holding its
    buffer."""
    import signal

    from vllm_nccl_sync.engine import dataplane

    real = dataplane.ReceivePlane.loaded

    def die(self, seq):  # bucket 0 given back, so the sender can go on; bucket 1 held
        if seq == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        real(self, seq)

    dataplane.ReceivePlane.loaded = die
    Receiver(SyncConfig(**cfg), 1).receive(DigestLoader(), timeout_s=60)


def test_a_receiver_killed_mid_update_is_reported_by_the_trainer_long_before_the_timeout():
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2, backend="shm",
               bucket_bytes=16 * 1024, timeout_s=600.0)  # the report must not wait for it
    sent, _ = run_procs([(_sender, (cfg, [(1, False)])), (_dying_receiver, (cfg,))], 120,
                        allow_killed={1})
    assert not sent[0]["ok"] and "rank 1" in sent[0]["error"], sent


def _shared(seed: int) -> dict[str, torch.Tensor]:
    """`model_tensors(seed)` with every storage moved into shared memory (as
    `model.share_memory()` does)."""
    return {n: t.share_memory_() for n, t in model_tensors(seed).items()}


def _expected(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, str, list[int]]]:
    return {n: (digest(t), str(t.dtype), list(t.shape)) for n, t in tensors.items()}


PLAIN = "plain.weight"
"""A tensor not in shared memory, pushed beside shared ones: packed, as on any plane."""


def _plain(seed: int) -> torch.Tensor:
    return torch.randn(40, 40, generator=torch.Generator().manual_seed(seed))


def _sharing_sender(cfg: dict, seeds: list[int]) -> list[dict]:
    """Pushes one state dict whose tensors lie in shared memory, rewritten in place before each
    push (the same storages: the layout is kept), plus one tensor that does not."""
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    tensors, plain = _shared(seeds[0]), _plain(seeds[0])
    out = []
    for seed in seeds:
        for n, t in model_tensors(seed).items():
            tensors[n].copy_(t)
        plain.copy_(_plain(seed))
        r = client.push({**tensors, PLAIN: plain}, version=seed)
        out.append({"buckets": r.buckets, "shared": all(t.is_shared() for t in tensors.values()),
                    "plain_shared": plain.is_shared()})
    client.close()
    return out


def test_tensors_in_shared_memory_are_read_in_place_bit_exact():
    """A state dict in shared memory is read where it lies (the receiver's summary counts the
    buckets), the rest packed; every update bit-exact; nothing of the trainer's is moved."""
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2, backend="shm",
               bucket_bytes=16 * 1024, timeout_s=30.0)
    sent, got = run_procs([(_sharing_sender, (cfg, [1, 2, 3])), (_receiver, (cfg, 3, -1))], 120)
    for seed, s, g in zip([1, 2, 3], sent, got, strict=True):
        assert g["summary"]["ok"], g["summary"]
        assert g["digests"] == _expected({**model_tensors(seed), PLAIN: _plain(seed)})
        # embed (38 KB) spans three in-place buckets, the other shared tensors one more; the
        # plain tensor is packed into a bucket of its own
        assert g["summary"]["read_in_place"] == 4 == s["buckets"] - 1, (g["summary"], s)
        assert s["shared"] and not s["plain_shared"]


def _forging_sender(cfg: dict, case: str) -> list[dict]:
    """Update 1 reads shared tensors in place with its handles or ranges forged as `case` says;
    update 2: an honest push of the same kind."""
    import torch.multiprocessing as torch_mp

    from vllm_nccl_sync.planes.shm import ShmStorage, ShmTransport
    from vllm_nccl_sync.wire.protocol import Source

    real_export, real_share = ShmTransport.export, ShmTransport._share
    regular = open(__file__, "rb")  # noqa: SIM115 - held open for the handle below

    def share(self, storage):
        fd, nbytes = storage._share_fd_cpu_()
        pid, size = os.getpid(), nbytes
        if case == "another-process":
            pid = os.getppid()
        elif case == "not-shared-memory":
            fd = regular.fileno()
        elif case == "wrong-size":
            size = nbytes + 8
        return msgspec.msgpack.encode(ShmStorage(pid, fd, size))

    def export(self, t):
        if case == "never-exported":
            return Source(7, 0)
        at = real_export(self, t)
        return at if at is None or case != "past-the-end" else Source(at.segment, at.offset + 8)

    assert torch_mp.get_sharing_strategy() == "file_descriptor"
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    out = []
    for v in (1, 2):
        ShmTransport.export = export if v == 1 else real_export
        ShmTransport._share = share if v == 1 else real_share
        try:
            client.push(_shared(v), version=v)
            out.append({"ok": True})
        except Exception as e:  # noqa: BLE001
            out.append({"ok": False, "error": str(e)})
    client.close()
    regular.close()
    return out


@pytest.mark.parametrize("case, match", [
    ("never-exported", r"memory segment 7 was never exported by the sender"),
    ("past-the-end", r"bytes \[\d+, \d+\) of the sender's memory segment 0 lie past its \d+ bytes"),
    ("another-process", r"names process \d+, not the sender \(\d+\): refused"),
    ("not-shared-memory", r"is not shared memory \('.*test_shared_plane.py'\): refused"),
    ("wrong-size", r"holds \d+ bytes, announced \d+: refused"),
])
def test_forged_memory_to_read_in_place_is_refused_before_anything_is_read(case, match):
    """Each forged handle or range is refused at the plan by the receiver, naming it: nothing
    loaded, the sender told why; the next honest update is read in place, bit-exact."""
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2, backend="shm",
               bucket_bytes=16 * 1024, timeout_s=30.0)
    sent, got = run_procs([(_forging_sender, (cfg, case)), (_receiver, (cfg, 2, -1))], 120)
    assert not sent[0]["ok"] and re.search(match, sent[0]["error"]), sent
    assert "refused at the plan" in sent[0]["error"], sent
    assert not got[0]["summary"]["ok"] and not got[0]["loaded"], got[0]
    assert re.search(match, got[0]["summary"]["error"]), got[0]["summary"]
    assert sent[1] == {"ok": True} and got[1]["summary"]["ok"], (sent, got[1])
    assert got[1]["summary"]["read_in_place"] > 0
    assert got[1]["digests"] == _expected(model_tensors(2))
