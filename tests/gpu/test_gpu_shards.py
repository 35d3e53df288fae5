"""GPU: shard to shard over NCCL point to point, the workers of a TP=2 engine on their own GPUs.

The same tensors and read sets as `tests/multiproc/test_shard_to_shard.py` (a TP=2 engine's two
workers and a TP=1 engine's worker, each publishing its read set), on CUDA: one trainer on
cuda:0 (or two FSDP-like ranks on cuda:0 and cuda:1, each holding half of every tensor as a
DTensor), workers on the next GPUs. Each worker must end with exactly its read set (NaN
elsewhere), and its data plane must have received its planned bytes.

Needs 4 CUDA GPUs for the trainer-and-three-workers case and 5 for the FSDP case (skipped
otherwise). On one GPU, the trainer and the three workers share it over CUDA IPC (`ipc`): each
worker copies only its own buckets out of the trainer's two shared buffers, in place and staged.
`python -m pytest -q -m gpu tests/gpu/test_gpu_shards.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import free_port
from tests.multiproc.test_shard_to_shard import PLACES, READS, Keep, _reads_exactly, tensors
from tests.procs import record_broadcasts, run_procs
from vllm_nccl_sync import PushClient, SyncConfig
from vllm_nccl_sync.engine.receiver import Receiver
from vllm_nccl_sync.wire.reads import nbytes


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = [pytest.mark.gpu, pytest.mark.multiproc]
DEADLINE = 300
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (shared hosts)


def trainer(cfg: dict, version: int, staged: bool = False) -> dict:
    dev = torch.device("cuda", 0)
    client = PushClient(SyncConfig(**cfg), dev)
    client.connect()
    r = client.push({n: t.to(dev) for n, t in tensors(version).items()}, version, staged=staged)
    client.close()
    return {"per_receiver": r.per_receiver}


def fsdp_rank(cfg: dict, rank: int, port: int, version: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    mesh = init_device_mesh("cuda", (2,))
    client = PushClient(SyncConfig(**cfg), dev, rank=rank)
    client.connect()
    sd = {n: distribute_tensor(t.to(dev), mesh, [Shard(0)]) for n, t in tensors(version).items()}
    r = client.push(sd, version)
    client.close()
    dist.destroy_process_group()
    return {"per_receiver": r.per_receiver}


def worker(cfg: dict, rank: int, senders: int, gpu: int) -> dict:
    sizes = record_broadcasts()
    replica, tp_rank, tp_size = PLACES[rank - senders + 1]
    rx = Receiver(SyncConfig(**cfg), rank, replica=replica, tp_rank=tp_rank, tp_size=tp_size,
                  device=torch.device("cuda", gpu), reads=READS[rank - senders + 1])
    keep = Keep()
    s = rx.run(keep, timeout_s=120)
    rx.close()
    return {"ok": s.ok, "error": s.error, "bytes": s.bytes, "got": keep.got, "moved": sum(sizes)}


def _check(workers: list[dict], per_receiver: dict[int, int], senders: int) -> None:
    sent = tensors(1)
    for i, w in enumerate(workers):
        rank = i + senders
        read = READS[i + 1]
        assert w["ok"], w["error"]
        for name, t in sent.items():
            assert _reads_exactly(w["got"][name], t, read.tensors[name]), (rank, name)
        assert w["moved"] == w["bytes"] == per_receiver[rank] >= nbytes(read)


@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
@pytest.mark.parametrize("staged", [False, True])
def test_one_gpu_shared_by_the_trainer_and_every_worker_over_cuda_ipc(staged):
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=4, backend="ipc",
               bucket_bytes=8 * 1024, timeout_s=60.0, shard=True)
    pushed, *workers = run_procs([(trainer, (cfg, 1, staged))]
                                 + [(worker, (cfg, r, 1, 0)) for r in (1, 2, 3)], DEADLINE)
    _check(workers, pushed["per_receiver"], 1)


@pytest.mark.skipif(_gpus() < 4, reason="needs 4 CUDA GPUs")
def test_one_trainer_gpu_sends_each_worker_gpu_its_read_set():
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=4, backend="nccl",
               bucket_bytes=8 * 1024, timeout_s=60.0, shard=True)
    pushed, *workers = run_procs([(trainer, (cfg, 1))]
                                 + [(worker, (cfg, r, 1, r)) for r in (1, 2, 3)], DEADLINE)
    _check(workers, pushed["per_receiver"], 1)


@pytest.mark.skipif(_gpus() < 5, reason="needs 5 CUDA GPUs")
def test_two_fsdp_gpus_send_each_worker_gpu_what_they_hold():
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=5, backend="nccl",
               bucket_bytes=8 * 1024, timeout_s=60.0, shard=True,
               senders=[("127.0.0.1", free_port())])
    port = free_port()
    first, _, *workers = run_procs([(fsdp_rank, (cfg, r, port, 1)) for r in (0, 1)]
                                   + [(worker, (cfg, r, 2, r)) for r in (2, 3, 4)], DEADLINE)
    _check(workers, first["per_receiver"], 2)
