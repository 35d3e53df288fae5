"""Handles on vLLM engines that the trainer drives: how to call the extension's RPCs on each.

An update needs the engine's workers inside `nccl_sync_receive` while the trainer pushes, so
`WeightSync` runs it beside `PushClient.push` (`trainer.beside`). Each handle is an
`EngineHandle` (`trainer.sync`) and hides how the call reaches the workers: an offline `vllm.LLM`
in this process (`LLMHandle`), an `AsyncLLM` on its own event loop (`AsyncLLMHandle`), a
`vllm serve` process (`HTTPHandle`). The `nccl_sync` backend's weight-sync clients are these
same handles (`transfer.clients`).
"""

from __future__ import annotations

from typing import Any

from vllm_nccl_sync.trainer.sync import EngineHandle

__all__ = ["AsyncLLMHandle", "EngineHandle", "HTTPHandle", "LLMHandle"]


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

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class AsyncLLMHandle:
    """An in-process `AsyncLLM` whose event loop runs in another thread (e.g. a rollout server).

    Calls are scheduled on that loop and waited for here, so the trainer code stays synchronous.
    """

    def __init__(self, engine: Any, loop: Any, *, call_timeout_s: float = 600.0) -> None:
        self.engine = engine
        self.loop = loop
        self.workers = _workers(engine.vllm_config)
        self._timeout = call_timeout_s
        self._cleared = False  # the last pause cleared the caches

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout or self._timeout)

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        return self._run(self.engine.collective_rpc(method, timeout=timeout, args=args),
                         None if timeout is None else timeout + 10)

    def pause(self, mode: str) -> None:
        """Pause; `abort`/`wait` also clear the KV and prefix caches once the engine is idle."""
        from vllm_nccl_sync.integrations.vllm.patches.pause import pause

        self._cleared = False
        self._run(pause(self.engine, mode, clear_cache=mode != "keep"))
        self._cleared = mode != "keep"

    def resume(self) -> None:
        """Resume; the prefix cache is reset first unless the pause already cleared it (nothing
        runs in between), and `keep`'s frozen requests recompute with the new weights."""
        cleared, self._cleared = self._cleared, False

        async def resume() -> None:  # one trip to the engine's loop
            if not cleared:
                await self.engine.reset_prefix_cache(reset_running_requests=True)
            await self.engine.resume_generation()

        self._run(resume())

    def reset_prefix_cache(self) -> None:
        """The prefix cache only (an engine asleep: `WeightSync` neither pauses nor resumes it)."""
        self._run(self.engine.reset_prefix_cache())


class HTTPHandle:
    """A `vllm serve ... --worker-extension-cls vllm_nccl_sync.Ext` server.

    Uses vLLM's development endpoints, so the server must run with `VLLM_SERVER_DEV_MODE=1`:
    `POST /collective_rpc`, `/pause?mode=`, `/resume`, `/reset_prefix_cache`.
    `workers` is the server's tensor x pipeline parallel size.
    """

    def __init__(self, url: str, workers: int = 1, *, call_timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.workers = workers
        self._timeout = call_timeout_s

    def _post(self, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        import json
        import urllib.error
        import urllib.request

        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self._timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            hint = " (is the server running with VLLM_SERVER_DEV_MODE=1?)" if e.code == 404 else ""
            raise RuntimeError(f"POST {path} -> HTTP {e.code}{hint}: {detail}") from None
        return json.loads(raw) if raw else None

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        out = self._post("/collective_rpc", {"method": method, "args": list(args), "timeout": timeout},
                         None if timeout is None else timeout + 10)
        return (out or {}).get("results", [])

    def pause(self, mode: str) -> None:
        self._post(f"/pause?mode={mode}&clear_cache={'false' if mode == 'keep' else 'true'}")

    def resume(self) -> None:
        self._post("/reset_prefix_cache?reset_running_requests=true")
        self._post("/resume")

    def reset_prefix_cache(self) -> None:
        """The prefix cache only (a server asleep: `WeightSync` neither pauses nor resumes it)."""
        self._post("/reset_prefix_cache")

    def register_adapter(self, name: str) -> None:
        """Make the server's OpenAI routes serve LoRA adapter `name` (pushed into its workers)
        as `"model": name`, once: `POST /v1/load_lora_adapter` with the adapter's in-memory
        path. Needs a server started with `--enable-lora` and
        `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`."""
        import json
        import urllib.error
        import urllib.request

        from vllm_nccl_sync.integrations.vllm.patches.lora import SCHEME

        with urllib.request.urlopen(self.url + "/v1/models", timeout=self._timeout) as r:
            served = {m.get("id") for m in json.loads(r.read()).get("data", [])}
        if name in served:
            return
        body = json.dumps({"lora_name": name, "lora_path": SCHEME + name}).encode()
        req = urllib.request.Request(self.url + "/v1/load_lora_adapter", data=body,
                                     method="POST", headers={"Content-Type": "application/json"})
        try:  # answers plain text on success
            urllib.request.urlopen(req, timeout=self._timeout).close()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise RuntimeError(f"registering adapter {name!r} -> HTTP {e.code} (is the server "
                               "started with --enable-lora and "
                               f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True?): {detail}") from None
