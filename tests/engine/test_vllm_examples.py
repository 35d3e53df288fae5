"""vLLM 0.32's own RL examples, switched from vLLM's `nccl` backend to `nccl_sync` by the README's
diff alone, on real vLLM CPU engines.

The trainers here follow the call sequence of vLLM's examples (written here, not copied):

* `examples/rl/rlhf_http_nccl.py`: `vllm serve` (dev mode, `--weight-transfer-config`) and a
  trainer holding a URL: `/get_world_size`, `trainer_init` with `HTTPVLLMWeightSyncClient`,
  `/pause`, `send_weights()`, `/resume`, completions over the OpenAI API;
* `examples/rl/rlhf_nccl.py`: Ray; the trainer is an actor holding the model, the engine an
  offline `LLM` actor on a Ray placement group (TP=2, Ray executor), driven through
  `RayVLLMWeightSyncClient`.

The trainer holds bf16 weights, the engines run fp32: the trainer casts to the dtype the engine
announced (exact from bf16). After each of two updates greedy output equals transformers' on the
pushed weights (the bf16 values in fp32). A cast that cannot be faithful (bf16 or fp32 into an
fp16 engine) is refused with the reason, and the engine keeps what it had.
"""

from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch

from vllm_nccl_sync.tiny import (
    PROMPTS,
    build_model,
    engine_kwargs,
    hf_greedy,
    make_model,
    random_weights,
    start_server,
    stop_server,
    vllm_greedy,
)
from vllm_nccl_sync.trainer.sync import free_port

ray_cluster = pytest.importorskip("tests.engine.test_ray").ray_cluster
"""A local Ray cluster of this module's own (2 CPUs), always shut down (`tests/engine/test_ray.py`)."""
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_TOKENS = 8
TIMEOUT_S = 60.0  # an upper bound on every wait, never a speed requirement
TEXT = ["Hello, my name is", "The capital of France is", "The future of AI is"]


def trainer_model(seed: int) -> torch.nn.Module:
    """What the trainer holds: the tiny Qwen2 of `seed` in bf16."""
    return build_model("qwen2", seed).to(torch.bfloat16)


def expected_ids(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy output on the pushed weights (the bf16 values, in fp32)."""
    return hf_greedy(copy.deepcopy(model).float(), prompts, MAX_TOKENS)


# ------------------------------------------------------------- rlhf_http_nccl.py: vllm serve


def get_world_size(base_url: str) -> int:
    import requests

    response = requests.get(f"{base_url}/get_world_size", timeout=30)
    response.raise_for_status()
    return response.json()["world_size"]


def http_trainer(base_url: str, train_model: torch.nn.Module):
    """The example's trainer engine, `nccl_sync` instead of `nccl` (the README's diff)."""
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from vllm_nccl_sync.weight_transfer import NcclSyncTrainerInitInfo

    world_size = get_world_size(base_url) + 1
    master_address = "127.0.0.1"
    master_port = free_port()
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=NcclSyncTrainerInitInfo(
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
            rank=0,
            packed=True,
        ),
        client=HTTPVLLMWeightSyncClient(base_url),
        source=ModuleSource(train_model),
    )
    return engine


@pytest.mark.vllm
def test_http_example_switched_to_nccl_sync(tmp_path):
    import requests
    from openai import OpenAI
    from transformers import AutoTokenizer

    path = make_model(str(tmp_path / "qwen2"), "qwen2", seed=1)
    proc, base_url = start_server(path, str(tmp_path / "server.log"), extension=None, args=[
        "--weight-transfer-config", json.dumps({"backend": "nccl_sync"})])
    try:
        client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY")
        prompts = [AutoTokenizer.from_pretrained(path)(t).input_ids for t in TEXT]

        def completions() -> list[list[int]]:
            out = []
            for text, ids in zip(TEXT, prompts, strict=True):
                r = client.completions.create(model=path, prompt=text, max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={
                                                  "ignore_eos": True, "return_token_ids": True})
                choice = r.choices[0]
                assert choice.prompt_token_ids == ids  # the server tokenized it as we did
                out.append(choice.token_ids)
            return out

        train_model = trainer_model(seed=1)  # the served checkpoint's weights, in bf16
        before = completions()
        engine = http_trainer(base_url, train_model)
        try:
            for step, seed in enumerate((2, 3), start=1):
                random_weights(train_model, seed)  # the trainer's step, in place
                expected = expected_ids(train_model, prompts)
                assert expected != before
                requests.post(f"{base_url}/pause", timeout=60).raise_for_status()
                try:
                    result = engine.send_weights()
                finally:
                    requests.post(f"{base_url}/resume", timeout=60).raise_for_status()
                assert result.version == step
                weight_info = requests.get(f"{base_url}/weight_info", timeout=30).json()
                assert weight_info["weight_version"] == str(step)
                before = completions()
                assert before == expected, f"update {step}"
        finally:
            engine.shutdown()
    finally:
        stop_server(proc)


# ------------------------------------------------------------- rlhf_nccl.py: Ray, offline LLM


def ray_actors():
    """The example's two actors, defined once Ray is imported (`ray.remote` needs it). Ray ships
    them by value: they use nothing of this module's (its workers cannot import it by name)."""
    import ray

    from vllm_nccl_sync.tiny import build_model

    @ray.remote(num_cpus=0)
    class TrainModel:
        """The trainer: the model, the transfer engine, and a stand-in optimizer step."""

        def __init__(self, seed: int) -> None:
            from vllm_nccl_sync.trainer.sync import free_port

            self.model = build_model("qwen2", seed).to(torch.bfloat16)  # as `trainer_model`
            self.master_address = ray.util.get_node_ip_address()
            self.port = free_port(self.master_address)
            self.engine = None

        def init_weight_transfer(self, world_size: int, llm_handle) -> None:
            from vllm.distributed.weight_transfer import (
                ModuleSource,
                RayVLLMWeightSyncClient,
                WeightTransferTrainerFactory,
            )

            from vllm_nccl_sync.weight_transfer import NcclSyncTrainerInitInfo

            self.engine = WeightTransferTrainerFactory.trainer_init(
                init_info=NcclSyncTrainerInitInfo(
                    master_address=self.master_address,
                    master_port=self.port,
                    world_size=world_size,
                    rank=0,
                    packed=True,
                ),
                client=RayVLLMWeightSyncClient(llm_handle),
                source=ModuleSource(self.model),
            )

        def train_step(self, seed: int) -> None:
            from vllm_nccl_sync.tiny import random_weights

            random_weights(self.model, seed)

        def broadcast_weights(self) -> int:
            return self.engine.send_weights().version

        def shutdown(self) -> None:
            if self.engine is not None:
                self.engine.shutdown()

    from vllm import LLM

    class MyLLM(LLM):
        """vLLM's `LLM`, its workers on the bundles of the actor's placement group."""

        def __init__(self, *args, **kwargs) -> None:
            os.environ["VLLM_RAY_BUNDLE_INDICES"] = "0,1"
            super().__init__(*args, **kwargs)

    return TrainModel, ray.remote(num_cpus=0)(MyLLM)


@pytest.mark.vllm
def test_ray_example_switched_to_nccl_sync(ray_cluster, tmp_path):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from vllm import SamplingParams

    TrainModel, MyLLM = ray_actors()
    path = make_model(str(tmp_path / "qwen2"), "qwen2", seed=1)
    env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "RAY_ADDRESS"))}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    train_model = TrainModel.remote(1)  # the served checkpoint's weights, in bf16
    pg_inference = placement_group([{"CPU": 1}] * 2)  # one Ray CPU per worker on vLLM CPU
    ray.get(pg_inference.ready(), timeout=TIMEOUT_S)
    llm = MyLLM.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg_inference, placement_group_capture_child_tasks=True,
            placement_group_bundle_index=0),
        runtime_env={"env_vars": env},
    ).remote(model=path, weight_transfer_config={"backend": "nccl_sync"},
             **engine_kwargs(tensor_parallel_size=2, distributed_executor_backend="ray"))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate() -> tuple[list[list[int]], list[list[int]]]:
        outs = ray.get(llm.generate.remote(TEXT, params, use_tqdm=False), timeout=300)
        return ([list(o.prompt_token_ids) for o in outs],
                [list(o.outputs[0].token_ids) for o in outs])

    try:
        prompts, before = generate()
        world_size = 1 + 2  # the trainer and the engine's two workers
        ray.get(train_model.init_weight_transfer.remote(world_size, llm), timeout=300)
        for step, seed in enumerate((2, 3), start=1):
            ray.get(train_model.train_step.remote(seed), timeout=TIMEOUT_S)
            expected = expected_ids(trainer_model(seed), prompts)
            assert expected != before
            assert ray.get(train_model.broadcast_weights.remote(), timeout=300) == step
            ray.get(llm.reset_prefix_cache.remote(), timeout=TIMEOUT_S)  # KV of old weights
            assert ray.get(llm.get_weight_version.remote(), timeout=TIMEOUT_S) == str(step)
            _, before = generate()
            assert before == expected, f"update {step}"
        ray.get(train_model.shutdown.remote(), timeout=TIMEOUT_S)
    finally:
        ray.kill(llm)
        ray.kill(train_model)
        remove_placement_group(pg_inference)


# ------------------------------------------------------------- a cast that cannot be faithful


def offline_trainer(llm, model: torch.nn.Module, world_size: int):
    """The same trainer engine against an in-process `LLM`."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from vllm_nccl_sync.weight_transfer import NcclSyncTrainerInitInfo

    info = NcclSyncTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(),
                                   world_size=world_size, rank=0, packed=True,
                                   timeout_s=TIMEOUT_S)
    return WeightTransferTrainerFactory.trainer_init(info, client=llm, source=ModuleSource(model))


@pytest.mark.vllm
def test_unfaithful_cast_is_refused_with_the_reason(tmp_path):
    """An fp16 engine (vLLM CPU runs fp16): bf16 values outside fp16's range, or fp32 ones with
    more precision, cannot be sent as they are; refused, saying why and how to cast on purpose,
    before the engine waits for bytes that will not come; nothing moves. fp16 weights (positive
    control) are taken."""
    from vllm import LLM

    path = make_model(str(tmp_path / "qwen2"), "qwen2", seed=1)
    llm = LLM(model=path, weight_transfer_config={"backend": "nccl_sync"},
              **engine_kwargs(dtype="float16"))
    try:
        world_size = 1 + llm.llm_engine.vllm_config.parallel_config.world_size
        held, version = vllm_greedy(llm, PROMPTS, MAX_TOKENS), llm.get_weight_version()
        for dtype in (torch.bfloat16, torch.float32):
            with pytest.raises(Exception) as refused:
                trainer = offline_trainer(llm, build_model("qwen2", 2).to(dtype), world_size)
                try:
                    trainer.send_weights()
                finally:
                    trainer.shutdown()
            text = str(refused.value)
            name = str(dtype).removeprefix("torch.")
            assert re.search(rf"\b{name}\b", text) and re.search(r"\bfloat16\b", text), text
            assert "cast" in text and "dtype" in text, text  # ...and how to cast on purpose
            # the engine heard of the refusal: its update_weights did not wait out its deadline
            assert "no control message from the sender" not in text, text
            assert llm.get_weight_version() == version
            llm.reset_prefix_cache()
            assert vllm_greedy(llm, PROMPTS, MAX_TOKENS) == held, f"{name}: something moved"

        trainer = offline_trainer(llm, build_model("qwen2", 2).half(), world_size)
        try:
            result = trainer.send_weights()
        finally:
            trainer.shutdown()
        assert llm.get_weight_version() == str(result.version)
        llm.reset_prefix_cache()
        assert vllm_greedy(llm, PROMPTS, MAX_TOKENS) != held
    finally:
        llm.llm_engine.engine_core.shutdown()  # the engine's processes go now, not at exit
        del llm


# ------------------------------------------------------------- the README's diff, no engine


def test_readme_diff_is_what_these_trainers_change():
    """Every line the README's "Using it from vLLM's API" diff adds or keeps in the trainer's
    code is a line of the trainers above; every line it removes is vLLM's own, and the server
    lines differ in the backend name only."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme.split("## Using it from vLLM's API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```diff\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 2, blocks
    serve, code = blocks
    removed = [ln[1:] for ln in serve.splitlines() if ln.startswith("-")]
    added = [ln[1:] for ln in serve.splitlines() if ln.startswith("+")]
    assert added and [a.replace('"nccl_sync"', '"nccl"') for a in added] == removed
    assert any("python -m vllm.entrypoints.openai.api_server" in a for a in added)

    with open(__file__) as f:
        here = {ln.strip() for ln in f}
    for line in code.splitlines():
        if line.startswith(("+", " ")) and line[1:].strip().endswith((",", "(", ")")):
            assert line[1:].strip() in here, line
        if line.startswith("+") and "import" in line:
            assert line[1:].strip() in here, line
    gone = [ln[1:].strip() for ln in code.splitlines() if ln.startswith("-")]
    assert gone == ["from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo",
                    "init_info=NCCLTrainerInitInfo("], gone
