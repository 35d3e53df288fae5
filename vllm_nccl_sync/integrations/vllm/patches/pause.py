"""Pause an `AsyncLLM` for a weight update without the front end's fixed 20 ms sleep.

Upstream: `AsyncLLM.pause_generation` (`vllm/v1/engine/async_llm.py`). With `clear_cache` it
clears the renderer's multimodal cache (`renderer.clear_mm_cache_async`), then pauses the engine
core's scheduler (`engine_core.pause_scheduler_async(mode, clear_cache)`, which returns once the
engine is paused: requests aborted, drained or frozen as `mode` says), then sleeps 20 ms so that
the last outputs of in-flight requests reach their callers before the call returns; vLLM's own
comment calls that sleep "not required for correctness". Around a weight update the sleep is
pure pause: `pause` makes the same two calls without it, on the versions checked (0.26.x read on
the GPU install, 0.32.x in CI), and calls `pause_generation` itself anywhere else. Outputs still
in flight arrive while the weights travel (the push runs off the engine's event loop).
"""

from __future__ import annotations

from typing import Any

SUPPORTED = ("0.26.", "0.32.")


def _direct(engine: Any, clear_cache: bool) -> bool:
    """Whether this engine has the calls `pause_generation` makes, on a checked version."""
    import vllm

    core = getattr(engine, "engine_core", None)
    return (vllm.__version__.startswith(SUPPORTED)
            and callable(getattr(core, "pause_scheduler_async", None))
            and (not clear_cache
                 or callable(getattr(getattr(engine, "renderer", None), "clear_mm_cache_async",
                                     None))))


async def pause(engine: Any, mode: str, clear_cache: bool) -> None:
    """`engine.pause_generation(mode=mode, clear_cache=clear_cache)` less its closing sleep."""
    if not _direct(engine, clear_cache):
        await engine.pause_generation(mode=mode, clear_cache=clear_cache)
        return
    if clear_cache:
        await engine.renderer.clear_mm_cache_async()
    await engine.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)
