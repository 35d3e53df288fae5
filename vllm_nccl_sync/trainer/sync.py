"""`WeightSync`: one object a trainer holds to keep one or many engines on its latest weights.

It hosts the transfer group, joins every engine to it (rank offsets computed here), and for each
update runs every engine's receive RPC concurrently with the push, so the caller writes one line:
`sync.update(model.state_dict(), version=step)`.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from vllm_nccl_sync.glue.engines import EngineHandle
from vllm_nccl_sync.trainer.push import PushClient, PushError, PushResult
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.protocol import AdapterSpec


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WeightSync:
    """Trainer-side driver of `engines`, all fed by one broadcast per bucket."""

    def __init__(
        self,
        engines: list[EngineHandle],
        *,
        backend: str = "gloo",
        bucket_bytes: int | None = None,
        timeout_s: float = 120.0,
        host: str = "127.0.0.1",
        secret: str = "",
        device: torch.device | None = None,
    ) -> None:
        if not engines:
            raise ValueError("WeightSync needs at least one engine")
        self.engines = engines
        extra = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
        self.cfg = SyncConfig(
            host=host,
            control_port=free_port(host),
            group_port=free_port(host),
            world_size=1 + sum(e.workers for e in engines),
            backend=backend,
            timeout_s=timeout_s,
            secret=secret,
            **extra,
        )
        self.offsets = [1 + sum(e.workers for e in engines[:i]) for i in range(len(engines))]
        self.client = PushClient(self.cfg, device)
        self._pool = ThreadPoolExecutor(max_workers=len(engines), thread_name_prefix="nccl-sync")

    def _on_all(self, method: str, args_for: list[tuple], timeout: float) -> list[Future]:
        return [
            self._pool.submit(e.call, method, *args, timeout=timeout)
            for e, args in zip(self.engines, args_for, strict=True)
        ]

    def connect(self) -> list[list[dict[str, Any]]]:
        """Join every engine's workers to the group; returns each worker's rank assignment."""
        cfg = self.cfg.to_dict()
        futs = self._on_all("nccl_sync_join", [(cfg, off) for off in self.offsets],
                            self.cfg.timeout_s + 30)
        try:
            self.client.connect()
        except BaseException:
            for f in futs:
                f.cancel()
            raise
        return [f.result(timeout=self.cfg.timeout_s) for f in futs]

    def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
        version: int,
        *,
        pause_mode: str = "wait",
        dtype: torch.dtype | None = None,
        force: bool = False,
        adapter: AdapterSpec | None = None,
    ) -> PushResult:
        """Push one complete update into every engine; raises `PushError` if any part failed.

        Each engine is paused (`pause_mode`: `abort`, `wait` or `keep` its in-flight requests) for
        the update and resumed with its prefix cache reset, whatever the outcome. Engines refuse a
        `version` not newer than the one they hold unless `force`. `adapter`: the tensors are
        this LoRA adapter's (see `update_adapter`).
        """
        if pause_mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause_mode {pause_mode!r} must be 'abort', 'wait' or 'keep'")
        for e in self.engines:
            e.pause(pause_mode)
        try:
            futs = self._on_all("nccl_sync_receive", [(self.cfg.timeout_s,)] * len(self.engines),
                                self.cfg.timeout_s * 3)
            error: BaseException | None = None
            result = None
            try:
                result = self.client.push(named_tensors, version, dtype=dtype, force=force,
                                          adapter=adapter)
            except PushError as e:
                error = e
            summaries = [s for f in futs for s in f.result(timeout=self.cfg.timeout_s * 3)]
        finally:
            for e in self.engines:
                e.resume()
        failed = [s for s in summaries if not s.get("ok")]
        if error is not None or failed:
            detail = "; ".join(f"rank {s.get('rank')}: {s.get('error')}" for s in failed)
            raise PushError(f"update {version} failed: {error or ''} {detail}".strip())
        assert result is not None
        return result

    def update_adapter(
        self,
        adapter: Any,
        version: int,
        *,
        name: str,
        lora_id: int,
        rank: int | None = None,
        alpha: float | None = None,
        target_modules: list[str] | None = None,
        pause_mode: str = "wait",
        dtype: torch.dtype | None = None,
        force: bool = False,
    ) -> PushResult:
        """Push LoRA adapter `name` (id `lora_id`) into every engine (started with LoRA enabled):
        added, or its weights replaced; versioned on its own. Base weights are not touched.

        `adapter` is a PEFT model (its active adapter's tensors and config are sent) or a mapping
        of PEFT-named LoRA tensors (`...q_proj.lora_A.weight`), then with `rank`, `alpha` and
        `target_modules`. Requests naming the adapter after this returns use the new weights;
        in-flight ones are handled per `pause_mode` (docs/lora.md). A `vllm serve` engine
        (`HTTPHandle`) also gets the name registered, so requests may say `"model": name`.
        """
        tensors, spec = adapter_update(adapter, name, lora_id, rank, alpha, target_modules)
        result = self.update(tensors, version, pause_mode=pause_mode, dtype=dtype, force=force,
                             adapter=spec)
        for e in self.engines:  # a served engine's OpenAI routes learn the name (once)
            register = getattr(e, "register_adapter", None)
            if register is not None:
                register(name)
        return result

    def state(self) -> list[list[dict[str, Any]]]:
        """Every worker's `nccl_sync_state` (version held, consistency, counters), per engine."""
        return [e.call("nccl_sync_state", timeout=30) for e in self.engines]

    def close(self) -> None:
        for e in self.engines:
            try:
                e.call("nccl_sync_close", timeout=30)
            except Exception:  # engine may already be gone; closing is best effort
                pass
        self.client.close()
        self._pool.shutdown(wait=False)


def adapter_update(adapter: Any, name: str, lora_id: int, rank: int | None = None,
                   alpha: float | None = None, target_modules: list[str] | None = None
                   ) -> tuple[dict[str, torch.Tensor], AdapterSpec]:
    """The tensors and `AdapterSpec` of a LoRA adapter update, from a PEFT model (its active
    adapter, through `peft.get_peft_model_state_dict`) or from a mapping plus its config."""
    if hasattr(adapter, "peft_config"):
        from peft import get_peft_model_state_dict

        cfg = adapter.peft_config[adapter.active_adapter]
        tensors = dict(get_peft_model_state_dict(adapter))
        rank = cfg.r if rank is None else rank
        alpha = cfg.lora_alpha if alpha is None else alpha
        targets = cfg.target_modules if target_modules is None else target_modules
        if isinstance(targets, str):  # a regex or "all-linear": the modules the tensors name
            from vllm_nccl_sync.glue.lora import split_name

            targets = {split_name(n)[0] for n in tensors}
        target_modules = sorted({t.rsplit(".", 1)[-1] for t in targets})  # PEFT may give paths
    elif isinstance(adapter, Mapping):
        tensors = dict(adapter)
    else:
        raise TypeError(f"adapter must be a PEFT model or a mapping, not {type(adapter).__name__}")
    if rank is None or alpha is None or target_modules is None:
        raise ValueError("a mapping of LoRA tensors needs rank, alpha and target_modules")
    return tensors, AdapterSpec(name, lora_id, int(rank), float(alpha), list(target_modules))
