"""Helpers only the tests use (the tiny models themselves are `vllm_nccl_sync.tiny`): a
block-FP8 checkpoint, the tokens a request carried across a swap computes, a quiet `AsyncLLM`
shutdown. (`conftest.py` puts the repository's root on `PYTHONPATH`, so engine workers import
the tests' extensions, `tests.fault_ext.FaultExt` and the like.)"""

from __future__ import annotations

import os
from typing import Any

import torch

from vllm_nccl_sync.tiny import model_config, random_weights, save_model

FP8_BLOCK = 128


@torch.no_grad()
def make_block_fp8(path: str, seed: int, quantized: bool = True) -> str:
    """A tiny Qwen3 checkpoint quantized the way DeepSeek/Qwen3-FP8 ship theirs: every linear
    weight `float8_e4m3fn` in 128 x 128 blocks with a float32 `weight_scale_inv` per block,
    embeddings and norms in bf16. `quantized=False`: the same weights in bf16 (what a trainer
    holds)."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from vllm_nccl_sync.integrations.vllm.block_fp8 import SCALE, quantize

    config = model_config("qwen3")
    config.num_key_value_heads = 4  # 4 x 32: every projection is a multiple of a block
    model = random_weights(AutoModelForCausalLM.from_config(config, dtype=torch.float32), seed)
    model = model.to(torch.bfloat16)
    save_model(model, path)
    if not quantized:
        return path
    out = {}
    for name, t in model.state_dict().items():
        if t.ndim == 2 and name.endswith("proj.weight"):
            out[name], out[name + SCALE] = quantize(t, (FP8_BLOCK, FP8_BLOCK))
        else:
            out[name] = t.contiguous()
    os.remove(os.path.join(path, "model.safetensors"))
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    saved["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    return path


@torch.no_grad()
def carried(old, new, prompt: list[int], before: list[int], n: int) -> list[int]:
    """transformers' greedy tokens of `new` continuing `prompt + before` on the KV cache `old`
    computed for all but the last of those tokens: what a request carried across the swap after
    `len(before)` tokens computes next (`n` tokens)."""
    ids = torch.tensor([prompt + before])
    cache = old(ids[:, :-1], use_cache=True).past_key_values
    nxt, out = ids[:, -1:], []
    for _ in range(n):
        y = new(nxt, past_key_values=cache, use_cache=True)
        cache = y.past_key_values
        nxt = y.logits[:, -1:].argmax(-1)
        out.append(int(nxt))
    return out


def stop_async_llm(engine: Any, loop: Any, timeout_s: float = 60.0) -> None:
    """Shut down an `AsyncLLM` whose event loop `loop` runs in another thread, quietly.

    `AsyncLLM.shutdown` stops the engine core first: its output socket's task then ends and
    queues an `EngineDeadError`, which the still-running output handler logs as a failure with
    a traceback before the handler is cancelled. So the handler is cancelled (and awaited) on
    the loop first, then the engine is shut down there. The loop keeps running (the caller
    stops it). Drop the last reference to `engine` before the interpreter exits: its
    `__del__` shuts down once more, harmlessly while vLLM's modules are loaded, with a
    `TypeError` traceback if only at interpreter exit. Raises `TimeoutError` after `timeout_s`."""
    import asyncio
    import contextlib

    async def stop() -> None:
        handler = engine.output_handler
        if handler is not None and not handler.done():
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler
        engine.shutdown()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout_s)


def storages(seed: int, n: int = 400) -> dict[str, torch.Tensor]:
    """`n` small tensors, each its own storage (on a same-host plane: a segment to export)."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(8 + i % 9, 64, generator=g) for i in range(n)}


def push_rewritten(cfg: dict, seeds: list[int], where: str) -> list[int]:
    """Pushes `storages(seed)` for each seed as a state dict of tensors made once (`where`:
    "shared", moved into shared memory; "cuda", on GPU 0) and rewritten in place before each
    push (the same storages: the layout is kept)."""
    from vllm_nccl_sync import PushClient, SyncConfig

    device = torch.device("cuda", 0) if where == "cuda" else None
    client = PushClient(SyncConfig(**cfg), device)
    client.connect()
    held = {n: t.cuda() if device else t.share_memory_() for n, t in storages(seeds[0]).items()}
    for seed in seeds:
        for n, t in storages(seed).items():
            held[n].copy_(t)
        client.push(held, version=seed)
    client.close()
    return seeds

