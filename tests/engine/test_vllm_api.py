"""vLLM's own RL weight-sync API in front of this project: backend `nccl_sync`.

The trainer code here (`trainer_for`) uses only vLLM's API (`WeightTransferTrainerFactory`,
`ModuleSource`, vLLM's clients and routes) plus the backend's init info; no `WeightSync`, no
`PushClient`. It updates (a) an offline `LLM(weight_transfer_config={"backend": "nccl_sync"})` and
(b) a `vllm serve` process through its RL HTTP routes, both real vLLM CPU engines over gloo.
Afterwards greedy output equals transformers' with the pushed weights and vLLM's weight version is
the pushed version (over gloo, and offline also over the shared-memory plane that colocated
trainers use, chosen by the init info's `transport`); a model with a wrong shape is refused before any byte moves, through vLLM's
API, with this project's message, and the engine keeps serving what it had.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from vllm_nccl_sync.tiny import (
    PROMPTS,
    build_model,
    engine_kwargs,
    hf_greedy,
    make_model,
    start_server,
)

pytestmark = pytest.mark.vllm
MAX_TOKENS = 8
TIMEOUT_S = 60.0  # an upper bound on every wait, never a speed requirement
WRONG = "model.layers.0.mlp.gate_proj.weight"


def wrong_model(arch: str, seed: int) -> torch.nn.Module:
    """A model whose `WRONG` tensor has 300 rows instead of the engine's 256."""
    model = build_model(arch, seed)
    mlp = model.model.layers[0].mlp
    mlp.gate_proj.weight = torch.nn.Parameter(torch.zeros(300, mlp.gate_proj.weight.shape[1]))
    return model


def trainer_for(client, model: torch.nn.Module, world_size: int, transport: str = "auto"):
    """The trainer's whole integration: vLLM's trainer factory, vLLM's `ModuleSource`, and the
    backend's init info (its `backend` ClassVar, "nccl_sync", selects the backend; `transport`
    the data plane)."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from vllm_nccl_sync.weight_transfer import NcclSyncTrainerInitInfo

    info = NcclSyncTrainerInitInfo(world_size=world_size, rank=0, timeout_s=TIMEOUT_S,
                                   bucket_bytes=64 * 1024,  # small buckets: many, and chunking
                                   transport=transport)
    return WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                     source=ModuleSource(model))


def assert_refused_with_our_message(text: str, version: int) -> None:
    # vLLM's words: the worker's error came back through vLLM's collective RPC
    assert f"Worker failed with error 'nccl_sync: update {version} failed on rank 1" in text, text
    assert f"refused update {version}:" in text, text  # the plan stage: before any byte moved
    assert f"tensor '{WRONG}': shape [300, 128] != engine's [256, 128]" in text, text


# ---------------------------------------------------------------------------- offline LLM


def generate(llm) -> list[list[int]]:
    from vllm_nccl_sync.tiny import vllm_greedy

    return vllm_greedy(llm, PROMPTS, MAX_TOKENS)


def test_offline_llm_through_vllm_api(tmp_path):
    """`LLM` in this process; the backend runs vLLM's blocking `update_weights` in a side
    thread while the trainer pushes from this one (what vLLM's API requires of an in-process
    engine)."""
    from vllm import LLM

    path = make_model(str(tmp_path / "qwen2"), "qwen2", seed=1)
    llm = LLM(model=path, weight_transfer_config={"backend": "nccl_sync"}, **engine_kwargs())
    try:
        world_size = 1 + llm.llm_engine.vllm_config.parallel_config.world_size
        new = build_model("qwen2", seed=2)
        expected = hf_greedy(new, PROMPTS, MAX_TOKENS)
        assert generate(llm) != expected  # the push below is what changes the output

        trainer = trainer_for(llm, new, world_size)
        result = trainer.send_weights()
        llm.reset_prefix_cache()  # its KV came from the old weights
        assert generate(llm) == expected
        assert llm.get_weight_version() == str(result.version) == "1"
        trainer.shutdown()

        # A restarted trainer goes on from vLLM's weight version; a wrong model is refused.
        bad = trainer_for(llm, wrong_model("qwen2", seed=3), world_size)
        with pytest.raises(Exception) as refused:
            bad.send_weights()
        assert_refused_with_our_message(str(refused.value), 2)
        bad.shutdown()
        assert llm.get_weight_version() == "1"
        llm.reset_prefix_cache()
        assert generate(llm) == expected  # nothing moved

        # A bf16 trainer into this fp32 engine, with nothing but vLLM's API and the init info:
        # the trainer casts to the dtype the engine announced (faithful), and says so.
        half = build_model("qwen2", seed=4).to(torch.bfloat16)
        want = hf_greedy(build_model("qwen2", seed=4).to(torch.bfloat16).float(), PROMPTS,
                         MAX_TOKENS)
        cast = trainer_for(llm, half, world_size)
        result = cast.send_weights()
        cast.shutdown()
        assert result.version == 2 and result.cast == {"bfloat16": "float32"}, result
        llm.reset_prefix_cache()
        assert generate(llm) == want

        # Colocated on this host: the shared-memory plane, chosen in the init info alone.
        local = build_model("qwen2", seed=5)
        shm = trainer_for(llm, local, world_size, transport="shm")
        result = shm.send_weights()
        shm.shutdown()
        assert result.version == 3, result
        llm.reset_prefix_cache()
        assert generate(llm) == hf_greedy(local, PROMPTS, MAX_TOKENS)
    finally:
        llm.llm_engine.engine_core.shutdown()  # the engine's processes go now, not at exit
        del llm


# ---------------------------------------------------------------------------- vllm serve (HTTP)


def test_served_engine_through_rl_http_routes(tmp_path):
    import requests
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    path = make_model(str(tmp_path / "qwen2"), "qwen2", seed=1)
    proc, url = start_server(path, str(tmp_path / "server.log"), args=[
        "--weight-transfer-config", json.dumps({"backend": "nccl_sync"})])

    def complete() -> list[list[int]]:
        out = []
        for p in PROMPTS:
            body = {"model": path, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            r = requests.post(url + "/v1/completions", json=body, timeout=180)
            r.raise_for_status()
            out.append(r.json()["choices"][0]["token_ids"])
        return out

    def weight_version() -> str:
        r = requests.get(url + "/weight_info", timeout=30)
        r.raise_for_status()
        return r.json()["weight_version"]

    try:
        client = HTTPVLLMWeightSyncClient(url)
        world_size = 1 + requests.get(url + "/get_world_size", timeout=30).json()["world_size"]
        new = build_model("qwen2", seed=2)
        expected = hf_greedy(new, PROMPTS, MAX_TOKENS)
        assert complete() != expected
        assert weight_version() == "default"

        trainer = trainer_for(client, new, world_size)
        requests.post(url + "/pause", timeout=60).raise_for_status()  # clears the prefix cache
        try:
            result = trainer.send_weights()
        finally:
            requests.post(url + "/resume", timeout=60).raise_for_status()
        assert weight_version() == str(result.version) == "1"
        assert complete() == expected
        trainer.shutdown()

        bad = trainer_for(client, wrong_model("qwen2", seed=3), world_size)
        with pytest.raises(Exception) as refused:
            bad.send_weights()
        text = str(refused.value)
        assert "HTTP 500" in text, text  # the route's answer, carrying the worker's message
        assert_refused_with_our_message(text, 2)
        bad.shutdown()
        assert weight_version() == "1"
        assert complete() == expected  # nothing moved, and the server still serves
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---------------------------------------------------------------------------- no engine


def whole_reads(module: torch.nn.Module):
    """The read set of a TP=1 worker holding `module`: every tensor, whole."""
    from vllm_nccl_sync.wire.packing import dtype_name
    from vllm_nccl_sync.wire.protocol import ReadSet
    from vllm_nccl_sync.wire.reads import whole

    return ReadSet(0, {n: whole(dtype_name(p.dtype), list(p.shape))
                       for n, p in module.named_parameters()})


class ModuleClient:
    """A `VLLMWeightSyncClient` whose "engine" is a torch module here: each call does what the
    `nccl_sync` worker does (join, publishing its read set for shard to shard; receive into the
    module), with vLLM 0.26's `finish_weight_update()` (no weight version)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.receiver = None
        self.finished = 0

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm_nccl_sync.engine.receiver import Receiver
        from vllm_nccl_sync.wire.config import SyncConfig

        cfg = SyncConfig.from_dict(init_info["sync_config"])
        self.receiver = Receiver(cfg, init_info["rank_offset"],
                                 reads=whole_reads(self.module) if cfg.shard else None)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        from vllm_nccl_sync.engine.loaders import ModuleLoader

        summary = self.receiver.receive(ModuleLoader(self.module), update_info["timeout_s"])
        if not summary["ok"] or summary["version"] != update_info["version"]:
            raise RuntimeError(summary.get("error") or summary)

    def finish_weight_update(self) -> None:
        self.finished += 1


def test_trainer_engine_under_vllm_026_calling_convention(monkeypatch):
    """vLLM 0.26's trainer factory calls `trainer_init(config=, init_info=, client=, source=)`
    and its clients take no weight version: the same engine class serves it."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import ModuleSource

    from vllm_nccl_sync import weight_transfer as wt
    from vllm_nccl_sync.integrations.vllm.transfer import trainer as transfer_trainer
    from vllm_nccl_sync.integrations.vllm.transfer.backend import Surface

    old = Surface("0.26.0", weight_version=False, trainer_backend_classvar=False)
    monkeypatch.setattr(wt, "SURFACE", old)
    monkeypatch.setattr(transfer_trainer, "SURFACE", old)  # what the trainer engine reads
    src = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    dst = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    client = ModuleClient(dst)
    info = wt.NcclSyncTrainerInitInfo(world_size=2, rank=0, timeout_s=TIMEOUT_S, bucket_bytes=256)
    engine = wt.NcclSyncTrainerEngine.trainer_init(
        config=WeightTransferConfig(backend="nccl_sync"), init_info=info, client=client,
        source=ModuleSource(src))
    try:
        for step in (1, 2):
            with torch.no_grad():
                for p in src.parameters():
                    p.add_(1.0)
            assert engine.send_weights().version == step
            assert client.finished == step
            for a, b in zip(src.parameters(), dst.parameters(), strict=True):
                assert torch.equal(a, b)
    finally:
        engine.shutdown()
        client.receiver.close()


class UnconfiguredClient(ModuleClient):
    """An engine started without `--weight-transfer-config`: vLLM refuses the init call."""

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        raise RuntimeError("Weight transfer not configured. Please set weight_transfer_config "
                           "to enable weight transfer.")


def test_engine_side_init_failure_is_what_the_trainer_reports():
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from vllm_nccl_sync.weight_transfer import NcclSyncTrainerInitInfo, WeightTransferFailed

    src = torch.nn.Linear(4, 4)
    info = NcclSyncTrainerInitInfo(world_size=2, rank=0, timeout_s=TIMEOUT_S)
    with pytest.raises(WeightTransferFailed, match="init_weight_transfer_engine failed: Weight "
                                                   "transfer not configured"):
        WeightTransferTrainerFactory.trainer_init(info, client=UnconfiguredClient(src),
                                                  source=ModuleSource(src))


def test_unsupported_vllm_is_refused_by_name(monkeypatch):
    import vllm
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from vllm_nccl_sync.integrations.vllm.transfer import backend as guard

    guard.register()  # idempotent: the entry point already ran, or importing the backend did
    assert "nccl_sync" in WeightTransferEngineFactory._registry
    assert "nccl_sync" in WeightTransferTrainerFactory._registry
    monkeypatch.setattr(vllm, "__version__", "0.29.1")
    with pytest.raises(guard.UnsupportedVllm, match=r"supports vLLM 0\.26\.x, 0\.32\.x; found "
                                                    r"vLLM 0\.29\.1"):
        guard.check_version()


# ---------------------------------------------------------------------------- init info, casts


def test_init_info_takes_vllms_nccl_fields_with_their_meaning_here():
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from vllm_nccl_sync.weight_transfer import NcclSyncTrainerInitInfo as Info
    from vllm_nccl_sync.wire.config import SyncConfig

    info = Info(world_size=3, rank=0, master_address="10.0.0.1", master_port=29500,
                packed=False)  # always packed here: accepted either way
    assert (info.host, info.group_port, info.world_size) == ("10.0.0.1", 29500, 3)
    defaults = SyncConfig(control_port=1, group_port=2, world_size=2)
    assert (info.timeout_s, info.bucket_bytes) == (defaults.timeout_s, defaults.bucket_bytes)
    theirs = NCCLTrainerInitInfo(master_address="10.0.0.2", master_port=29501, world_size=2,
                                 rank=0)
    mine = Info.from_vllm(theirs, timeout_s=30.0)
    assert (mine.host, mine.group_port, mine.world_size, mine.timeout_s) == (
        "10.0.0.2", 29501, 2, 30.0)
    assert mine.bucket_bytes == theirs.packed_buffer_size_bytes
    assert Info.backend == "nccl_sync"  # vLLM's dispatch key; the data plane is `transport`
    with pytest.raises(ValueError, match=r"\['nccl_unique_id_b64'\] have no meaning for the "
                                         r"nccl_sync backend"):
        Info.from_vllm({"world_size": 2, "rank": 0, "nccl_unique_id_b64": "eA=="})
    with pytest.raises(ValueError, match="packed_num_buffers=3: the nccl_sync backend holds two"):
        Info(world_size=2, rank=0, packed_num_buffers=3)
    with pytest.raises(ValueError, match="master_port=1 and group_port=2 name the same setting"):
        Info(world_size=2, rank=0, master_port=1, group_port=2)
    with pytest.raises(ValueError, match="rank -1 must be >= 0"):
        Info(world_size=2, rank=-1)
    with pytest.raises(ValueError, match="transport 'tcp'"):
        Info(world_size=2, rank=0, transport="tcp")


class Fp32ModuleClient(ModuleClient):
    """A 0.32-style client (weight versions) whose engine holds float32 weights and has never
    taken an update (vLLM's label "default")."""

    label = "default"

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.finished += 1
        self.label = weight_version or self.label

    def get_weight_version(self) -> str:
        return self.label


@pytest.mark.parametrize("shard", [False, True], ids=["broadcast", "shard"])
def test_bf16_trainer_into_an_fp32_engine_through_vllms_api(monkeypatch, shard):
    """What a trainer written against vLLM's API does (bf16 weights, no dtype anywhere): the
    floating tensors are cast to the engine's float32 on the trainer, and the engine that never
    took an update ("default") gets version 1. With `shard`, the worker's read set reaches the
    trainer and a source that would stream is pushed as a state dict."""
    import msgspec
    from vllm.distributed.weight_transfer import ModuleSource

    from vllm_nccl_sync import weight_transfer as wt
    from vllm_nccl_sync.wire.channel import ReceiverChannel
    from vllm_nccl_sync.wire.protocol import Hello

    real = ReceiverChannel.send

    def send(self, msg, timeout_s: float = 5.0):  # the engine announces its dtype
        if isinstance(msg, Hello):
            msg = msgspec.structs.replace(msg, dtype="float32")
        return real(self, msg, timeout_s)

    monkeypatch.setattr(ReceiverChannel, "send", send)
    src = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    dst = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    client = Fp32ModuleClient(dst)
    info = wt.NcclSyncTrainerInitInfo(world_size=2, rank=0, timeout_s=TIMEOUT_S, bucket_bytes=256,
                                      shard=shard)
    source = wt.FSDPWeightSource(src) if shard else ModuleSource(src)  # the first would stream
    engine = wt.NcclSyncTrainerEngine.trainer_init(info, client=client, source=source)
    try:
        assert (engine.held, engine.version) == ("default", 0)
        assert (engine.push_client.reads is not None) is shard
        assert isinstance(engine._tensors(), dict)  # ModuleSource over plain parameters, or shard
        result = engine.send_weights()
        assert result.version == 1 and client.label == "1"
        assert result.cast == {"bfloat16": "float32"}
        assert result.bytes == sum(p.numel() * 4 for p in src.parameters())
        for a, b in zip(src.parameters(), dst.parameters(), strict=True):
            assert b.dtype == torch.float32 and torch.equal(a.float(), b)
    finally:
        engine.shutdown()
        client.receiver.close()


_ACTOR = """
import pickle, sys
import torch
info = pickle.loads(sys.stdin.buffer.read())  # imports the init info's module, nothing else
from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
engine = WeightTransferTrainerFactory.trainer_init(
    init_info=info, client=None, source=ModuleSource(torch.nn.Linear(2, 2)))
print(type(engine).__name__, sorted(m for m in sys.modules if m.startswith("vllm_nccl_sync.")))
"""


def test_a_process_that_only_unpickles_the_init_info_finds_the_backend():
    """vLLM's `examples/rl/rlhf_nccl.py`: the driver builds the init info, a Ray actor unpickles
    it (importing only its class's module, with no vLLM plugin loaded) and asks vLLM's trainer
    factory for the engine: the backend is found."""
    import pickle
    import subprocess
    import sys

    from vllm_nccl_sync.integrations.vllm.transfer.trainer import NcclSyncTrainerInitInfo

    info = NcclSyncTrainerInitInfo(master_address="127.0.0.1", master_port=1, world_size=2,
                                   rank=1)  # not the sender: nothing to join
    out = subprocess.run([sys.executable, "-c", _ACTOR], input=pickle.dumps(info),
                         capture_output=True, timeout=300, check=False,
                         env={**os.environ, "VLLM_PLUGINS": ""})
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    name, _, modules = out.stdout.decode().strip().splitlines()[-1].partition(" ")
    assert name == "NcclSyncTrainerEngine"
    assert "vllm_nccl_sync.weight_transfer" not in modules  # found without it


def test_init_infos_refuse_a_bad_value_where_it_was_written():
    from vllm_nccl_sync.integrations.vllm.transfer.engine import NcclSyncInitInfo
    from vllm_nccl_sync.weight_transfer import NcclSyncTrainerInitInfo as Info
    from vllm_nccl_sync.wire.config import SyncConfig

    with pytest.raises(ValueError, match=r"^NcclSyncTrainerInitInfo\.packed_buffer_size_bytes: "
                                         r"SyncConfig\.bucket_bytes=100: "):
        Info(world_size=2, rank=0, packed_buffer_size_bytes=100)
    with pytest.raises(ValueError, match=r"^NcclSyncTrainerInitInfo\.timeout_s: "
                                         r"SyncConfig\.timeout_s=0"):
        Info(world_size=2, rank=0, timeout_s=0)
    with pytest.raises(ValueError, match=r"^NcclSyncTrainerInitInfo\.world_size: "):
        Info(world_size=1, rank=0)
    with pytest.raises(ValueError, match=r"^NcclSyncTrainerInitInfo\.shard: "
                                         r"SyncConfig\.shard='yes'"):
        Info(world_size=2, rank=0, shard="yes")
    with pytest.raises(ValueError, match="shard=True pushes the source as a state dict"):
        Info(world_size=2, rank=0, shard=True, plan=False)
    sharded = Info(world_size=2, rank=0, transport="gloo", shard=True).sync_config()
    assert sharded.shard is True
    assert NcclSyncInitInfo(sync_config=sharded.to_dict()).config().shard is True
    info = Info(world_size=3, rank=0, master_address="10.0.0.1", master_port=29500,
                control_port=29501, transport="gloo", packed_buffer_size_bytes=1 << 20,
                timeout_s=7.0, secret="ab")
    assert info.sync_config() == SyncConfig.build(
        host="10.0.0.1", group_port=29500, control_port=29501, world_size=3, backend="gloo",
        bucket_bytes=1 << 20, timeout_s=7.0, secret="ab")
    with pytest.raises(ValueError, match=r"^NcclSyncInitInfo\.sync_config\['bucket_bytes'\]: "
                                         r"SyncConfig\.bucket_bytes=3: "):
        NcclSyncInitInfo(sync_config={**info.sync_config().to_dict(), "bucket_bytes": 3})
    with pytest.raises(ValueError, match=r"^NcclSyncInitInfo\.sync_config\['shard'\]: "):
        NcclSyncInitInfo(sync_config={**info.sync_config().to_dict(), "shard": "yes"})
    cfg = info.sync_config()
    assert NcclSyncInitInfo(sync_config=cfg.to_dict()).config() == cfg
    assert NcclSyncInitInfo(sync_config=cfg).config() == cfg
