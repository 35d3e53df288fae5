"""vLLM's weight-sync clients as the `nccl_sync` trainer engine drives them: the engine handles
of an in-process `LLM` or `AsyncLLM` (`integrations.vllm.handles`) as `VLLMWeightSyncClient`s,
and what vLLM said when a call failed."""

from __future__ import annotations

import inspect
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)

from vllm_nccl_sync.integrations.vllm.handles import AsyncLLMHandle, LLMHandle
from vllm_nccl_sync.outcomes import clip


class OfflineClient(LLMHandle):
    """`VLLMWeightSyncClient` over an in-process `vllm.LLM` (whose methods take vLLM's request
    objects): the `LLMHandle` `WeightSync` drives, with vLLM's weight-sync calls. `trainer_init`
    wraps an `LLM` passed as the client in this on its own."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None:
            self.llm.finish_weight_update()
        else:
            self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def get_weight_version(self) -> str:
        return self.llm.get_weight_version()


class AsyncEngineClient(AsyncLLMHandle):
    """`VLLMWeightSyncClient` over an in-process `AsyncLLM` whose event loop `loop` runs in
    another thread (a rollout server): the `AsyncLLMHandle` `WeightSync` drives, with vLLM's
    weight-sync calls; each blocks this thread until the loop ran it, at most `call_timeout_s`."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._run(self.engine.init_weight_transfer_engine(
            WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._run(self.engine.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None:
            self._run(self.engine.finish_weight_update())
        else:
            self._run(self.engine.finish_weight_update(weight_version))

    def get_weight_version(self) -> str:
        return self._run(self.engine.get_weight_version())


def as_client(client: Any) -> Any:
    """`client` as a `VLLMWeightSyncClient`: an in-process `LLM` is wrapped in `OfflineClient`;
    anything else with the four methods is used as is."""
    if hasattr(client, "llm_engine") and hasattr(client, "update_weights"):
        return OfflineClient(client)
    if inspect.iscoroutinefunction(getattr(client, "update_weights", None)):
        raise TypeError("an AsyncLLM is driven on its own event loop: pass "
                        "AsyncEngineClient(async_llm, loop) as the client")
    missing = [m for m in ("init_weight_transfer_engine", "start_weight_update",
                           "update_weights", "finish_weight_update")
               if not callable(getattr(client, m, None))]
    if missing:
        raise TypeError(f"client {type(client).__name__} is not a VLLMWeightSyncClient "
                        f"(missing {missing})")
    return client


def error_text(e: BaseException) -> str:
    """What vLLM said: an HTTP route's JSON error message, else the exception's text."""
    response = getattr(e, "response", None)
    if response is not None:
        try:
            body = response.json()
            message = body.get("error", {}).get("message") if isinstance(body, dict) else None
            if message:
                return f"HTTP {response.status_code}: {message}"
        except Exception:  # noqa: BLE001, S110 - not JSON
            pass
        text = getattr(response, "text", "")
        if text:
            return f"HTTP {response.status_code}: {clip(text)}"
    return clip(str(e) or repr(e))
