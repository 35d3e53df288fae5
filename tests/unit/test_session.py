"""`EngineSession`, the one engine side behind `Ext`, the `nccl_sync` engine and SGLang (CPU, gloo).

A torch module stands in for the engine's model; the test plays the trainer by hand over a real
ZeroMQ channel and a real gloo group. The session's promises: what the worker holds outlives
re-joins; the state report, adapter listing, checksums, pointers and metrics come from one place;
a LoRA adapter update goes to the adapter store's loader and is versioned on its own.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.conftest import free_port
from vllm_nccl_sync.engine.loaders import ModuleLoader
from vllm_nccl_sync.engine.session import EngineSession, Placement
from vllm_nccl_sync.planes.registry import open_transport
from vllm_nccl_sync.wire.channel import SenderChannel
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.integrity import checksum
from vllm_nccl_sync.wire.packing import pack, plan_buckets
from vllm_nccl_sync.wire.protocol import (
    PROTOCOL_VERSION,
    Ack,
    AdapterSpec,
    Commit,
    Digest,
    Go,
    Hello,
    Plan,
    Ready,
    Seal,
)

P = PROTOCOL_VERSION
CAP = 4096


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, generator=g), "v": torch.randn(32, generator=g)}


def make_model() -> torch.nn.Module:
    m = torch.nn.Module()
    for n, t in tensors(0).items():
        m.register_parameter(n, torch.nn.Parameter(t.clone()))
    return m


class Trainer:
    """Rank 0 by hand: a real `SenderChannel` and gloo group; `push` runs one correct update
    while `receive` runs in a thread."""

    def __init__(self) -> None:
        self.cfg = SyncConfig(control_port=free_port(), group_port=free_port(), world_size=2,
                              bucket_bytes=CAP, timeout_s=10.0)
        self.ch = SenderChannel(self.cfg.host, self.cfg.control_port)
        self.tx = None

    def join(self, session: EngineSession, where: Placement, loader, **kw) -> Hello:
        box: dict = {}
        th = threading.Thread(target=lambda: box.setdefault("tx", open_transport(self.cfg, 0)))
        th.start()
        session.join(self.cfg, where, lambda: loader, **kw)
        th.join(60)
        self.tx = box["tx"]
        return self.recv()

    def recv(self):
        return self.ch.recv(time.monotonic() + 30)[1]

    def push(self, session: EngineSession, version: int, named: dict,
             adapter: AdapterSpec | None = None) -> dict:
        out: dict = {}
        th = threading.Thread(target=lambda: out.setdefault("s", session.receive(30.0)))
        th.start()
        buckets = list(plan_buckets(named.items(), CAP))
        headers = [b.header(version, k, k == len(buckets) - 1, P) for k, b in enumerate(buckets)]
        self.ch.send(1, Plan(P, version, [], adapter=adapter, buckets=headers))
        assert isinstance(self.recv(), Ready)
        self.ch.send(1, Go(P, version, len(headers) - 1))
        sums = []
        buf = torch.zeros(CAP, dtype=torch.uint8)
        for k, b in enumerate(buckets):
            wire = pack(b, buf)
            sums.append(checksum(wire))
            self.tx.broadcast(wire).wait()
            self.ch.send(1, Digest(P, version, k, sums[-1]))
        self.ch.send(1, Seal(P, version, len(sums), sums))
        ack = self.recv()
        assert isinstance(ack, Ack), ack
        self.ch.send(1, Commit(P, version, 1))
        th.join(60)
        return out["s"].to_dict()

    def close(self) -> None:
        if self.tx is not None:
            self.tx.close()
        self.ch.close()


class Store:
    """A LoRA adapter store as the session sees it: one loader per update, a listing."""

    def __init__(self) -> None:
        self.got: dict[str, dict[str, torch.Tensor]] = {}

    def loader(self, spec: AdapterSpec):
        store = self

        class Loader:
            def __init__(self):
                self.stats = {"in_place": 0, "registered": 1}

            def begin(self):
                store.got[spec.name] = {}

            def load(self, named):
                store.got[spec.name].update({n: t.clone() for n, t in named})
                return {n for n, _ in named}

            def finish(self):
                pass

            def abort(self):
                store.got.pop(spec.name, None)

        return Loader()

    def listing(self):
        return {n: {"tensors": len(t)} for n, t in self.got.items()}


@pytest.fixture
def trainers():
    made: list[Trainer] = []
    yield lambda: made.append(Trainer()) or made[-1]
    for t in made:
        t.close()


def test_one_session_joins_receives_reports_and_outlives_rejoins(trainers):
    model = make_model()
    stores: list[Store] = []
    session = EngineSession(lambda: model, lambda: (0, 1),
                            lambda: stores.append(Store()) or stores[-1])
    # Before any join: a summary saying so, a state report with every key.
    s = session.receive(0.1)
    assert not s.ok and "has not joined" in s.error
    assert session.report() == {"joined": False, "rank": -1, "version": -1, "consistent": True,
                                "updates": 0, "failures": 0, "bytes": 0, "last_seconds": 0.0,
                                "last_error": "", "adapters": {}, "beside": "",
                                "shadow_bytes": 0, "shadow_kept": 0, "asleep": [], "discarded": ""}
    ptrs = session.param_ptrs()
    first = trainers()
    hello = first.join(session, Placement(1, details={"host": "here"}), ModuleLoader(model),
                       dtype="float32")
    assert isinstance(hello, Hello) and hello.dtype == "float32" and hello.rank == 1
    summary = first.push(session, 2, tensors(2))
    assert summary["ok"] and summary["version"] == 2 and summary["consistent"], summary
    assert all(torch.equal(p, tensors(2)[n]) for n, p in model.named_parameters())
    assert session.param_ptrs() == ptrs  # in place
    sums = session.checksums(["w"])
    assert sums["tp_rank"] == 0 and sums["tp_size"] == 1 and list(sums["params"]) == ["w"]
    metrics = session.metrics()
    assert metrics["state"]["version"] == 2 and metrics["state"]["joined"]
    # A LoRA adapter update goes to the store's loader; base weights and version stay.
    spec = AdapterSpec("A", 1, 4, 8.0, ["q_proj"])
    lora = {"base_model.model.q.lora_A.weight": torch.randn(4, 8)}
    summary = first.push(session, 7, lora, adapter=spec)
    assert summary["ok"] and summary["adapter"] == "A" and summary["version"] == 2, summary
    assert summary["load"] == {"in_place": 0, "registered": 1}, summary
    assert torch.equal(stores[0].got["A"]["base_model.model.q.lora_A.weight"],
                       lora["base_model.model.q.lora_A.weight"])
    assert session.adapters() == {"A": {"version": 7, "tensors": 1}}
    assert session.report()["adapters"] == {"A": 7}
    # A re-join (a new trainer) keeps what the worker holds, and the same adapter store.
    second = trainers()
    second.join(session, Placement(1), ModuleLoader(model))
    assert session.report()["version"] == 2 and session.report()["adapters"] == {"A": 7}
    summary = second.push(session, 3, tensors(3))
    assert summary["ok"] and summary["version"] == 3, summary
    assert len(stores) == 1 and session.report()["updates"] == 3
    session.close()
    assert not session.report()["joined"] and session.report()["version"] == 3
