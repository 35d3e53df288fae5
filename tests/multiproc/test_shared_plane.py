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
from tests.helpers import push_rewritten, storages
from tests.multiproc.test_gloo_multiproc import DigestLoader, digest, model_tensors
from tests.procs import run_procs
from tests.unit.test_planes import _ranks
from vllm_nccl_sync import PushClient, SyncConfig
from vllm_nccl_sync.engine.receiver import Receiver
from vllm_nccl_sync.outcomes import PeerFailed
from vllm_nccl_sync.planes.base import Transport
from vllm_nccl_sync.planes.handoff import checked_fd, new_memory
from vllm_nccl_sync.planes.registry import open_transport, plane

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
    tx, rx = _ranks(_cfg())
    try:
        # the memory has no name: nothing of the group's is in /dev/shm
        assert not [f for f in os.listdir("/dev/shm") if f.startswith("vllm_nccl_sync")]
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
    tx, rx = _ranks(_cfg())
    try:
        tx.broadcast(tx.shared_buffers()[0][:sent])
        with pytest.raises(RuntimeError, match=f"published {sent} bytes .* header said 300"):
            rx.broadcast(rx.shared_buffers()[0][:300]).wait()
    finally:
        tx.close()
        rx.close()


def test_a_receiver_that_never_gives_a_buffer_back_is_lost_at_the_timeout():
    tx, rx = _ranks(_cfg(timeout_s=0.5))
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
    open_transport(cfg, 1)
    os._exit(0)


def test_a_receiver_that_exits_is_lost_at_once_not_at_the_timeout():
    cfg = _cfg(timeout_s=300.0)
    proc = mp.get_context("spawn").Process(target=_attach_and_exit, args=(cfg,))
    proc.start()
    tx = open_transport(cfg, 0)
    try:
        proc.join(60)
        assert proc.exitcode == 0
        with pytest.raises(PeerFailed, match="rank 1 exited"):
            tx.broadcast(tx.shared_buffers()[0][:64]).wait()
    finally:
        tx.close()


def test_memory_handed_over_is_checked_after_it_arrived(tmp_path):
    """A descriptor is mapped only if it is shared memory of the sender's user, of the size
    announced: a regular file (a symlink opens as its target), another user's memory or a
    forged size is refused, naming no path."""
    fd = new_memory(8192)
    regular = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR, 0o600)
    os.symlink(tmp_path / "f", tmp_path / "link")
    link = os.open(tmp_path / "link", os.O_RDONLY)
    os.ftruncate(regular, 8192)
    try:
        checked_fd(fd, 8192, os.getuid(), "m")
        for bad in (regular, link):
            with pytest.raises(ValueError, match=r"^m is not shared memory: refused$"):
                checked_fd(bad, 8192, os.getuid(), "m")
        with pytest.raises(ValueError, match="belongs to another user than the sender"):
            checked_fd(fd, 8192, os.getuid() + 1, "m")
        with pytest.raises(ValueError, match="holds 8192 bytes, announced 16384"):
            checked_fd(fd, 16384, os.getuid(), "m")
    finally:
        for f in (fd, regular, link):
            os.close(f)


def test_a_join_record_of_another_bucket_size_is_refused():
    """A sender whose buffers are not the size this receiver's config agreed to."""
    mine = _cfg(timeout_s=2.0)
    theirs = SyncConfig(**{**mine.to_dict(), "bucket_bytes": 8192})
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault(0, _try(lambda: open_transport(theirs, 0))))
    th.start()
    with pytest.raises(ValueError, match=r"bucket_bytes 8192\) does not match this receiver's"):
        open_transport(mine, 1)
    th.join(60)
    assert isinstance(box[0], Exception)  # the sender's join ends at its timeout


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
            self.wire[0][length // 2] ^= 0xFF  # the sender's memory, before it is read
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


def test_a_state_dict_of_hundreds_of_storages_is_read_in_place_bit_exact():
    """400 storages exported before the plan (more packets than a handoff socket's buffer held
    one storage to a packet): every one reaches the receiver, each update bit-exact, the second
    a repeat of the first's layout."""
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2, backend="shm",
               bucket_bytes=1 << 20, timeout_s=30.0)
    _, got = run_procs([(push_rewritten, (cfg, [1, 2], "shared")), (_receiver, (cfg, 2, -1))],
                       120)
    for seed, g in zip([1, 2], got, strict=True):
        assert g["summary"]["ok"], g["summary"]
        assert g["digests"] == _expected(storages(seed))
        assert g["summary"]["read_in_place"] > 0
    assert [g["summary"]["plan"] for g in got] == ["checked", "repeat"]


def _forging_sender(cfg: dict, case: str) -> list[dict]:
    """Update 1 reads shared tensors in place with its handles or ranges forged as `case` says;
    update 2: an honest push of the same kind."""
    import torch.multiprocessing as torch_mp

    from vllm_nccl_sync.planes.shm import ShmMemory, ShmTransport
    from vllm_nccl_sync.wire.protocol import Source

    real_export = ShmTransport.export
    regular = open(__file__, "rb")  # noqa: SIM115 - held open for the handle below
    theirs = new_memory(1 << 20)  # shared memory of another user
    os.fchown(theirs, 65534, 65534)

    def share(self, storage):
        fd, nbytes = storage._share_fd_cpu_()
        if case == "another-user":
            fd, nbytes = theirs, 1 << 20
        elif case == "not-shared-memory":
            fd = regular.fileno()
        elif case == "wrong-size":
            nbytes += 8
        return msgspec.msgpack.encode(ShmMemory(nbytes)), [fd]

    def export(self, t):
        if case == "never-exported":
            return Source(7, 0)
        at = real_export(self, t)
        return at if at is None or case != "past-the-end" else Source(at.segment, at.offset + 8)

    assert torch_mp.get_sharing_strategy() == "file_descriptor"
    try:
        return _forged_then_honest(cfg, {"export": export, "_share": share})
    finally:
        regular.close()
        os.close(theirs)


def _forged_then_honest(cfg: dict, forged: dict) -> list[dict]:
    """Pushes update 1 with the shm plane's methods replaced by `forged`, then update 2 with
    the real ones; each push's outcome."""
    from vllm_nccl_sync.planes.shm import ShmTransport

    real = {name: getattr(ShmTransport, name) for name in forged}
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    out = []
    for v in (1, 2):
        for name, fn in forged.items():
            setattr(ShmTransport, name, fn if v == 1 else real[name])
        try:
            client.push(_shared(v), version=v)
            out.append({"ok": True})
        except Exception as e:  # noqa: BLE001
            out.append({"ok": False, "error": str(e)})
    client.close()
    return out


@pytest.mark.parametrize("case, match", [
    ("never-exported", r"memory segment 7 was never exported by the sender"),
    ("past-the-end", r"bytes \[\d+, \d+\) of the sender's memory segment 0 lie past its \d+ bytes"),
    ("another-user", r"segment 0 belongs to another user than the sender: refused"),
    ("not-shared-memory", r"segment 0 is not shared memory: refused"),
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
    assert "/" not in sent[0]["error"].split("refused at the plan", 1)[1], sent  # no path
    assert sent[1] == {"ok": True} and got[1]["summary"]["ok"], (sent, got[1])
    assert got[1]["summary"]["read_in_place"] > 0
    assert got[1]["digests"] == _expected(model_tensors(2))


# ---------------------------------------------------------------- a writer during the push

W_NAME, W_BYTES = "w.weight", 64 * 1024
"""A tensor in shared memory that fills one bucket by itself (read in place, alone)."""


def _writing_sender(cfg: dict, n: int) -> list[dict]:
    """`n` pushes of `w.weight` (shared memory, read in place) and a packed tensor; in pushes
    `v % 4 in (1, 2)` a trainer thread rewrites both all through the push. Staged every other
    push. Returns each push's outcome and, for the quiet ones, the bytes pushed."""
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    w = torch.zeros(W_BYTES // 4).share_memory_()
    p = torch.zeros(1024)
    out = []
    for v in range(1, n + 1):
        w.fill_(float(v))
        p.fill_(float(-v))
        stop, writing = threading.Event(), v % 4 in (1, 2)

        def write(stop=stop, v=v):
            k = 0
            while not stop.is_set():
                k += 1
                w.fill_(v + k / 1000.0)
                p.fill_(-v - k / 1000.0)

        th = threading.Thread(target=write)
        if writing:
            th.start()
        try:
            client.push({W_NAME: w, "p.weight": p}, version=v, staged=v % 2 == 0)
            ok, error = True, ""
        except Exception as e:  # noqa: BLE001
            ok, error = False, str(e)
        stop.set()
        if writing:
            th.join()
        out.append({"ok": ok, "error": error, "writing": writing,
                    "w": None if writing else digest(w)})
    client.close()
    return out


def _checking_receiver(cfg: dict, n: int) -> list[dict]:
    """Receives `n` updates into a module of its own (`ModuleLoader`: its copies sum what they
    write); per update the sender's checksum of `w.weight`'s bucket, the checksum and digest of
    the bytes the module then holds, and whether the receiver still calls itself consistent. In
    updates `v % 4 == 3` the memory as this receiver's loads read it changes right after the
    bucket arrived (after the sender summed it: the worst moment a writer can pick), without
    touching the mapping later updates read."""
    from vllm_nccl_sync.engine import dataplane, receiver
    from vllm_nccl_sync.engine.loaders import ModuleLoader
    from vllm_nccl_sync.wire.integrity import checksum

    rx = Receiver(SyncConfig(**cfg), 1)
    real, real_problem, seen = dataplane.ReceivePlane.arrived, receiver.digest_problem, {}

    def arrived(self, seq, length, work):
        got = real(self, seq, length, work)
        if isinstance(work, dataplane._Mapped) and length == W_BYTES:
            seen["seq"] = seq
            if seen["v"] % 4 == 3:
                work.parts[0] = work.parts[0].clone().bitwise_xor_(0xFF)
        return got

    def problem(rank, seq, got, theirs, *rest):
        if seq == seen.get("seq"):
            seen["theirs"] = theirs
        return real_problem(rank, seq, got, theirs, *rest)

    dataplane.ReceivePlane.arrived, receiver.digest_problem = arrived, problem
    model = torch.nn.Module()
    for name, numel in (("w", W_BYTES // 4), ("p", 1024)):
        model.add_module(name, torch.nn.Module())
        getattr(model, name).weight = torch.nn.Parameter(torch.zeros(numel))
    out = []
    for i in range(n):
        seen.clear()
        seen["v"] = i + 1
        s = rx.receive(ModuleLoader(model), timeout_s=60)
        held = model.w.weight.detach().view(torch.uint8)
        out.append({"ok": s["ok"], "theirs": seen.get("theirs"), "held": checksum(held),
                    "w": digest(model.w.weight.detach()), "consistent": s["consistent"]})
    rx.close()
    return out


def test_a_trainer_writing_during_the_push_never_gets_unchecked_bytes_committed():
    """A trainer thread rewrites a tensor read in place (and a packed one) all through 25 of 50
    pushes, staged and in place, and in 12 more the memory changes right after the bucket
    arrived: every update that commits holds exactly the bytes whose checksum the sender sent
    (the loads sum what they write); the 12 are refused, never committed; every other push
    without a writer commits the trainer's bytes."""
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2, backend="shm",
               bucket_bytes=W_BYTES, timeout_s=30.0)
    n = 50
    sent, got = run_procs([(_writing_sender, (cfg, n)), (_checking_receiver, (cfg, n))], 300)
    for v, (s, g) in enumerate(zip(sent, got, strict=True), 1):
        assert s["ok"] == g["ok"], (s, g)
        if g["ok"]:
            assert g["consistent"] and g["held"] == g["theirs"], (s, g)
        if v % 4 == 3:
            assert not s["ok"] and "checksum" in s["error"] and not g["consistent"], (s, g)
        elif not s["writing"]:
            assert s["ok"] and g["w"] == s["w"], (s, g)
        else:
            assert s["ok"] or "checksum" in s["error"], s


# ---------------------------------------------------------------- a trainer of another user

NOBODY = 65534


def _victim(where: str) -> None:
    """A third process (root, as the engine) holding a secret in shared memory; says its pid and
    the secret's descriptor in `where`, then waits until that file is removed (bounded)."""
    import time

    secret = torch.full((4096,), 1234.5).share_memory_()
    fd, _ = secret.untyped_storage()._share_fd_cpu_()
    with open(f"{where}.tmp", "w") as f:
        f.write(f"{os.getpid()} {fd}")
    os.rename(f"{where}.tmp", where)
    end = time.monotonic() + 120
    while os.path.exists(where) and time.monotonic() < end:
        time.sleep(0.05)


def _foreign_sender(cfg: dict, victim: tuple[int, int], whose: str) -> list[dict]:
    """A trainer running as another user (nobody) whose first update names memory of another
    process, as the old handle format let it (a pid and a descriptor number in the rendezvous
    store; `whose`: a third user's process, or one of its own user's); its second update is
    honest (its own model in shared memory)."""
    import torch.distributed as dist

    from vllm_nccl_sync.wire.protocol import Source

    os.setgid(NOBODY)
    os.setuid(NOBODY)
    if whose == "own-user":  # a process of its own user holding shared memory
        r, w = os.pipe()
        pid, fd = os.fork(), 3
        if pid == 0:  # holds it until the pipe's only write end (the parent's) closes
            os.close(w)
            held = torch.full((4096,), 7.0).share_memory_()
            os.read(r, 1)
            del held
            os._exit(0)
        os.close(r)
    else:
        pid, fd = victim

    def export(self, t):  # the old format's forged handle, and a plan that names it
        store = dist.PrefixStore("vllm_nccl_sync", self._store)
        store.set("segment/99", msgspec.msgpack.encode({"pid": pid, "fd": fd, "nbytes": 16384}))
        return Source(99, 0)

    try:
        return _forged_then_honest(cfg, {"export": export})
    finally:
        if whose == "own-user":  # the child sees the end of the pipe and exits
            os.close(w)
            os.waitpid(pid, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the trainer as another user")
@pytest.mark.parametrize("whose", ["third-user", "own-user"])
def test_a_trainer_of_another_user_cannot_make_the_engine_read_other_memory(tmp_path, whose):
    """The engine (root) is fed by a trainer running as nobody that names another process's
    memory: refused at the plan, nothing read or loaded, and nothing the engine computed of any
    memory (no checksum) and no path comes back to it; its own memory is then read in place."""
    where = str(tmp_path / "victim")
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2, backend="shm",
               bucket_bytes=16 * 1024, timeout_s=30.0)
    victim = mp.get_context("spawn").Process(target=_victim, args=(where,), daemon=True)
    victim.start()
    try:
        while not os.path.exists(where):
            assert victim.is_alive(), "the victim process died"
            victim.join(0.05)
        with open(where) as f:
            pid_fd = tuple(map(int, f.read().split()))
        sent, got = run_procs([(_foreign_sender, (cfg, pid_fd, whose)),
                               (_receiver, (cfg, 2, -1))], 120)
    finally:
        if os.path.exists(where):
            os.unlink(where)
        victim.join(60)
    assert not sent[0]["ok"] and "refused at the plan" in sent[0]["error"], sent
    assert "memory segment 99 was never exported by the sender" in sent[0]["error"], sent
    assert not re.search(r"0x[0-9a-f]{6,}|/proc|/dev/shm|/tmp", sent[0]["error"]), sent
    assert not got[0]["summary"]["ok"] and not got[0]["loaded"], got[0]
    assert got[0]["summary"]["version"] != 1
    assert sent[1] == {"ok": True} and got[1]["summary"]["ok"], (sent, got[1])
    assert got[1]["summary"]["read_in_place"] > 0
    assert got[1]["digests"] == _expected(model_tensors(2))


def test_cuda_ipc_handles_are_checked_before_pytorch_opens_anything():
    """What a CPU host can check of a forged CUDA IPC handle: a reference counter that is not
    one PyTorch made in the sender's own process (another process's, a path out of /dev/shm, a
    name of another form) or an offset outside the counter file is refused before PyTorch would
    open (and later decrement) it; a handle with descriptors, or one that does not decode, is
    refused before anything is mapped."""
    from vllm_nccl_sync.outcomes import Kind
    from vllm_nccl_sync.planes.ipc import IpcMemory, IpcTransport, ref_counter_problem

    def info(ref: bytes, offset: int = 0) -> IpcMemory:
        return IpcMemory("GPU-x", b"h" * 64, 4096, 0, ref, offset, b"", False)

    assert ref_counter_problem(info(b"/torch_4242_981273_0"), 4242, "m") is None
    assert ref_counter_problem(info(b"/torch_4242_981273_7", 9999), 4242, "m") is None
    for ref, offset in [(b"/torch_4243_981273_0", 0), (b"/torch_42_981273_0", 0),
                        (b"/torch_4242_../../etc/passwd", 0), (b"/torch_4242_1_2_3", 0),
                        (b"/psm_4242_1_2", 0), (b"/torch_4242_1_2", -1),
                        (b"/torch_4242_1_2", 10000)]:
        problem = ref_counter_problem(info(ref, offset), 4242, "m")
        assert problem.kind is Kind.HANDLE and problem.text.endswith(": refused"), ref
        assert isinstance(problem.error(), ValueError)  # what a forged handle raises as
    plane = object.__new__(IpcTransport)  # the checks come before any CUDA call
    with pytest.raises(ValueError, match="comes with no descriptors"):
        plane._opened(msgspec.msgpack.encode(info(b"/torch_1_2_3")), [5], 0, "m", 1)
    with pytest.raises(ValueError, match="does not decode"):
        plane._opened(b"junk", [], 0, "m", 1)


def _rogue(cfg: dict, uid: int, secret: bytes | None) -> str:
    """A local process that reads the join record from the store and connects to the sender's
    handoff socket as rank 1 (as user `uid`, proving `secret`): what it got."""
    from datetime import timedelta

    import torch.distributed as dist

    from vllm_nccl_sync.planes.handoff import Join, Link

    if uid != os.getuid():
        os.setgid(uid)
        os.setuid(uid)
    store = dist.PrefixStore("vllm_nccl_sync", dist.TCPStore(
        cfg["host"], cfg["group_port"], is_master=False, timeout=timedelta(seconds=120)))
    raw = store.get("join")
    join = msgspec.msgpack.decode(raw[: len(raw) - (32 if cfg.get("secret") else 0)], type=Join)
    try:
        link = Link(join, 1, secret, 120.0)
        _, fds = link.group_memory()
    except (ValueError, OSError) as e:
        return f"refused: {e}"
    return f"got the group's memory ({len(fds)} descriptors)"


@pytest.mark.parametrize("who", ["wrong-secret", "another-user"])
def test_a_local_process_that_is_not_the_receiver_gets_no_memory(who):
    """The sender hands its memory only to a receiver of its own user (or root) that proves the
    config's secret: a rogue that connects first is refused and the real receiver joins."""
    if who == "another-user" and os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    secret = "ab" * 16
    cfg = _cfg(secret=secret, timeout_s=120.0)  # a bound: the rogue's start may be slow
    uid, proof = (os.getuid(), b"\x00" * 16) if who == "wrong-secret" else (NOBODY, bytes.fromhex(secret))
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault(0, _try(lambda: open_transport(cfg, 0))))
    th.start()
    try:
        rogue, = run_procs([(_rogue, (cfg.to_dict(), uid, proof))], 180)
        assert rogue.startswith("refused"), rogue
        rx = open_transport(cfg, 1)
    finally:
        th.join(60)
    tx = box[0]
    assert isinstance(tx, Transport), tx
    try:
        tx.shared_buffers()[0][:8] = 7
        send = tx.broadcast(tx.shared_buffers()[0][:8])
        assert rx.broadcast(rx.shared_buffers()[0][:8]).wait()
        assert torch.equal(rx.shared_buffers()[0][:8], torch.full((8,), 7, dtype=torch.uint8))
        rx.release(0)
        assert send.wait()
    finally:
        tx.close()
        rx.close()


def test_a_join_record_without_the_secret_is_refused():
    """A receiver with a secret refuses a join record that does not carry it."""
    from vllm_nccl_sync.planes.handoff import Join, open_join, seal_join

    join = Join(1, b"\0vllm_nccl_sync-x", 4096)
    assert open_join(seal_join(join, b"k" * 16), b"k" * 16) == join
    for raw in (seal_join(join, None), seal_join(join, b"j" * 16)):
        with pytest.raises(ValueError, match="does not carry this config's secret"):
            open_join(raw, b"k" * 16)
