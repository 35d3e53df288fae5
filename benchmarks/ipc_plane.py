"""The ipc plane alone: a trainer process pushes 8.71 GB (Qwen2-7B-shaped, 14 layers, 171 bf16
tensors) to a receiver process on the same GPU, which copies each tensor into its own CUDA
tensors; no vLLM. Per bucket size (and once with checksums off): the copy floor (one
device-to-device copy of the model's bytes) and each push's time, and whether every tensor
arrived bit for bit.

    python benchmarks/ipc_plane.py [reps]
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from tests.procs import run_procs  # noqa: E402
from vllm_nccl_sync.trainer.sync import free_port  # noqa: E402


def shapes(layers: int = 14) -> dict[str, tuple[int, ...]]:
    """Qwen2-7B's tensor shapes (untied embeddings), `layers` layers."""
    h, inter, v, kv = 3584, 18944, 152064, 512
    out = {"embed": (v, h), "head": (v, h), "norm": (h,)}
    for i in range(layers):
        out.update({f"l{i}.q": (h, h), f"l{i}.k": (kv, h), f"l{i}.v": (kv, h), f"l{i}.o": (h, h),
                    f"l{i}.qb": (h,), f"l{i}.kb": (kv,), f"l{i}.vb": (kv,),
                    f"l{i}.gate": (inter, h), f"l{i}.up": (inter, h), f"l{i}.down": (h, inter),
                    f"l{i}.n1": (h,), f"l{i}.n2": (h,)})
    return out


def make(seed: int) -> dict[str, torch.Tensor]:
    """Random bf16 tensors of `shapes()` on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {n: torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for n, s in shapes().items()}



def trainer(cfg: dict, reps: int, check: bool, in_place: bool = True) -> dict:
    """The floor, then `reps` pushes; int64 sums of every tensor's bits."""
    from vllm_nccl_sync import PushClient, SyncConfig
    torch.cuda.set_device(0)
    named = make(1)
    nbytes = sum(t.numel() * 2 for t in named.values())
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda"); dst = torch.empty_like(flat)
    fl = []
    for _ in range(5):
        torch.cuda.synchronize(); t0 = time.perf_counter(); dst.copy_(flat); torch.cuda.synchronize(); fl.append(time.perf_counter() - t0)
    del flat, dst
    cli = PushClient(SyncConfig(**cfg), torch.device("cuda", 0)); cli.connect()
    ts = []
    for v in range(1, reps + 1):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        cli.push(named if in_place else named.items(), version=v)  # a stream is packed
        torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    sums = {n: int(t.view(torch.int16).to(torch.int64).sum()) for n, t in named.items()} if check else {}
    cli.close()
    return {"nbytes": nbytes, "floor_s": sorted(fl), "push_s": ts, "sums": sums}


def receiver(cfg: dict, reps: int, check: bool) -> dict:
    """`reps` updates into tensors of its own; the same sums."""
    from vllm_nccl_sync import SyncConfig
    from tests.gpu.test_gpu_ipc import SlowLoader  # with no spin: plain in-place copies
    from vllm_nccl_sync.engine.receiver import Receiver
    torch.cuda.set_device(0)
    targets = {n: torch.zeros(s, device="cuda", dtype=torch.bfloat16) for n, s in shapes().items()}
    rx = Receiver(SyncConfig(**cfg), 1, device=torch.device("cuda", 0),
                  require_checksums=cfg.get("bucket_checksums") is not False)
    out = []
    for _ in range(reps):
        s = rx.receive(SlowLoader(targets, spin=0), timeout_s=120); out.append(True if s["ok"] else s.get("error"))
    torch.cuda.synchronize()
    sums = {n: int(t.view(torch.int16).to(torch.int64).sum()) for n, t in targets.items()} if check else {}
    rx.close()
    return {"oks": out, "sums": sums}


if __name__ == "__main__":
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    for in_place, bucket_mib, checks in [(True, 1024, None), (True, 1024, False),
                                         (False, 1024, None), (False, 2048, None)]:
        cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2, backend="ipc",
                   bucket_bytes=bucket_mib << 20, timeout_s=60.0, bucket_checksums=checks)
        tr, rx = run_procs([(trainer, (cfg, reps, True, in_place)),
                            (receiver, (cfg, reps, True))], 500)
        push = sorted(tr["push_s"][1:])
        print(json.dumps({"in_place": in_place, "bucket_mib": bucket_mib, "checksums": checks,
                          "GB": tr["nbytes"] / 1e9,
                          "floor_ms_min": tr["floor_s"][0] * 1e3, "push_ms": [round(x * 1e3, 2) for x in tr["push_s"]],
                          "push_ms_median": push[len(push) // 2] * 1e3,
                          "ratio_to_floor": push[len(push) // 2] / tr["floor_s"][0],
                          "bit_exact": tr["sums"] == rx["sums"], "oks": rx["oks"]}), flush=True)
