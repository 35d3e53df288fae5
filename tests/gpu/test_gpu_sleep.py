"""GPU, one device: vLLM's sleep mode around colocated updates, as verl/TRL colocate drive it.

A real vLLM engine (`enable_sleep_mode=True`, torch.compile and CUDA graphs, worker extension
`vllm_nccl_sync.Ext`; its engine core in a child process) shares the GPU with this process, the
trainer, which pushes its CUDA tensors over the CUDA IPC plane (`WeightSync(backend="ipc")`).
Tiny fp32 models (bf16 rounding flips near-tied greedy tokens between vLLM and transformers).

* Level 1: while asleep an update is refused before a byte moves (its memory is unmapped);
  after `wake_up(tags=["weights"])` it is pushed, then `wake_up(tags=["kv_cache"])`: greedy output
  equals transformers' with the pushed weights, parameter pointers unchanged.
* Level 2: after `wake_up(tags=["weights"])` the engine reports inconsistent; an update leaving
  out one tensor is refused (a state dict before a byte moves, a stream at the commit) and the
  engine goes on reporting inconsistent; an update of every weight commits: consistent, output
  equals transformers' and a freshly started engine's on the pushed weights.

Run: `python -m pytest -q -s -m gpu tests/gpu/test_gpu_sleep.py`.
"""

from __future__ import annotations

import faulthandler
import json
import os
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MAX_TOKENS = 8
ARCH = "qwen2"
LEFT_OUT = "model.layers.1.post_attention_layernorm.weight"


def test_sleep_levels_around_colocated_updates(tmp_path):
    from vllm import LLM

    from vllm_nccl_sync import LLMHandle, PushError, UpdateRefused, WeightSync
    from vllm_nccl_sync.tiny import (
        PROMPTS,
        build_model,
        engine_kwargs,
        hf_greedy,
        make_model,
        vllm_greedy,
    )

    faulthandler.dump_traceback_later(900, exit=True)  # the deadline: where it waited, then out
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process, the trainer, uses CUDA
    path = make_model(str(tmp_path / "w1"), ARCH, seed=1)
    llm = LLM(model=path, worker_extension_cls="vllm_nccl_sync.Ext", enable_sleep_mode=True,
              **engine_kwargs(enforce_eager=False, max_num_seqs=8))
    sync = WeightSync([LLMHandle(llm)], backend="ipc", bucket_bytes=8 << 20, timeout_s=60.0,
                      device=torch.device("cuda", 0))
    sync.connect()
    report: dict = {}

    def state() -> dict:
        [st] = llm.collective_rpc("nccl_sync_state")
        return st

    def weights(seed: int) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        model = build_model(ARCH, seed)
        expected = hf_greedy(model, PROMPTS, MAX_TOKENS)
        return {n: t.cuda() for n, t in model.state_dict().items()}, expected

    def push(named, version: int) -> float:
        t0 = time.perf_counter()
        sync.update(named, version)
        return round((time.perf_counter() - t0) * 1e3, 1)

    try:
        before = vllm_greedy(llm, PROMPTS, MAX_TOKENS)
        ptrs = llm.collective_rpc("nccl_sync_param_ptrs")

        # level 1: offloaded, restored by wake_up; nothing may be written while asleep
        w2, expected2 = weights(2)
        llm.sleep(level=1)
        assert state()["asleep"] == ["kv_cache", "weights"]
        with pytest.raises(UpdateRefused, match="asleep"):
            sync.update(w2, 2)
        llm.wake_up(tags=["weights"])
        report["level1_update_ms"] = push(w2, 2)
        llm.wake_up(tags=["kv_cache"])
        st = state()
        assert st["consistent"] and st["version"] == 2 and st["asleep"] == []
        out2 = vllm_greedy(llm, PROMPTS, MAX_TOKENS)
        assert out2 == expected2 and out2 != before
        assert llm.collective_rpc("nccl_sync_param_ptrs") == ptrs

        # level 2: discarded; only an update of every weight may commit
        w3, _ = weights(3)
        partial = {n: t for n, t in w3.items() if n != LEFT_OUT}
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        st = state()
        assert not st["consistent"] and "sleep(level=2)" in st["discarded"], st
        with pytest.raises(UpdateRefused, match=f"every weight must be rewritten.*{LEFT_OUT}"):
            sync.update(partial, 3)
        with pytest.raises(PushError, match=f"refused to commit update 3.*{LEFT_OUT}"):
            sync.update(iter(partial.items()), 3)
        st = state()
        assert not st["consistent"] and st["version"] == 2 and st["discarded"], st
        report["refused_stream_error"] = st["last_error"][:200]
        w4, expected4 = weights(4)
        report["level2_update_ms"] = push(w4, 4)
        llm.wake_up(tags=["kv_cache"])
        st = state()
        assert st["consistent"] and st["version"] == 4 and st["discarded"] == "", st
        out4 = vllm_greedy(llm, PROMPTS, MAX_TOKENS)
        assert out4 == expected4
        assert llm.collective_rpc("nccl_sync_param_ptrs") == ptrs

        # level 2 again, the update streamed as a trainer would (one tensor at a time)
        w5, expected5 = weights(5)
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        report["level2_stream_update_ms"] = push(iter(w5.items()), 5)
        llm.wake_up(tags=["kv_cache"])
        assert state()["consistent"] and vllm_greedy(llm, PROMPTS, MAX_TOKENS) == expected5
    finally:
        sync.close()

    # a freshly started engine on the last pushed weights answers the same
    llm.llm_engine.engine_core.shutdown()  # its GPU memory goes now
    fresh = LLM(model=make_model(str(tmp_path / "w5"), ARCH, seed=5), **engine_kwargs(enforce_eager=False, max_num_seqs=8,
                                                      gpu_memory_utilization=0.2))
    assert vllm_greedy(fresh, PROMPTS, MAX_TOKENS) == expected5
    report["fresh_engine_equal"] = True
    print("SLEEP_RESULT " + json.dumps(report))
