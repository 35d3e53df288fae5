"""Multi-process: a sender and two receivers over real ZeroMQ sockets and a real gloo group."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.conftest import free_port
from tests.procs import record_broadcasts, run_procs
from vllm_nccl_sync import PushClient, SyncConfig
from vllm_nccl_sync.packing import ALIGN
from vllm_nccl_sync.receiver import Receiver

pytestmark = pytest.mark.multiproc
DEADLINE = 120


def model_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),  # 38 KB > bucket
        "layers.0.qkv.weight": torch.randn(96, 32, generator=g).to(torch.float16),
        "layers.0.norm.weight": torch.randn(33, generator=g),
        "layers.0.steps": torch.randint(0, 2**40, (3,), generator=g),
        "layers.0.empty": torch.empty(0),
        "layers.1.mlp.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "head.bias": torch.randn(7, generator=g).double(),
    }


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class DigestLoader:
    """Keeps a digest of every tensor it is given (and nothing that references the buffer)."""

    def __init__(self):
        self.digests: dict[str, tuple[str, str, list[int]]] = {}

    def begin(self):
        pass

    def load(self, named):
        for n, t in named:
            self.digests[n] = (digest(t), str(t.dtype), list(t.shape))
        return {n for n, _ in named}

    def finish(self):
        pass

    def abort(self):
        pass


def sender_proc(cfg: dict, versions: list[int]) -> dict:
    sizes = record_broadcasts()
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    results = []
    for v in versions:
        r = client.push(model_tensors(seed=v), version=v)
        results.append({"buckets": r.buckets, "bytes": r.bytes, "tensors": r.tensors,
                        "acks": sorted(a.rank for a in r.acks)})
    client.close()
    return {"results": results, "sizes": sizes}


def receiver_proc(cfg: dict, rank: int, n_updates: int) -> dict:
    sizes = record_broadcasts()
    rx = Receiver(SyncConfig(**cfg), rank)
    out = []
    for _ in range(n_updates):
        loader = DigestLoader()
        summary = rx.receive(loader, timeout_s=60)
        out.append({"summary": summary, "digests": loader.digests})
    rx.close()
    return {"updates": out, "sizes": sizes}


def make_cfg(bucket_bytes: int = 16 * 1024) -> dict:
    return dict(control_port=free_port(), group_port=free_port(), world_size=3,
                bucket_bytes=bucket_bytes, timeout_s=30.0)


def test_two_receivers_get_bit_identical_tensors_and_exact_bytes():
    cfg = make_cfg()
    versions = [1, 2]
    sender, *receivers = run_procs(
        [(sender_proc, (cfg, versions))]
        + [(receiver_proc, (cfg, r, len(versions))) for r in (1, 2)],
        DEADLINE,
    )
    for i, v in enumerate(versions):
        want = {n: (digest(t), str(t.dtype), list(t.shape)) for n, t in model_tensors(v).items()}
        for rx in receivers:
            upd = rx["updates"][i]
            assert upd["summary"]["ok"], upd["summary"]
            assert upd["summary"]["version"] == v
            assert upd["digests"] == want
        assert sender["results"][i]["acks"] == [1, 2]
        assert sender["results"][i]["tensors"] == len(want)
    # Wire bytes: every broadcast carries its bucket's payload, never the buffer's capacity.
    payload = sum(t.numel() * t.element_size() for t in model_tensors(1).values())
    ntensors = len(model_tensors(1))
    per_update = sender["results"][0]["bytes"]
    assert payload <= per_update < payload + ALIGN * (ntensors + sender["results"][0]["buckets"])
    assert sum(sender["sizes"]) == sum(r["bytes"] for r in sender["results"])
    for rx in receivers:
        assert rx["sizes"] == sender["sizes"]
    assert max(sender["sizes"]) <= cfg["bucket_bytes"]
    assert sender["results"][0]["buckets"] >= 3  # the embedding alone spans several buckets


def test_exact_length_would_catch_a_full_buffer_sender():
    """The check above is not vacuous: a sender broadcasting whole buffers breaks it."""
    import vllm_nccl_sync.sender as sender_mod

    buf = torch.zeros(1024, dtype=torch.uint8)
    b = next(sender_mod.plan_buckets([("x", torch.ones(10))], 1024))
    assert sender_mod.pack(b, buf).numel() == 40 != buf.numel()
