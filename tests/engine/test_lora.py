"""LoRA adapters pushed into a running vLLM engine (CPU build, `enable_lora=True`), no disk.

A PEFT model on the trainer side holds strong random LoRA weights (they visibly change greedy
output). Pushing adapter A, then A' (same rank and targets: replaced in place), then B (another
rank and targets: added beside A), then A'' (a new rank: re-registered through vLLM's manager):
the engine's greedy output with each adapter equals transformers + PEFT with that adapter merged,
requests without an adapter keep the base model's output, and every base parameter keeps its
storage and its checksum. A bad adapter is refused and loses nothing. The same through `vllm serve`
with requests in flight: none fails.
"""

from __future__ import annotations

import copy
import math
import subprocess
import threading

import pytest
import torch

from tests.procs import wait_until
from vllm_nccl_sync.integrations.vllm.handles import HTTPHandle, LLMHandle
from vllm_nccl_sync.tiny import PROMPTS, build_model, engine_kwargs, hf_greedy, make_model
from vllm_nccl_sync.trainer.push import PushError
from vllm_nccl_sync.trainer.sync import WeightSync

pytestmark = pytest.mark.vllm
peft = pytest.importorskip("peft")
MAX_TOKENS = 8
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# vLLM's CPU LoRA kernels (`vllm/lora/ops/torch_ops/lora_ops.py`, `bgmv_*`) index the stacked
# slots with -1 for "no adapter", i.e. Python's last slot: a request without an adapter batched
# with others picks up whatever the last slot holds. One slot more than the adapters any batch
# here uses keeps it empty (the GPU kernels skip -1: docs/lora.md).
LORA_ARGS = {"enable_lora": True, "max_lora_rank": 16, "max_loras": 4, "max_cpu_loras": 4}
DEADLINE_S = 180.0


def peft_adapter(seed: int, rank: int, targets: list[str]) -> torch.nn.Module:
    """The base model (seed 1) with a LoRA adapter of strong random weights drawn from `seed`."""
    model = peft.get_peft_model(
        build_model("qwen2", seed=1),
        peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # B*A then moves outputs about as much as the base weight does
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    return model.eval()


def merged_greedy(model: torch.nn.Module) -> list[list[int]]:
    """transformers' greedy output with the adapter merged into the base weights."""
    return hf_greedy(copy.deepcopy(model).merge_and_unload(), PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from vllm import LLM

    path = make_model(str(tmp_path_factory.mktemp("lora")), "qwen2", seed=1)
    llm = LLM(model=path, worker_extension_cls="vllm_nccl_sync.Ext",
              **engine_kwargs(**LORA_ARGS))
    sync = WeightSync([LLMHandle(llm)], timeout_s=60)
    sync.connect()
    yield llm, sync
    sync.close()
    del llm


def generate(llm, adapters: list) -> list[list[int]]:
    """Greedy output of every prompt, prompt i with `adapters[i]` (a LoRARequest or None)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp,
                        lora_request=adapters, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def base_fingerprint(llm) -> tuple:
    """Where every base parameter lives, and the sha256 of each one held as stored (linear
    weights the CPU backend packed away are covered by their pointers and the base output)."""
    [ptrs] = llm.collective_rpc("nccl_sync_param_ptrs")
    [sums] = llm.collective_rpc("nccl_sync_checksums")
    held = {n: d["sha256"] for n, d in sums["params"].items() if d["sha256"] and not d["note"]}
    return ptrs, held


def test_adapters_added_replaced_and_mixed(engine):
    from vllm_nccl_sync.integrations.vllm.lora import lora_request

    llm, sync = engine
    n = len(PROMPTS)
    base = hf_greedy(build_model("qwen2", seed=1), PROMPTS, MAX_TOKENS)
    assert generate(llm, [None] * n) == base
    before = base_fingerprint(llm)
    assert any("qkv_proj" in name for name in before[0]) and len(before[1]) > 5
    req_a, req_b = lora_request("A", 1), lora_request("B", 2)

    a = peft_adapter(seed=10, rank=8, targets=ALL_LINEAR)
    sync.update_adapter(a, version=1, name="A", lora_id=1)
    want_a = merged_greedy(a)
    assert want_a != base, "the adapter must visibly change the output"
    assert generate(llm, [req_a] * n) == want_a
    assert generate(llm, [None] * n) == base

    a2 = peft_adapter(seed=11, rank=8, targets=ALL_LINEAR)  # same layout: in place
    sync.update_adapter(a2, version=2, name="A", lora_id=1)
    llm.reset_prefix_cache()
    want_a2 = merged_greedy(a2)
    assert want_a2 != want_a
    assert generate(llm, [req_a] * n) == want_a2
    [held] = llm.collective_rpc("nccl_sync_adapters")
    assert held["A"]["version"] == 2 and held["A"]["last_update"]["in_place"] >= 1

    b = peft_adapter(seed=20, rank=4, targets=["q_proj", "v_proj", "down_proj"])
    sync.update_adapter(b, version=1, name="B", lora_id=2)
    want_b = merged_greedy(b)
    mixed = [req_a, req_b, None, req_b, req_a][:n]
    want = {id(req_a): want_a2, id(req_b): want_b, id(None): base}
    got = generate(llm, mixed)
    assert got == [want[id(r)][i] for i, r in enumerate(mixed)]

    a3 = peft_adapter(seed=12, rank=16, targets=["q_proj", "o_proj", "up_proj"])  # new layout
    sync.update_adapter(a3, version=3, name="A", lora_id=1)
    llm.reset_prefix_cache()
    assert generate(llm, [req_a] * n) == merged_greedy(a3)
    assert generate(llm, [req_b] * n) == want_b
    assert generate(llm, [None] * n) == base
    [held] = llm.collective_rpc("nccl_sync_adapters")
    assert {k: v["version"] for k, v in held.items()} == {"A": 3, "B": 1}
    assert held["A"]["last_update"]["registered"] >= 1 and held["A"]["rank"] == 16
    assert base_fingerprint(llm) == before, "base parameters moved or changed"


def test_bad_adapter_is_refused_and_loses_nothing(engine):
    from vllm_nccl_sync.integrations.vllm.lora import lora_request
    from vllm_nccl_sync.trainer.sync import adapter_update

    llm, sync = engine
    n = len(PROMPTS)
    [held] = llm.collective_rpc("nccl_sync_adapters")
    good = peft_adapter(seed=30, rank=8, targets=ALL_LINEAR)
    sync.update_adapter(good, version=10, name="C", lora_id=3)
    want = merged_greedy(good)
    assert generate(llm, [lora_request("C", 3)] * n) == want
    before = base_fingerprint(llm)

    tensors, spec = adapter_update(peft_adapter(seed=31, rank=8, targets=ALL_LINEAR), "C", 3)
    name = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[name] = tensors[name][:, :-1].contiguous()  # one input feature short
    with pytest.raises(PushError, match="shape"):
        sync.update(tensors, 11, adapter=spec)
    too_big = peft_adapter(seed=32, rank=32, targets=ALL_LINEAR)  # above max_lora_rank
    with pytest.raises(PushError, match="rank"):
        sync.update_adapter(too_big, version=12, name="C", lora_id=3)
    with pytest.raises(PushError, match="already names adapter"):
        sync.update_adapter(good, version=1, name="D", lora_id=3)  # C's id
    llm.reset_prefix_cache()
    assert generate(llm, [lora_request("C", 3)] * n) == want
    [after] = llm.collective_rpc("nccl_sync_adapters")
    assert after["C"]["version"] == 10 and "D" not in after
    assert base_fingerprint(llm) == before
    [state] = llm.collective_rpc("nccl_sync_state")
    assert state["consistent"], "a failed adapter update must not mark base weights inconsistent"


def test_update_aborted_in_the_commit_round_is_undone(engine, monkeypatch):
    """Every receiver acknowledged (the adapter is already swapped in), then the trainer aborts
    (as when another engine failed): the adapter is back as it was, in place and re-registered."""
    from vllm_nccl_sync.integrations.vllm.lora import lora_request
    from vllm_nccl_sync.wire.protocol import Ack

    llm, sync = engine
    n = len(PROMPTS)
    good = peft_adapter(seed=40, rank=8, targets=ALL_LINEAR)
    sync.update_adapter(good, version=1, name="E", lora_id=5)
    want = merged_greedy(good)
    assert generate(llm, [lora_request("E", 5)] * n) == want

    def acked_then_aborted(buckets: int, phase: int):
        sync.client.rounds.gather(Ack, phase=phase)
        raise RuntimeError("another engine failed (simulated after every Ack)")

    monkeypatch.setattr(sync.client.rounds, "commit", acked_then_aborted)
    for other in (peft_adapter(seed=41, rank=8, targets=ALL_LINEAR),  # would go in place
                  peft_adapter(seed=42, rank=4, targets=["q_proj"])):  # would re-register
        assert merged_greedy(other) != want  # had it stayed, the output would show it
        with pytest.raises(PushError, match="another engine failed"):
            sync.update_adapter(other, version=2, name="E", lora_id=5)
        llm.reset_prefix_cache()
        assert generate(llm, [lora_request("E", 5)] * n) == want
    monkeypatch.undo()
    [held] = llm.collective_rpc("nccl_sync_adapters")
    assert held["E"]["version"] == 1 and held["E"]["rank"] == 8
    [state] = llm.collective_rpc("nccl_sync_state")
    assert state["consistent"] and state["adapters"]["E"] == 1


def test_adapter_through_vllm_weight_transfer_api(tmp_path):
    """The `nccl_sync` backend of vLLM's weight-transfer API: `send_adapter` adds, then replaces
    in place; vLLM's weight version label stays the base weights'."""
    from vllm import LLM
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from vllm_nccl_sync.integrations.vllm.lora import lora_request
    from vllm_nccl_sync.weight_transfer import NcclSyncTrainerInitInfo

    path = make_model(str(tmp_path / "qwen2"), "qwen2", seed=1)
    llm = LLM(model=path, weight_transfer_config={"backend": "nccl_sync"},
              **engine_kwargs(**LORA_ARGS))
    try:
        n = len(PROMPTS)
        base = build_model("qwen2", seed=1)
        info = NcclSyncTrainerInitInfo(world_size=2, rank=0, timeout_s=60.0)
        trainer = WeightTransferTrainerFactory.trainer_init(info, client=llm,
                                                            source=ModuleSource(base))
        label = llm.get_weight_version()
        for seed, version in ((50, 1), (51, 2)):
            adapter = peft_adapter(seed=seed, rank=8, targets=ALL_LINEAR)
            result = trainer.send_adapter(adapter, version, name="F", lora_id=6)
            assert result is not None and result.version == version
            llm.reset_prefix_cache()
            assert generate(llm, [lora_request("F", 6)] * n) == merged_greedy(adapter)
        assert generate(llm, [None] * n) == hf_greedy(base, PROMPTS, MAX_TOKENS)
        assert llm.get_weight_version() == label
        trainer.shutdown()
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


# ---------------------------------------------------------------------------- vllm serve (HTTP)


def _post(url: str, path: str, body: dict) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=DEADLINE_S) as r:
        raw = r.read()
    try:
        return json.loads(raw)
    except ValueError:
        return {"text": raw.decode()}


def _complete(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    return _post(url, "/v1/completions", body)["choices"][0]


def test_served_adapter_swapped_with_requests_in_flight(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from vllm_nccl_sync.tiny import start_server, stop_server

    path = make_model(str(tmp_path / "served"), "qwen2", seed=1)
    args = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "3"]
    proc, url = start_server(path, str(tmp_path / "server.log"), args=args,
                             env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    sync = WeightSync([HTTPHandle(url)], timeout_s=60)
    try:
        sync.connect()
        a = peft_adapter(seed=10, rank=8, targets=ALL_LINEAR)
        # The server learns the name (HTTPHandle.register_adapter) and registers it under an id
        # of its own; its `nccl-sync://` path tells the workers to build it from memory.
        sync.update_adapter(a, version=1, name="A", lora_id=7)
        assert [_complete(url, "A", p, MAX_TOKENS)["token_ids"] for p in PROMPTS] == \
            merged_greedy(a)
        assert [_complete(url, path, p, MAX_TOKENS)["token_ids"] for p in PROMPTS] == \
            hf_greedy(build_model("qwen2", seed=1), PROMPTS, MAX_TOKENS)

        a2 = peft_adapter(seed=11, rank=8, targets=ALL_LINEAR)
        done = threading.Event()

        def keep_asking(i: int) -> int:
            """Requests naming A, one after another, until the update is over; returns how many
            completed (any failure raises)."""
            count = 0
            while not done.is_set() or count == 0:
                out = _complete(url, "A" if i % 2 == 0 else path, PROMPTS[i], 48)
                assert out["finish_reason"] == "length" and len(out["token_ids"]) == 48
                count += 1
            return count

        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(keep_asking, i) for i in range(4)]
            wait_until(lambda: any(f.done() for f in futs) or _server_busy(url),
                       "requests running on the server", DEADLINE_S)
            sync.update_adapter(a2, version=2, name="A", lora_id=7, pause_mode="wait")
            done.set()
            counts = [f.result(DEADLINE_S) for f in futs]  # raises if any request failed
        assert all(c >= 1 for c in counts)
        assert [_complete(url, "A", p, MAX_TOKENS)["token_ids"] for p in PROMPTS] == \
            merged_greedy(a2)
        [held] = HTTPHandle(url).call("nccl_sync_adapters", timeout=30)
        # Both registrations (the pushed id and the server's) were replaced.
        assert held["A"]["version"] == 2 and len(held["A"]["ids"]) == 2 and 7 in held["A"]["ids"]
    finally:
        sync.close()
        stop_server(proc)


def _server_busy(url: str) -> bool:
    """The server reports at least one running request (its Prometheus gauge)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            if float(line.rsplit(" ", 1)[-1]) >= 1:
                return True
    return False



def test_bench_lora_smoke():
    """benchmarks/bench_lora_gpu.py in its CPU smoke mode: runs, and its checks hold."""
    import os
    import signal
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "benchmarks/bench_lora_gpu.py", "--cpu-smoke"],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"bench_lora_gpu.py still running after 600 s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    assert "| ours | 4 |" in out and "| vllm_file | 8 |" in out
    assert '"base_unchanged": true' in out and '"r8_same_tokens": true' in out
