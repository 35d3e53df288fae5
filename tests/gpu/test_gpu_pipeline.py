"""GPU, one device: the CUDA pipeline of both sides (the lane's side-stream checksums and buffer
reuse, the receiver's issue/load/checksum streams and events) against a stand-in data plane.

NCCL refuses two ranks on one GPU, so the real NCCL plane needs two GPUs (tests/gpu/test_gpu_nccl.py).
Here a `PushClient` and a `Receiver` run in one process, in two threads, on one GPU, over a
plane that behaves as NCCL's does for the streams: a posted "collective" starts after what the
posting stream queued, runs on a stream of its own, and `wait()` orders the caller's current
stream after it (the host never waits for the bytes). Every other part is real: ZeroMQ, the
protocol, checksums on the device, `ModuleLoader` on CUDA parameters.

Run: `python -m pytest -q -m gpu tests/gpu/test_gpu_pipeline.py`.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.conftest import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CAP = 1 << 20


class _Wire:
    """What the two ranks of the stand-in share: per collective, the sender's bytes and events."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.sent: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}
        self.done: dict[int, torch.cuda.Event] = {}


class _Handle:
    def __init__(self, wait) -> None:
        self._wait = wait

    def wait(self) -> bool:
        self._wait()
        return True


def _stand_in(wire: _Wire):
    from vllm_nccl_sync.planes.base import Transport

    class CudaLoop(Transport):
        """Two ranks, one GPU, one process; the NCCL plane's stream semantics."""

        digest_per_bucket = False
        canary_bytes = 0
        peer_harm = "none (in-process stand-in)"
        backend = "nccl"

        def _device(self, device):
            return device or torch.device("cuda", 0)

        def _group(self, store, cfg):
            self._n = 0
            self._stream = torch.cuda.Stream(self.device)
            return object()

        def _await(self, table: dict, k: int):
            deadline = time.monotonic() + 30
            with wire.cond:
                while k not in table:
                    assert time.monotonic() < deadline, f"collective {k} never met"
                    wire.cond.wait(0.05)
                return table[k]

        def _post(self, tensor, src, to):  # every bucket goes to the one receiver
            k, self._n = self._n, self._n + 1
            cur = torch.cuda.current_stream(self.device)
            if self.rank == src:
                ready = torch.cuda.Event()
                ready.record(cur)  # after the pack queued on the posting stream
                with wire.cond:
                    wire.sent[k] = (tensor, ready)
                    wire.cond.notify_all()
                return _Handle(lambda: cur_wait(self._await(wire.done, k)))
            src_bytes, ready = self._await(wire.sent, k)
            done = torch.cuda.Event()
            self._stream.wait_stream(cur)
            self._stream.wait_event(ready)
            with torch.cuda.stream(self._stream):
                tensor.copy_(src_bytes[: tensor.numel()])
                done.record(self._stream)
            with wire.cond:
                wire.done[k] = done
                wire.cond.notify_all()
            return _Handle(lambda: cur_wait(done))

        def _abort_group(self, pg):
            pass

    def cur_wait(ev: torch.cuda.Event) -> None:
        torch.cuda.current_stream().wait_event(ev)

    return CudaLoop


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed": (1024, 384), "a": (257, 33), "b": (4096,), "c": (3, 5, 7), "empty": (0, 4),
              "big": (1536, 256)}  # "big" and "embed": larger than a bucket, cut on rows
    out = {n: torch.randn(*s, generator=g) for n, s in shapes.items()}
    out["bf"] = torch.randn(999, generator=g).to(torch.bfloat16)
    return {n: t.cuda() for n, t in out.items()}


@pytest.mark.parametrize("mode", ["state_dict", "stream", "staged"])
def test_cuda_pipeline_is_bit_exact(monkeypatch, mode):
    from vllm_nccl_sync.engine.loaders import ModuleLoader
    from vllm_nccl_sync.engine.receiver import Receiver
    from vllm_nccl_sync.planes import registry
    from vllm_nccl_sync.trainer.push import PushClient
    from vllm_nccl_sync.wire.config import SyncConfig

    wire = _Wire()
    stand_in = _stand_in(wire)
    monkeypatch.setattr(registry, "plane", lambda name: stand_in)  # every open_transport
    cfg = SyncConfig(control_port=free_port(), group_port=free_port(), world_size=2,
                     backend="nccl", bucket_bytes=CAP, timeout_s=30.0)
    dev = torch.device("cuda", 0)
    model = torch.nn.Module()
    for n, t in _tensors(0).items():
        model.register_parameter(n, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
    client = PushClient(cfg, dev)
    box: dict = {}
    joiner = threading.Thread(target=lambda: box.setdefault("rx", Receiver(cfg, 1, device=dev)))
    joiner.start()
    client.connect()
    joiner.join(60)
    rx = box["rx"]
    try:
        for version in (1, 2, 3):
            sent = _tensors(version)
            out: dict = {}
            th = threading.Thread(target=lambda: out.setdefault(
                "s", rx.receive(ModuleLoader(model), 30.0)))
            th.start()
            source = iter(sent.items()) if mode == "stream" else sent
            result = client.push(source, version, staged=mode == "staged")
            th.join(60)
            summary = out["s"]
            assert summary["ok"], summary
            assert result.buckets >= 4 and summary["buckets"] == result.buckets
            torch.cuda.synchronize()
            for n, t in sent.items():
                assert torch.equal(getattr(model, n), t), f"update {version}: {n} differs"
        # a bucket corrupted on the way is refused at the Seal, and nothing is stamped
        import vllm_nccl_sync.engine.dataplane as dp

        real = dp.checksum_gpu
        monkeypatch.setattr(dp, "checksum_gpu",
                            lambda b: real(b)._replace(nbytes=b.numel() + 1))
        out = {}
        th = threading.Thread(target=lambda: out.setdefault(
            "s", rx.receive(ModuleLoader(model), 30.0)))
        th.start()
        with pytest.raises(Exception, match="corrupted|checksum"):
            client.push(_tensors(9), 9, staged=True)
        th.join(60)
        assert not out["s"]["ok"] and out["s"]["version"] == 3
        for n, t in _tensors(3).items():
            assert torch.equal(getattr(model, n), t), f"staged refusal touched {n}"
    finally:
        rx.close()
        client.close()
