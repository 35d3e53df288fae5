"""Handles on vLLM engines that the trainer drives: how to call the extension's RPCs on each.

An update needs the engine's workers inside `nccl_sync_receive` while the trainer pushes, so the
trainer (or `WeightSync`) calls it concurrently with `PushClient.push`. Each handle hides how the
call reaches the workers: an offline `vllm.LLM` in this process (`LLMHandle`).
"""

from __future__ import annotations

from typing import Any, Protocol


class EngineHandle(Protocol):
    """One engine (replica), seen from the trainer."""

    workers: int
    """How many workers (tensor x pipeline parallel) receive in this engine."""

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Run `method` of the worker extension on every worker; one result per worker."""
        ...

    def pause(self, mode: str) -> None:
        """Stop scheduling: `abort`, `wait` for, or `keep` in-flight requests."""
        ...

    def resume(self) -> None:
        """Resume scheduling and reset the prefix cache (its KV came from the old weights)."""
        ...


def _workers(vllm_config: Any) -> int:
    pc = vllm_config.parallel_config
    return pc.tensor_parallel_size * pc.pipeline_parallel_size


class LLMHandle:
    """An offline `vllm.LLM` in this process.

    The offline engine only steps inside `generate()`, so an update between two `generate()`
    calls needs no pause; `pause`/`resume` just reset the prefix cache.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.workers = _workers(llm.llm_engine.vllm_config)

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        return self.llm.collective_rpc(method, timeout=timeout, args=args)

    def pause(self, mode: str) -> None:
        pass

    def resume(self) -> None:
        self.llm.reset_prefix_cache()
