"""Updates around vLLM's sleep mode, on the one engine session (CPU, gloo, real ZeroMQ sockets).

A torch module stands in for the engine's model; what vLLM's `Worker.sleep`/`wake_up`/
`discard`/`reset_weights`/`reload_weights` record is recorded here through the same
`integrations.vllm.patches.sleep` wrappers, on a stand-in worker class (the real engine's test is in
`test_vllm_engine.py`, the GPU one with real sleep levels in `test_gpu_sleep.py`). The promises:
nothing is written into weights that are asleep, and an engine whose memory sleeps is neither
paused nor resumed by an update (only its prefix cache reset); after the weights were discarded the engine
says it is inconsistent, and only an update that rewrites every weight commits (a state dict
missing one is refused before a byte moves, a stream missing one at the commit, in place and
staged); then it is consistent again; a reload from the checkpoint holds version -1.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.session_engine import SessionEngine, driven, same
from vllm_nccl_sync import PushError, UpdateRefused
from vllm_nccl_sync.engine.handshake import Reference
from vllm_nccl_sync.engine.loaders import ModuleLoader
from vllm_nccl_sync.integrations.vllm.patches.sleep import RECORDS, watch

TIMEOUT = 20.0  # a bound on every wait, never a speed requirement


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(300, 64, generator=g),  # larger than one bucket
            "norm": torch.randn(33, generator=g), "head": torch.randn(8, 64, generator=g)}


class Worker:
    """What vLLM's worker offers, over a plain module: the methods the patch wraps."""

    def __init__(self) -> None:
        self.model = torch.nn.Module()
        for n, t in tensors(0).items():
            self.model.register_parameter(n, torch.nn.Parameter(t.clone(), False))
        self.model_runner = self
        self.calls: list[str] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep {level}")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake {tags}")

    def discard(self, tags: tuple[str, ...]) -> None:
        self.calls.append(f"discard {tags}")

    def reset_weights(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()

    def reload_weights(self, weights_iterator: Any = None, weights_path: str | None = None) -> None:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(tensors(0)[n])


assert watch(Worker) == list(RECORDS)  # the patch's own wrappers, as on vLLM's Worker


class LocalEngine(SessionEngine):
    """An in-process engine of one worker, over `Worker`'s module, checked against its shapes."""

    def __init__(self) -> None:
        self.worker = Worker()
        super().__init__(self.worker.model, ModuleLoader,
                         Reference({n: ("float32", list(t.shape)) for n, t in tensors(0).items()}))
        self.events: list[str] = []

    def pause(self, mode: str) -> None:
        self.events.append("pause")

    def resume(self) -> None:
        self.events.append("resume")

    def reset_prefix_cache(self) -> None:
        self.events.append("reset")

    def held(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


@pytest.fixture
def engine():
    e = LocalEngine()
    with driven(e, TIMEOUT) as sync:
        yield e, sync


def state(e: LocalEngine) -> dict[str, Any]:
    return e.session.report()


def test_nothing_is_written_into_weights_asleep(engine):
    e, sync = engine
    sync.update(tensors(1), 1)
    e.worker.sleep(1)
    assert state(e)["asleep"] == ["kv_cache", "weights"] and state(e)["consistent"]
    with pytest.raises(UpdateRefused, match=r"asleep \(vLLM sleep level 1\).*wake_up"):
        sync.update(tensors(2), 2)
    with pytest.raises(RuntimeError, match="asleep"):
        e.session.checksums()
    e.worker.wake_up(["weights"])  # level 1 keeps the weights: an update may follow at once
    assert state(e)["asleep"] == ["kv_cache"]
    e.events.clear()
    sync.update(tensors(2), 2)
    assert same(e.held(), tensors(2)) and state(e)["version"] == 2 and state(e)["consistent"]
    sync.update(tensors(3), 3, beside=True)
    assert same(e.held(), tensors(3)) and state(e)["version"] == 3
    # the KV cache still asleep: neither update paused or resumed the engine (a resumed engine
    # would step before `wake_up(tags=["kv_cache"])`), each reset its prefix cache
    assert e.events == ["reset", "reset"]
    e.worker.wake_up(None)
    assert state(e)["asleep"] == [] and e.worker.calls == ["sleep 1", "wake ['weights']",
                                                           "wake None"]
    sync.update(tensors(4), 4)
    assert e.events[2:] == ["pause", "resume"]


@pytest.mark.parametrize("staged", [False, True])
def test_after_level_2_only_an_update_of_every_weight_commits(engine, staged):
    e, sync = engine
    sync.update(tensors(1), 1)
    e.worker.sleep(2)
    e.worker.wake_up(["weights"])
    st = state(e)
    assert not st["consistent"] and "sleep(level=2) discarded" in st["discarded"]
    assert st["version"] == 1  # what it last held, now inconsistent
    partial = {k: v for k, v in tensors(2).items() if k != "norm"}
    before = e.held()
    with pytest.raises(UpdateRefused, match="every weight must be rewritten.*misses 1 tensors: norm"):
        sync.update(partial, 2, staged=staged)  # refused before a byte moves
    assert same(e.held(), before) and not state(e)["consistent"]
    # a stream announces no tensor list: the commit is refused instead
    with pytest.raises(PushError, match="refused to commit update 2.*misses 1 tensors: norm"):
        sync.update(iter(partial.items()), 2, staged=staged)
    st = state(e)
    assert not st["consistent"] and st["version"] == 1 and st["discarded"]
    sync.update(iter(tensors(3).items()), 3, staged=staged)  # every weight: commits
    st = state(e)
    assert st["consistent"] and st["version"] == 3 and st["discarded"] == ""
    assert same(e.held(), tensors(3))
    sync.update({"norm": tensors(4)["norm"]}, 4)  # partial updates are fine again
    assert state(e)["version"] == 4 and state(e)["consistent"]


def test_a_loader_that_writes_nothing_into_a_parameter_is_refused_at_commit(engine):
    e, sync = engine
    e.worker.reset_weights()  # vLLM 0.32's weight checker "reset": zeroed, as if discarded
    assert "reset_weights zeroed" in state(e)["discarded"] and not state(e)["consistent"]
    real = ModuleLoader.load

    def skips_norm(self, named):  # names the tensor, writes nothing into it
        return real(self, [(n, t) for n, t in named if n != "norm"])

    ModuleLoader.load = skips_norm
    try:
        with pytest.raises(PushError, match="loaders wrote nothing into 1 parameter.*norm"):
            sync.update(tensors(1), 1)
    finally:
        ModuleLoader.load = real
    assert not state(e)["consistent"]
    sync.update(tensors(1), 1)
    assert state(e)["consistent"] and same(e.held(), tensors(1))


def test_discard_and_reload(engine):
    e, sync = engine
    sync.update(tensors(1), 1)
    e.worker.discard(("weights",))
    st = state(e)
    assert st["asleep"] == ["weights"] and "discard" in st["discarded"] and not st["consistent"]
    e.worker.wake_up(["weights"])
    e.worker.reload_weights()  # from the checkpoint: the default weights
    st = state(e)
    assert st["consistent"] and st["version"] == -1 and st["discarded"] == ""
    assert same(e.held(), tensors(0))
    sync.update(tensors(2), 2)
    e.worker.reload_weights(iter(tensors(5).items()))  # weights no update pushed
    st = state(e)
    assert not st["consistent"] and "reload_weights" in st["discarded"]
    e.worker.reload_weights()
    assert state(e)["version"] == -1 and state(e)["consistent"]
    e.worker.reload_weights(weights_path="another-checkpoint")  # not the engine's own
    assert not state(e)["consistent"]
