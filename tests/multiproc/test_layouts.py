"""Layouts agreed once, over real ZeroMQ sockets and a real gloo group (or the `shm` plane): a
trainer process pushing to a receiver process that copies each update into tensors of its own.

The trainer opens an update with a `Repeat` only where every receiver accepted the same layout
for the last update and it committed; any change of layout, a staged push of it, or a failed
update falls back to a full plan. Every update that commits is bit-exact.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import free_port
from tests.procs import run_procs
from vllm_nccl_sync import PushClient, SyncConfig, UpdateRefused
from vllm_nccl_sync.bench import _Params, join_receivers

pytestmark = pytest.mark.multiproc
DEADLINE = 120

STEPS = [  # (version, tensors: "all" or "part", staged, what the receiver's summary says)
    (1, "all", False, "checked"),
    (2, "all", False, "repeat"),  # the same layout: one message opens it
    (3, "part", False, "checked"),  # another layout (one tensor fewer)
    (4, "part", False, "repeat"),
    (4, "part", False, None),  # an old version: the repeat is refused, nothing loaded
    (5, "part", False, "kept"),  # after a failed update: the full plan (checked as before)
    (6, "part", True, "checked"),  # staged: another layout
    (7, "part", True, "repeat"),
]


def tensors(seed: int, which: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"w": torch.randn(24, 16, generator=g).to(torch.bfloat16),
           "b": torch.randn(24, generator=g), "n": torch.randn(16, generator=g)}
    return out if which == "all" else {k: out[k] for k in ("w", "n")}


def trainer(cfg: dict) -> list[str]:
    client = PushClient(SyncConfig(**cfg))
    client.connect()
    out = []
    for version, which, staged, _ in STEPS:
        try:
            client.push(tensors(version, which), version, staged=staged)
            out.append("ok")
        except UpdateRefused as e:
            out.append(f"refused: {e}")
    client.close()
    return out


def receiver(cfg: dict) -> list[dict]:
    from vllm_nccl_sync.engine.loaders import ModuleLoader

    mine = {n: torch.zeros_like(t) for n, t in tensors(0, "all").items()}
    rx = join_receivers({"x": cfg})["x"]
    out = []
    for version, which, _, _ in STEPS:
        before = {n: t.clone() for n, t in mine.items()}
        s = rx.receive(ModuleLoader(_Params(mine)), timeout_s=60)
        sent = tensors(version, which)
        s["exact"] = all(torch.equal(mine[n], sent.get(n, before[n])) for n in mine) \
            if s["ok"] else all(torch.equal(mine[n], before[n]) for n in mine)
        out.append(s)
    rx.close()
    return out


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_a_repeat_push_opens_with_one_message_and_every_change_falls_back(backend):
    cfg = dict(control_port=free_port(), group_port=free_port(), world_size=2, backend=backend,
               bucket_bytes=1 << 12, timeout_s=30.0)
    pushed, got = run_procs([(trainer, (cfg,)), (receiver, (cfg,))], DEADLINE)
    for (version, _, _, plan), push, s in zip(STEPS, pushed, got, strict=True):
        assert s["exact"], (version, s)  # committed: the new tensors; refused: untouched
        if plan is None:
            assert push.startswith("refused") and "it holds version 4" in push, push
            assert not s["ok"] and "it holds version 4" in s["error"], s
            continue
        assert push == "ok" and s["ok"], (push, s)
        assert s["plan"] == plan and s["version"] == version, (version, s)
