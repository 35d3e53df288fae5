"""Shard to shard over real ZeroMQ sockets and a real gloo group (or the `shm` plane), without
vLLM: a trainer and the workers of a TP=2 engine plus a TP=1 engine, each worker publishing a read
set of its own.

What each worker was given shows which bytes reached it: the elements it reads hold the
trainer's values, every other element NaN (`packing.Reassembler`)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import free_port
from tests.procs import die_after_broadcasts, record_broadcasts, run_procs
from vllm_nccl_sync import PushClient, PushError, SyncConfig, UpdateRefused
from vllm_nccl_sync.engine.receiver import Receiver
from vllm_nccl_sync.wire.packing import ALIGN, dtype_name
from vllm_nccl_sync.wire.protocol import Block, Read, ReadSet
from vllm_nccl_sync.wire.reads import nbytes, whole

pytestmark = pytest.mark.multiproc
DEADLINE = 120
H = 64  # rows of the column-parallel weight, columns of the row-parallel one


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "qkv.weight": torch.randn(H, 48, generator=g).to(torch.bfloat16),  # rows split
        "o.weight": torch.randn(40, H, generator=g),  # columns split
        "norm.weight": torch.randn(48, generator=g),  # read whole by every worker
        "embed.weight": torch.randn(300, 32, generator=g).to(torch.bfloat16),  # > one bucket
    }


def read_set(worker: int, tp: int) -> ReadSet:
    """What worker `worker` of a TP=`tp` engine reads: rows, columns, the norm whole."""
    out = {}
    for name, t in tensors(0).items():
        dt, shape = dtype_name(t.dtype), list(t.shape)
        if tp == 1 or name == "norm.weight":
            out[name] = whole(dt, shape)
            continue
        n = shape[1] if name == "o.weight" else shape[0]
        lo, hi = worker * n // tp, (worker + 1) * n // tp
        block = (Block([0, lo], [shape[0], hi]) if name == "o.weight"
                 else Block([lo, 0], [hi, shape[1]]))
        out[name] = Read(dt, shape, [block])
    return ReadSet(worker, out)


READS = {1: read_set(0, 2), 2: read_set(1, 2), 3: read_set(0, 1)}
PLACES = {1: (0, 0, 2), 2: (0, 1, 2), 3: (1, 0, 1)}  # rank: replica, tp_rank, tp_size


class Keep:
    """A loader that keeps a copy of every tensor it is given."""

    def __init__(self) -> None:
        self.got: dict = {}

    def begin(self) -> None:
        pass

    def load(self, named):
        for n, t in named:
            self.got[n] = t.float().cpu().numpy().copy()  # by value across processes
        return {n for n, _ in named}

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass


def make_cfg(backend: str = "gloo") -> dict:
    return dict(control_port=free_port(), group_port=free_port(), world_size=4,
                bucket_bytes=8 * 1024, timeout_s=30.0, shard=True, backend=backend)


def trainer(cfg: dict, versions: list[int], swap: bool, staged: bool = False) -> dict:
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    out: dict = {"pushes": []}
    if swap:  # plan rank 1's buckets from rank 2's read set and the other way round
        assert client.reads is not None
        client.reads[1], client.reads[2] = client.reads[2], client.reads[1]
        try:
            client.push(tensors(1), 1)
        except UpdateRefused as e:
            out["refused"] = str(e)
        client.reads[1], client.reads[2] = client.reads[2], client.reads[1]
    for v in versions:
        r = client.push(tensors(v), v, staged=staged)
        out["pushes"].append({"bytes": r.bytes, "per_receiver": r.per_receiver,
                              "buckets": r.buckets})
    client.close()
    return out


def worker(cfg: dict, rank: int, updates: int, senders: int = 1) -> dict:
    """Worker `rank` (read set `rank - senders + 1`) taking `updates` updates: what it was
    given, and what its data plane received."""
    sizes = record_broadcasts()  # what this worker's data plane received, bucket by bucket
    replica, tp_rank, tp_size = PLACES[rank - senders + 1]
    rx = Receiver(SyncConfig(**cfg), rank, replica=replica, tp_rank=tp_rank, tp_size=tp_size,
                  reads=READS[rank - senders + 1])
    out = []
    for _ in range(updates):
        keep = Keep()
        s = rx.run(keep, timeout_s=60)
        out.append({"ok": s.ok, "error": s.error, "bytes": s.bytes, "got": keep.got,
                    "moved": sum(sizes), "plan": s.extra.get("plan")})
        sizes.clear()
    rx.close()
    return {"updates": out}


def _reads_exactly(got, sent: torch.Tensor, read: Read) -> bool:
    """`got` holds `sent` on `read`'s blocks and NaN everywhere else."""
    got, sent = torch.from_numpy(got), sent.float()
    mask = torch.zeros(sent.shape, dtype=torch.bool)
    for b in read.blocks:
        mask[tuple(slice(a, z) for a, z in zip(b.start, b.stop))] = True
    return torch.equal(got[mask], sent[mask]) and bool(got[~mask].isnan().all())


@pytest.mark.parametrize(("backend", "staged"), [("gloo", False), ("shm", False), ("shm", True)])
def test_each_worker_receives_exactly_its_read_set(backend, staged):
    """Over gloo and shared memory, in place and staged (the blocks kept compact until the
    commit makes them whole)."""
    cfg = make_cfg(backend)
    versions = [1, 2]
    sender, *workers = run_procs(
        [(trainer, (cfg, versions, False, staged))]
        + [(worker, (cfg, r, len(versions))) for r in (1, 2, 3)], DEADLINE)
    for i, v in enumerate(versions):
        sent, push = tensors(v), sender["pushes"][i]
        for rank, w in zip((1, 2, 3), workers):
            u = w["updates"][i]
            assert u["ok"], u["error"]
            assert u["plan"] == ("checked" if i == 0 else "repeat")  # the same layout again
            assert set(u["got"]) == set(sent)
            for name, t in sent.items():
                assert _reads_exactly(u["got"][name], t, READS[rank].tensors[name]), (rank, name)
            # Counted at the data plane: what the trainer planned for this worker, which is its
            # read set plus at most one alignment pad per slot and bucket.
            assert u["moved"] == u["bytes"] == push["per_receiver"][rank]
            assert nbytes(READS[rank]) <= u["moved"] < nbytes(READS[rank]) + ALIGN * 3 * len(sent)
        model = sum(t.numel() * t.element_size() for t in sent.values())
        tp2 = push["per_receiver"][1] + push["per_receiver"][2]
        assert tp2 < 1.2 * model  # the TP=2 engine takes the model about once, not twice
        assert push["per_receiver"][3] >= model


def test_a_plan_that_sends_a_worker_blocks_it_does_not_read_is_refused_before_any_byte():
    cfg = make_cfg()
    sender, *workers = run_procs(
        [(trainer, (cfg, [2], True))] + [(worker, (cfg, r, 2)) for r in (1, 2, 3)], DEADLINE)
    assert "is not one this worker reads" in sender["refused"]
    for w in workers:
        refused, after = w["updates"]
        assert not refused["ok"] and refused["moved"] == 0 and not refused["got"]
        assert after["ok"], after["error"]  # the next push, planned right, lands


def bad_worker(cfg: dict, rank: int, done) -> None:
    replica, tp_rank, tp_size = PLACES[rank]
    reads = READS[rank]
    if rank == 2:  # claims two blocks of its rows that overlap
        q = reads.tensors["qkv.weight"]
        reads.tensors["qkv.weight"] = Read(q.dtype, q.shape, [Block([H // 2, 0], [H, 48]),
                                                              Block([H - 4, 0], [H, 48])])
    rx = Receiver(SyncConfig(**cfg), rank, replica=replica, tp_rank=tp_rank, tp_size=tp_size,
                  reads=reads)
    assert done.wait(DEADLINE)  # the trainer has read every Hello
    rx.close()


def hostile_trainer(cfg: dict, done) -> str:
    client = PushClient(SyncConfig(**cfg))
    try:
        client.connect()
    except PushError as e:
        return str(e)
    finally:
        done.set()
        client.close()
    return ""


def test_a_hostile_read_set_is_refused_at_join_naming_it():
    import multiprocessing as mp

    cfg, done = make_cfg(), mp.get_context("spawn").Event()
    said, *_ = run_procs([(hostile_trainer, (cfg, done))]
                         + [(bad_worker, (cfg, r, done)) for r in (1, 2, 3)], DEADLINE)
    assert "replica 0" in said and "'qkv.weight'" in said and "overlap" in said, said


def dying_trainer(cfg: dict, staged: bool) -> None:
    """Pushes version 1, then dies (SIGKILL) once the third bucket of version 2 went out."""
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    client.push(tensors(1), 1, staged=staged)
    die_after_broadcasts(3)
    client.push(tensors(2), 2, staged=staged)


def second_trainer(cfg: dict) -> int:
    """A new trainer after the first died: every worker joins it again; a full update."""
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    result = client.push(tensors(3), 3, full=True)
    client.close()
    return result.version


def rejoining_worker(cfgs: tuple[dict, dict], rank: int, senders: int = 1) -> dict:
    """Takes version 1, sees the trainer die during version 2, joins the new trainer with the
    state it holds and takes version 3 (`senders`: the trainer's ranks before this one)."""
    from vllm_nccl_sync.engine.state import ReceiverState

    replica, tp_rank, tp_size = PLACES[rank - senders + 1]
    state, out = ReceiverState(), []
    for cfg, updates in zip(cfgs, (2, 1)):
        rx = Receiver(SyncConfig(**cfg), rank, replica=replica, tp_rank=tp_rank, tp_size=tp_size,
                      reads=READS[rank - senders + 1], state=state)
        for _ in range(updates):
            keep = Keep()
            s = rx.run(keep, timeout_s=60)
            out.append({"ok": s.ok, "consistent": s.consistent, "version": s.version,
                        "got": keep.got, "error": s.error, "plan": s.extra.get("plan")})
        rx.close()
    return {"updates": out}


@pytest.mark.parametrize(("staged", "backend"), [(False, "gloo"), (True, "gloo"),
                                                  (False, "shm")])
def test_a_trainer_killed_mid_update_is_reported_and_a_rejoin_restores(staged, backend):
    first = {**make_cfg(backend), "timeout_s": 10.0}
    second = make_cfg(backend)
    _, again, *workers = run_procs(
        [(dying_trainer, (first, staged)), (second_trainer, (second,))]
        + [(rejoining_worker, ((first, second), r)) for r in (1, 2, 3)], DEADLINE,
        allow_killed={0})
    assert again == 3
    _check_rejoined(workers, staged)


def _check_rejoined(workers: list[dict], staged: bool) -> None:
    """Each worker (read set 1, 2, 3) took version 1, reported version 2's failure (in place:
    inconsistent; staged: intact, nothing loaded) and, joined again, holds exactly version 3."""
    for rank, w in zip((1, 2, 3), workers):
        one, broken, three = w["updates"]
        assert one["ok"] and one["version"] == 1, one["error"]
        assert not broken["ok"] and broken["error"], rank
        # In place, some buckets were loaded: the worker says so. Staged, nothing was.
        assert broken["consistent"] is staged and broken["version"] == 1
        if staged:
            assert not broken["got"]
        assert three["ok"] and three["consistent"] and three["version"] == 3, three["error"]
        assert three["plan"] == "checked"  # joined again: nothing agreed before is kept
        for name, t in tensors(3).items():
            assert _reads_exactly(three["got"][name], t, READS[rank].tensors[name]), (rank, name)



def fsdp_trainer(cfg: dict, rank: int, port: int, versions: list[int]) -> list[dict]:
    """Rank `rank` of a 2-rank trainer whose tensors are DTensors sharded by rows (FSDP's
    layout): it sends only what it holds, and never gathers a full tensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    client = PushClient(SyncConfig(**cfg), rank=rank)
    client.connect()
    out = []
    for v in versions:
        sd = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in tensors(v).items()}
        r = client.push(sd, v)
        out.append({"bytes": r.bytes, "per_sender": r.per_sender,
                    "per_receiver": r.per_receiver})
    client.close()
    dist.destroy_process_group()
    return out


def test_two_fsdp_ranks_send_each_worker_only_the_intersections_they_hold():
    cfg = {**make_cfg(), "world_size": 5, "senders": [("127.0.0.1", free_port())]}
    port, versions = free_port(), [1, 2]
    t0, t1, *workers = run_procs(
        [(fsdp_trainer, (cfg, r, port, versions)) for r in (0, 1)]
        + [(worker, (cfg, r, len(versions), 2)) for r in (2, 3, 4)], DEADLINE)
    for i, v in enumerate(versions):
        sent = tensors(v)
        for rank, w in zip((2, 3, 4), workers):
            u = w["updates"][i]
            assert u["ok"], u["error"]
            read = READS[rank - 1]
            for name, t in sent.items():
                assert _reads_exactly(u["got"][name], t, read.tensors[name]), (rank, name)
            assert u["moved"] == u["bytes"] == t0[i]["per_receiver"][rank]
            assert nbytes(read) <= u["moved"] < nbytes(read) + ALIGN * 6 * len(sent)
        # Each rank sent what it holds of what the workers read: halves here, the norms (read
        # whole by all three) once per bucket for every receiver.
        per_sender, per_receiver = t0[i]["per_sender"], t0[i]["per_receiver"]
        assert per_sender[0] == per_sender[1] and t1[i]["bytes"] == per_sender[1]
        assert sum(per_sender.values()) < sum(per_receiver.values())


def dying_fsdp_rank(cfg: dict, rank: int, port: int, staged: bool) -> str:
    """`fsdp_trainer`'s rank: version 1, then version 2, during which rank 1 dies (SIGKILL) once
    its second bucket went out; rank 0 returns how its push of version 2 failed."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    client = PushClient(SyncConfig(**cfg), rank=rank)
    client.connect()
    for v in (1, 2):
        sd = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in tensors(v).items()}
        if v == 2 and rank == 1:
            die_after_broadcasts(2)
        try:
            client.push(sd, v, staged=staged)
        except PushError as e:
            return str(e)
    return ""


@pytest.mark.parametrize("staged", [False, True])
def test_an_fsdp_rank_killed_mid_update_is_reported_and_a_rejoin_restores(staged):
    first = {**make_cfg(), "world_size": 5, "senders": [("127.0.0.1", free_port())],
             "timeout_s": 10.0}
    second = {**make_cfg(), "world_size": 5, "senders": [("127.0.0.1", free_port())]}
    ports = free_port(), free_port()
    said, _, *rest = run_procs(
        [(dying_fsdp_rank, (first, r, ports[0], staged)) for r in (0, 1)]
        + [(fsdp_trainer, (second, r, ports[1], [3])) for r in (0, 1)]
        + [(rejoining_worker, ((first, second), r, 2)) for r in (2, 3, 4)], DEADLINE,
        allow_killed={1})
    assert "sender 1" in said, said
    _check_rejoined(rest[2:], staged)
