"""verl checkpoint-engine backend, driven the way verl's `CheckpointEngineManager` drives it.

Per update: `prepare()` on every worker, the class's `build_topology(...)`, `init_process_group`
on every worker, `send_weights(generator)` on the actors, `receive_weights()` on the rollout
workers, `finalize()`. Four members in three processes, over gloo and real ZeroMQ sockets:

  actor 0     the backend as verl creates it on the trainer (`is_master=True`): `PushClient`
  actor 1     a non-master actor (this process): drains its generator, sends nothing
  rollout 1   the backend as verl's `CheckpointEngineWorker` creates it: `receive_weights()`
  engine 2    a plain `Receiver` + `ModuleLoader` (what `vllm_nccl_sync.Ext` runs in a vLLM worker)

`via_registry=True` looks the class up in verl's own `CheckpointEngineRegistry` (needs verl: run
in a venv with verl 0.9.1, see patches/verl/README.md); `False` uses the class directly, so CI,
whose venv has vLLM but not verl, still exercises the backend.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import queue
import time
import traceback

import pytest
import torch

pytestmark = pytest.mark.multiproc
DEADLINE = 120
BUCKET = 16 * 1024
ROUNDS = [1, 2, 3]  # 3: a tensor the engine does not have -> the update fails on every side


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(300, 64, dtype=torch.bfloat16)  # 38 KB: over a bucket
        self.proj = torch.nn.Linear(64, 48, dtype=torch.float16)
        self.norm = torch.nn.LayerNorm(48)


@torch.no_grad()
def tiny(seed: int) -> Tiny:
    m = Tiny()
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
    return m


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def digests(model: torch.nn.Module) -> dict[str, str]:
    return {n: digest(p) for n, p in model.named_parameters()}


def weights(version: int):
    """verl's `get_per_tensor_param()`: a generator of full tensors."""
    if version == 3:
        yield "bogus.weight", torch.ones(8)
    yield from ((n, p.detach()) for n, p in tiny(seed=version).named_parameters())


def engine_class(via_registry: bool):
    if via_registry:
        from verl.checkpoint_engine import CheckpointEngineRegistry

        import vllm_nccl_sync.integrations.verl  # noqa: F401  (verl's custom_backend_module)

        return CheckpointEngineRegistry.get("vllm_nccl_sync"), CheckpointEngineRegistry.new
    from vllm_nccl_sync.integrations.verl import VllmNcclSyncCheckpointEngine as cls

    return cls, lambda name, **kw: cls(**kw)


def member(role: str, via_registry: bool, inbox, outbox) -> None:
    """One worker: per round, report `prepare()`, take its topology kwargs, join, transfer."""
    from vllm_nccl_sync.engine.loaders import ModuleLoader
    from vllm_nccl_sync.engine.receiver import Receiver
    from vllm_nccl_sync.wire.config import SyncConfig

    try:
        _, new = engine_class(via_registry)
        if role == "actor0":
            eng = new("vllm_nccl_sync", is_master=True, bucket_size=BUCKET, transport="gloo",
                      host="127.0.0.1", timeout_s=30.0)
        elif role == "rollout1":
            eng = new("vllm_nccl_sync", bucket_size=BUCKET, transport="gloo", timeout_s=30.0)
        model, rx = tiny(seed=0), None
        for version in ROUNDS:
            outbox.put(("meta", role, eng.prepare() if role != "engine2" else {"master": None}))
            kwargs = inbox.get(timeout=DEADLINE)
            out: dict = {"version": version}
            if role == "engine2":
                cfg = SyncConfig.from_dict(kwargs["cfg"])
                if rx is None or rx.cfg != cfg:
                    rx = Receiver(cfg, kwargs["rank"])
                s = rx.receive(ModuleLoader(model), timeout_s=30)
                out.update(ok=s["ok"], error=s.get("error", ""), digests=digests(model))
            else:
                eng.init_process_group(**kwargs)
                try:
                    if role == "actor0":
                        out["metrics"] = asyncio.run(eng.send_weights(weights(version), version))
                    else:
                        loader = ModuleLoader(model)  # verl's server adapter would load them

                        async def consume(version: int, loader: ModuleLoader) -> list[str]:
                            names = []
                            async for name, t in eng.receive_weights(global_steps=version):
                                names.append(name)
                                if name in loader.targets:
                                    loader.load([(name, t)])
                            return names

                        out["names"] = asyncio.run(consume(version, loader))
                    out.update(ok=True, digests=digests(model), connects=eng.connects)
                except Exception as e:
                    out.update(ok=False, error=f"{type(e).__name__}: {e}")
                eng.finalize()
            outbox.put(("done", role, out))
    except BaseException:
        outbox.put(("crash", role, traceback.format_exc()))


def run_update(via_registry: bool) -> dict[str, list[dict]]:
    """The manager (this process, also actor 1): topology per round, results of every member."""
    cls, new = engine_class(via_registry)
    actor1 = new("vllm_nccl_sync", is_master=False, bucket_size=BUCKET, transport="gloo")
    ctx = mp.get_context("spawn")
    roles = ["actor0", "rollout1", "engine2"]
    inboxes = {r: ctx.Queue() for r in roles}
    outbox = ctx.Queue()
    procs = [ctx.Process(target=member, args=(r, via_registry, inboxes[r], outbox), daemon=True)
             for r in roles]
    for p in procs:
        p.start()
    results: dict[str, list[dict]] = {r: [] for r in roles + ["actor1"]}
    end = time.monotonic() + DEADLINE

    early: list[tuple] = []  # a member may report its next round's meta before others are done

    def take(kind: str) -> dict[str, object]:
        got = {role: val for k, role, val in early if k == kind}
        early[:] = [m for m in early if m[0] != kind]
        while len(got) < len(roles):
            try:
                k, role, val = outbox.get(timeout=max(end - time.monotonic(), 0.1))
            except queue.Empty:
                raise AssertionError(f"members {set(roles) - set(got)} silent at {kind}") from None
            if k == "crash":
                raise AssertionError(f"{role} crashed:\n{val}")
            if k == kind:
                got[role] = val
            else:
                early.append((k, role, val))
        return got

    try:
        for version in ROUNDS:
            meta = take("meta")
            # verl's order: actor workers first, then the rollout workers
            metadata = [meta["actor0"], actor1.prepare(), meta["rollout1"], meta["engine2"]]
            actor_kw, rollout_kw = cls.build_topology(2, 2, metadata)
            assert actor_kw["rank"] == [0, -1] and rollout_kw["rank"] == [1, 2]
            inboxes["actor0"].put({k: v[0] for k, v in actor_kw.items()})
            inboxes["rollout1"].put({k: v[0] for k, v in rollout_kw.items()})
            inboxes["engine2"].put({k: v[1] for k, v in rollout_kw.items()})
            actor1.init_process_group(**{k: v[1] for k, v in actor_kw.items()})
            drained = []
            gen = ((drained.append(n), (n, t))[1] for n, t in weights(version))
            results["actor1"].append({"metrics": asyncio.run(actor1.send_weights(gen, version)),
                                      "drained": len(drained)})
            for role, out in take("done").items():
                results[role].append(out)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    return results


@pytest.mark.parametrize("via_registry", [True, False], ids=["verl-registry", "direct"])
def test_verl_backend_pushes_to_verl_rollout_and_plain_receiver(via_registry):
    if via_registry:
        pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed in this venv")
    res = run_update(via_registry)
    for i, version in enumerate(ROUNDS[:2]):
        want = digests(tiny(seed=version))
        a0, r1, e2 = res["actor0"][i], res["rollout1"][i], res["engine2"][i]
        assert a0["ok"] and r1["ok"] and e2["ok"], (a0, r1, e2)
        assert r1["digests"] == want and e2["digests"] == want  # bit-identical on both kinds
        assert r1["names"] == list(want)
        payload = sum(t.numel() * t.element_size() for t in tiny(seed=version).parameters())
        m = a0["metrics"]
        assert payload <= m["vllm_nccl_sync/bytes"] < payload + 64 * 16
        assert m["vllm_nccl_sync/buckets"] >= 3  # the embedding alone spans several buckets
        assert res["actor1"][i] == {"metrics": {}, "drained": len(want)}
        assert a0["connects"] == 1 and r1["connects"] == 1  # the group is kept across updates
    # Round 3: engine 2 refuses an unknown tensor; every side reports the failed update.
    a0, r1, e2 = res["actor0"][2], res["rollout1"][2], res["engine2"][2]
    assert not a0["ok"] and "bogus.weight" in a0["error"], a0
    assert not e2["ok"] and "bogus.weight" in e2["error"], e2
    assert not r1["ok"] and "update failed" in r1["error"], r1


def test_build_topology_keeps_or_replaces_the_group():
    from vllm_nccl_sync.integrations.verl import VllmNcclSyncCheckpointEngine as cls

    fresh = {"host": "127.0.0.1", "control_port": 1001, "group_port": 1002, "world_size": 2}
    held = {**fresh, "control_port": 2001, "group_port": 2002, "world_size": 3}
    meta = [{"master": {"fresh": fresh, "held": held}}, {"master": None}]
    actor, rollout = cls.build_topology(1, 2, meta + [{"master": None}])
    assert actor["rank"] == [0] and rollout["rank"] == [1, 2]
    assert actor["cfg"][0] == held  # same size: the connected group is reused
    actor, rollout = cls.build_topology(1, 3, meta + [{"master": None}] * 2)
    assert actor["cfg"][0] == {**fresh, "world_size": 4} == rollout["cfg"][2]
    with pytest.raises(ValueError, match="master"):
        cls.build_topology(1, 1, [{"master": None}, {"master": None}])


def test_actor0_updates_its_own_ext_engines_beside_the_push():
    """Actor rank 0 handed `EngineHandle`s of `Ext` engines: their workers take the ranks after
    verl's rollout workers, join with the group and receive beside every push; a refusal comes
    back as the push's own error, carrying the engines' reports."""
    from tests.engine_procs import ProcEngine
    from vllm_nccl_sync import UpdateRefused
    from vllm_nccl_sync.integrations.verl import VllmNcclSyncCheckpointEngine as cls

    ext = ProcEngine()
    master = cls(is_master=True, bucket_size=BUCKET, transport="gloo", host="127.0.0.1",
                 timeout_s=30.0, rebuild_group=True, engines=[ext])
    try:
        actor, rollout = cls.build_topology(1, 0, [master.prepare()])
        assert actor["rank"] == [0] and rollout["rank"] == []
        assert actor["cfg"][0]["world_size"] == 2  # the trainer + the engine's worker
        master.init_process_group(rank=0, cfg=actor["cfg"][0])
        metrics = asyncio.run(master.send_weights(weights(1), 1))
        assert metrics["vllm_nccl_sync/buckets"] >= 3
        [held] = ext.call("digests", timeout=DEADLINE)
        assert {n: d for n, (d, _) in held.items()} == digests(tiny(seed=1))
        with pytest.raises(UpdateRefused) as e:
            asyncio.run(master.send_weights(weights(2), 1))  # not newer than what it holds
        assert [(s.rank, s.ok) for s in e.value.summaries] == [(1, False)]
        assert "rank 1 refused update 1: it holds version 1" in str(e.value)
        master.finalize()
    finally:
        ext.stop()


def test_a_bad_value_is_refused_at_construction_naming_the_argument():
    from vllm_nccl_sync.integrations.verl.checkpoint_engine import VllmNcclSyncCheckpointEngine
    from vllm_nccl_sync.wire.config import SyncConfig

    with pytest.raises(ValueError, match=r"^VllmNcclSyncCheckpointEngine\.bucket_size: "
                                         r"SyncConfig\.bucket_bytes=100: "):
        VllmNcclSyncCheckpointEngine(100)
    with pytest.raises(ValueError, match=r"^VllmNcclSyncCheckpointEngine\.transport: "
                                         r"SyncConfig\.backend='tcp'"):
        VllmNcclSyncCheckpointEngine(BUCKET, transport="tcp")
    with pytest.raises(ValueError, match=r"^VllmNcclSyncCheckpointEngine\.shard: "
                                         r"SyncConfig\.shard='yes'"):
        VllmNcclSyncCheckpointEngine(BUCKET, transport="gloo", shard="yes")
    sharded = VllmNcclSyncCheckpointEngine(BUCKET, is_master=True, transport="gloo", shard=True)
    assert sharded.sync_config("127.0.0.1").shard is True
    with pytest.raises(ValueError, match="verl's 1 rollout worker.* publish no read set"):
        VllmNcclSyncCheckpointEngine.build_topology(1, 1, [sharded.prepare()])
    ce = VllmNcclSyncCheckpointEngine(BUCKET, is_master=True, transport="gloo", timeout_s=9.0)
    cfg = ce.sync_config("127.0.0.1")
    assert cfg == SyncConfig.build(host="127.0.0.1", world_size=2, backend="gloo",
                                   bucket_bytes=BUCKET, timeout_s=9.0, secret=cfg.secret,
                                   control_port=cfg.control_port, group_port=cfg.group_port)
    assert len(cfg.secret) == 32 and cfg.shard is False
