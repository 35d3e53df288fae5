"""vLLM on Ray: a real CPU engine with `distributed_executor_backend="ray"` and TP=2 receives
updates through the worker extension and through vLLM's weight-transfer API (`nccl_sync`).

The test starts its own local Ray cluster and stops it in a `finally`. The engine's two workers
are Ray actors (processes of the cluster, not of this test). For the extension the trainer is a
Ray actor too and binds the address of the node Ray gave it, not loopback; each worker reports
the rank it joined as and the node and address it joined from. Afterwards greedy output equals
transformers' with the pushed weights.

Before the engine starts, every port its rendezvous can draw holds the CPU segments a stopped
engine would have left (vLLM creates its own with `O_EXCL`): it starts anyway, its workers'
segments in place of the empty ones left.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from vllm_nccl_sync.integrations.vllm.ext import Ext
from vllm_nccl_sync.tiny import PROMPTS, build_model, engine_kwargs, hf_greedy, make_model

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.vllm
MAX_TOKENS = 8
TP = 2
TIMEOUT_S = 60.0  # an upper bound on every wait, never a speed requirement
SEGMENT = "/dev/shm/{ident}-tp:0-[0-1]-cpushm_{rank}"
"""vLLM CPU's TP segment of each rank of a TP=2 engine whose rendezvous is `ident`."""


@ray.remote(num_cpus=0)
class Trainer:
    """The trainer as a Ray actor: it binds the address of the node Ray placed it on."""

    def config(self, world_size: int) -> dict:
        from vllm_nccl_sync.trainer.sync import free_port

        host = ray.util.get_node_ip_address()
        return dict(host=host, control_port=free_port(host), group_port=free_port(host),
                    world_size=world_size, bucket_bytes=64 * 1024, timeout_s=TIMEOUT_S)

    def push(self, cfg: dict, seed: int) -> dict:
        """Push seed's weights as version `seed`; what it pushed."""
        from vllm_nccl_sync import PushClient, SyncConfig

        client = PushClient(SyncConfig(**cfg))
        try:
            client.connect()
            res = client.push(build_model("qwen2", seed).state_dict(), version=seed)
        finally:
            client.close()
        return {"bytes": res.bytes, "acks": len(res.acks), "pid": os.getpid()}


class RayProbeExt(Ext):
    """`vllm_nccl_sync.Ext` plus a probe of where each worker runs."""

    def nccl_test_where(self, trainer_host: str) -> dict:
        """This worker's process, Ray node, and the address it routes to the trainer from (the
        address its data plane binds)."""
        import ray

        from vllm_nccl_sync.planes.rendezvous import local_address

        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(),
                "in_actor": ctx.get_actor_id() is not None,
                "local_address": local_address(trainer_host),
                "dist_ident": os.environ.get("VLLM_DIST_IDENT")}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of this test's own (2 CPUs, small object store), always shut down."""
    import ray

    engine_kwargs()  # the workers inherit its environment from the cluster: set it first
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live under it
    old = os.environ.get("RAY_ADDRESS")
    try:
        ctx = ray.init(num_cpus=TP, _temp_dir=tmp, include_dashboard=False,
                       object_store_memory=100 * 1024 * 1024, configure_logging=False)
        os.environ["RAY_ADDRESS"] = ctx.address_info["gcs_address"]  # the engine core joins it
        yield ray.util.get_node_ip_address()
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def stale_segments():
    """An empty segment under every port of this host's ephemeral range, as a Ray engine stopped
    by `ray.kill` leaves them; removed afterwards where still empty."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = map(int, f.read().split())
    seeded = []
    try:
        for port in range(lo, hi + 1):
            for rank in range(TP):
                path = SEGMENT.format(ident=port, rank=rank)
                try:
                    open(path, "xb").close()
                    seeded.append(path)
                except FileExistsError:
                    continue
        yield
    finally:
        for path in seeded:
            if os.path.exists(path) and os.path.getsize(path) == 0:
                os.unlink(path)


@pytest.fixture(scope="module")
def engine(ray_cluster, stale_segments, tmp_path_factory):
    """A TP=2 engine on Ray with both front doors: the extension and the `nccl_sync` backend."""
    from vllm import LLM

    os.environ.setdefault("VLLM_ENGINE_READY_TIMEOUT_S", "300")
    path = make_model(str(tmp_path_factory.mktemp("qwen2")), "qwen2", seed=1)
    llm = LLM(model=path, worker_extension_cls="tests.engine.test_ray.RayProbeExt",
              weight_transfer_config={"backend": "nccl_sync"},
              **engine_kwargs(tensor_parallel_size=TP, distributed_executor_backend="ray"))
    try:
        yield ray_cluster, llm
    finally:
        llm.llm_engine.engine_core.shutdown()  # the Ray actors go now, not at exit
        del llm


def generate(llm) -> list[list[int]]:
    from vllm_nccl_sync.tiny import vllm_greedy

    return vllm_greedy(llm, PROMPTS, MAX_TOKENS)


def test_ray_engine_uses_ray_workers(engine):
    node_ip, llm = engine
    pc = llm.llm_engine.vllm_config.parallel_config
    assert pc.distributed_executor_backend == "ray" and pc.world_size == TP
    workers = llm.collective_rpc("nccl_test_where", args=(node_ip,), timeout=60)
    assert len(workers) == TP and len({w["pid"] for w in workers}) == TP
    assert all(w["in_actor"] and w["node_ip"] == node_ip for w in workers), workers
    assert os.getpid() not in {w["pid"] for w in workers}
    # The rendezvous' port had a leftover segment per rank: the workers' own replaced them.
    (ident,) = {w["dist_ident"] for w in workers}
    assert all(os.path.getsize(SEGMENT.format(ident=ident, rank=r)) > 0 for r in range(TP))


def test_update_through_extension(engine):
    node_ip, llm = engine
    trainer = Trainer.remote()
    try:
        world_size = 1 + llm.llm_engine.vllm_config.parallel_config.world_size
        cfg = ray.get(trainer.config.remote(world_size), timeout=120)
        assert cfg["host"] == node_ip and not node_ip.startswith("127."), cfg
        expected = hf_greedy(build_model("qwen2", seed=2), PROMPTS, MAX_TOKENS)
        assert generate(llm) != expected
        pushed_ref = trainer.push.remote(cfg, 2)
        try:
            joined = llm.collective_rpc("nccl_sync_join", timeout=TIMEOUT_S + 30, args=(cfg, 1))
            where = llm.collective_rpc("nccl_test_where", args=(cfg["host"],), timeout=60)
            summaries = llm.collective_rpc("nccl_sync_receive", timeout=TIMEOUT_S * 3,
                                           args=(TIMEOUT_S,))
            pushed = ray.get(pushed_ref, timeout=TIMEOUT_S * 2)
            state = llm.collective_rpc("nccl_sync_state", timeout=60)
        finally:
            llm.collective_rpc("nccl_sync_close", timeout=60)
    finally:
        ray.kill(trainer)

    # Ranks come from the workers: vLLM's rank of each actor, offset past the trainer.
    assert [j["rank"] for j in joined] == [1, 2], joined
    assert [j["tp_rank"] for j in joined] == [0, 1] and {j["tp_size"] for j in joined} == {TP}
    # ...and addresses too: each joined from its node's routed address, not from loopback.
    assert all(w["local_address"] == node_ip for w in where), where
    assert [j["host"] for j in joined] == [node_ip] * TP, joined  # each worker says where it is
    assert pushed["pid"] not in {w["pid"] for w in where} | {os.getpid()}
    assert all(s["ok"] and s["version"] == 2 and s["consistent"] for s in summaries), summaries
    assert pushed["acks"] == TP and all(s["bytes"] == pushed["bytes"] for s in state)
    assert [s["rank"] for s in state] == [1, 2]
    llm.reset_prefix_cache()
    assert generate(llm) == expected


def test_update_through_vllm_weight_transfer_api(engine):
    """vLLM's own calls only (trainer factory, `ModuleSource`, the in-process `LLM`)."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from vllm_nccl_sync.weight_transfer import NcclSyncTrainerInitInfo

    node_ip, llm = engine
    new = build_model("qwen2", seed=3)
    expected = hf_greedy(new, PROMPTS, MAX_TOKENS)
    assert generate(llm) != expected
    info = NcclSyncTrainerInitInfo(
        world_size=1 + llm.llm_engine.vllm_config.parallel_config.world_size, rank=0,
        host=node_ip, timeout_s=TIMEOUT_S, bucket_bytes=64 * 1024)
    engine_ = WeightTransferTrainerFactory.trainer_init(info, client=llm,
                                                        source=ModuleSource(new))
    try:
        result = engine_.send_weights()
    finally:
        engine_.shutdown()
    assert len(result.acks) == TP
    assert llm.get_weight_version() == str(result.version)
    llm.reset_prefix_cache()
    assert generate(llm) == expected
