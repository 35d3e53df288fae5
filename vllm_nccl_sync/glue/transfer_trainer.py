"""The trainer side of the `nccl_sync` weight-transfer backend (see `weight_transfer`)."""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_nccl_sync.patches.vllm_weight_transfer import BACKEND, check_version

SURFACE = check_version()  # raises UnsupportedVllm, naming the supported versions, elsewhere

import torch  # noqa: E402
from vllm.config.weight_transfer import WeightTransferConfig  # noqa: E402
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)

from vllm_nccl_sync.outcomes import SyncError, clip  # noqa: E402
from vllm_nccl_sync.trainer.push import PushClient, PushResult  # noqa: E402
from vllm_nccl_sync.wire.config import DEFAULT_BUCKET_BYTES, SyncConfig  # noqa: E402

log = logging.getLogger(__name__)




@dataclass
class NcclSyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the `nccl_sync` backend (`backend` selects it in vLLM's
    `WeightTransferTrainerFactory`); `rank` is this trainer process's rank (0 sends)."""

    backend: ClassVar[str] = BACKEND

    world_size: int
    """1 (this trainer) + every receiving worker of the engine (TP x PP x DP; the HTTP server's
    `/get_world_size` + 1)."""
    host: str = "127.0.0.1"
    """Address this trainer binds and the workers connect to (control socket, rendezvous)."""
    control_port: int = 0
    """0: a free port is chosen at each (re-)join."""
    group_port: int = 0
    """0: a free port is chosen at each (re-)join."""
    transport: str = "auto"
    """Data plane: `nccl`, `gloo`, or `auto` (nccl when this trainer has a GPU)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 120.0
    """Bound on every wait of the handshake and of each update."""
    secret: str = ""
    """Hex key authenticating control frames (HMAC-SHA256); empty: off."""
    rank_offset: int = 1
    device: str | None = None
    """This trainer's data-plane device (default: the current CUDA device for nccl)."""
    dtype: str | None = None
    """Cast floating-point tensors to this dtype before sending (e.g. "bfloat16")."""
    full: bool = False
    """The plan must cover every tensor of the engine's checkpoint."""
    staged: bool = False
    """Workers load nothing until every bucket of every worker arrived and verified."""
    plan: bool | None = None
    """Announce the whole update as a plan checked before any byte moves. None (auto): when the
    source is a `ModuleSource` over unsharded parameters (free). True: always (the source is
    materialized first, so sharded sources hold every gathered tensor at once). False: stream;
    each bucket header is still checked before its bytes move."""


class WeightTransferFailed(SyncError, RuntimeError):
    """An update through vLLM's API failed; the text holds what vLLM's `update_weights` call
    reported (the engine's side) and what the push reported (this trainer's side)."""

    def __init__(self, message: str, *, version: int | None = None,
                 engine_error: str | None = None, push_error: BaseException | None = None):
        super().__init__(message)
        self.version = version
        self.engine_error = engine_error
        self.push_error = push_error


class OfflineClient:
    """`VLLMWeightSyncClient` over an in-process `vllm.LLM` (whose methods take vLLM's request
    objects). `trainer_init` wraps an `LLM` passed as the client in this on its own."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

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


class AsyncEngineClient:
    """`VLLMWeightSyncClient` over an in-process `AsyncLLM` whose event loop `loop` runs in
    another thread (a rollout server); each call blocks this thread until the loop ran it, at
    most `call_timeout_s`."""

    def __init__(self, engine: Any, loop: Any, *, call_timeout_s: float = 600.0) -> None:
        self.engine, self.loop = engine, loop
        self._timeout = call_timeout_s

    def _run(self, coro: Any) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self._timeout)

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


def _error_text(e: BaseException) -> str:
    """What vLLM said: an HTTP route's JSON error message, else the exception's text."""
    response = getattr(e, "response", None)
    if response is not None:
        try:
            body = response.json()
            message = body.get("error", {}).get("message") if isinstance(body, dict) else None
            if message:
                return f"HTTP {response.status_code}: {message}"
        except Exception:  # noqa: BLE001 - not JSON
            pass
        text = getattr(response, "text", "")
        if text:
            return f"HTTP {response.status_code}: {clip(text)}"
    return clip(str(e) or repr(e))


def _outcome(fut: Future, timeout_s: float) -> str | None:
    """None if the engine call succeeded, else what it reported (bounded wait)."""
    try:
        fut.result(timeout=timeout_s)
    except TimeoutError:
        return f"no answer from vLLM within {timeout_s:.0f} s"
    except BaseException as e:  # noqa: BLE001 - reported to the caller
        return _error_text(e)
    return None


def _spawn(name: str, fn: Any, *args: Any) -> Future:
    """Run `fn(*args)` in a daemon thread; its outcome in a Future. (A thread left waiting on a
    peer that failed ends by its own timeout and never holds up the interpreter's exit.)"""
    fut: Future = Future()
    fut.set_running_or_notify_cancel()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


def _held_version(client: Any, timeout_s: float) -> int:
    """The weight version vLLM reports for the engine (`get_weight_version()`, or an HTTP
    client's `/weight_info`), as an int; 0 when it has none or it is not a number ("default")."""
    if not SURFACE.weight_version:
        return 0
    try:
        getter = getattr(client, "get_weight_version", None)
        if callable(getter):
            label = getter()
        elif isinstance(getattr(client, "base_url", None), str):
            import requests

            r = requests.get(f"{client.base_url}/weight_info", timeout=timeout_s)
            r.raise_for_status()
            label = r.json().get("weight_version")
        else:
            return 0
        return max(int(str(label)), 0)
    except Exception:  # noqa: BLE001 - no label, or not ours: start from 1
        return 0


def _free_ports(host: str, n: int) -> list[int]:
    from vllm_nccl_sync.trainer.sync import free_port

    ports: list[int] = []
    while len(ports) < n:
        p = free_port(host)
        if p not in ports:
            ports.append(p)
    return ports


class NcclSyncTrainerEngine(TrainerWeightTransferEngine):
    """vLLM trainer-side weight-transfer engine pushing with this project's `PushClient`."""

    init_info_cls = NcclSyncTrainerInitInfo
    config_cls = WeightTransferConfig  # vLLM 0.26's trainer factory passes one; unused

    def __init__(self, init_info: NcclSyncTrainerInitInfo, *, client: Any,
                 source: WeightSource, config: Any = None) -> None:
        # Not TrainerWeightTransferEngine.__init__: its signature differs between 0.26 and 0.32.
        self.config = config
        self.info = init_info
        self.is_sender = init_info.rank == 0
        self.client = as_client(client) if self.is_sender else client
        self.source = source
        self.push_client: PushClient | None = None
        self.sync_config: SyncConfig | None = None
        self.version = 0
        """Last version committed; `send_weights()` pushes the next one. Starts from the weight
        version vLLM reports for the engine when it is a number (a restarted trainer goes on
        where the engine is), else 0."""
        self.last_result: PushResult | None = None

    @classmethod
    def trainer_init(cls, init_info: NcclSyncTrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None, config: Any = None
                     ) -> NcclSyncTrainerEngine:
        """Join the engine's workers: the sender calls `init_weight_transfer_engine` through
        `client` while it opens the transfer group; other trainer ranks only keep `source`.
        (vLLM 0.32 calls this with `init_info`, `client`, `source`; 0.26 adds `config`.)"""
        if not isinstance(init_info, NcclSyncTrainerInitInfo):
            raise TypeError(f"the {BACKEND} backend takes NcclSyncTrainerInitInfo, got "
                            f"{type(init_info).__name__}")
        if source is None:
            raise ValueError(f"the {BACKEND} backend needs a WeightSource "
                             "(e.g. ModuleSource(model))")
        engine = cls(init_info, client=client, source=source, config=config)
        if engine.is_sender:
            engine.version = _held_version(engine.client, init_info.timeout_s)
            engine._join()
        return engine

    # ------------------------------------------------------------------ handshake

    def _sync_config(self) -> SyncConfig:
        i = self.info
        transport = i.transport
        if transport == "auto":
            transport = "nccl" if torch.cuda.is_available() else "gloo"
        control, group = i.control_port, i.group_port
        if not control or not group:
            fresh = [p for p in _free_ports(i.host, 3) if p not in (control, group)]
            control, group = control or fresh.pop(), group or fresh.pop()
        return SyncConfig(host=i.host, control_port=control, group_port=group,
                          world_size=i.world_size, backend=transport, bucket_bytes=i.bucket_bytes,
                          timeout_s=i.timeout_s, secret=i.secret)

    def _device(self, cfg: SyncConfig) -> torch.device | None:
        if self.info.device is not None:
            return torch.device(self.info.device)
        if cfg.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return None

    def _join(self) -> None:
        """Open the transfer group while the engine's workers join it through vLLM's
        `init_weight_transfer_engine`; either side's failure is raised at once."""
        self.shutdown()
        cfg = self._sync_config()
        device = self._device(cfg)
        push = PushClient(cfg, device)
        init_info = {"sync_config": cfg.to_dict(), "rank_offset": self.info.rank_offset}

        def connect() -> None:
            try:
                if device is not None and device.type == "cuda":
                    torch.cuda.set_device(device)
                push.connect()
            except BaseException:
                push.close()
                raise

        joined = _spawn("nccl_sync_connect", connect)
        try:
            rpc = _spawn("nccl_sync_init", self.client.init_weight_transfer_engine, init_info)
            bound = cfg.timeout_s * 2 + 30.0  # both are bounded by timeout_s themselves
            wait([rpc, joined], timeout=bound, return_when=FIRST_EXCEPTION)
            if rpc.done() and rpc.exception() is not None:
                raise WeightTransferFailed(
                    f"{BACKEND}: vLLM's init_weight_transfer_engine failed: "
                    f"{_error_text(rpc.exception())}",
                    engine_error=_error_text(rpc.exception()))
            wait([joined], timeout=bound)  # the workers' side returns a moment before ours
            if not joined.done():
                raise WeightTransferFailed(f"{BACKEND}: the transfer group did not form within "
                                           f"{bound:.0f} s")
            if joined.exception() is not None:
                engine = _outcome(rpc, cfg.timeout_s + 30.0)
                raise WeightTransferFailed(
                    f"{BACKEND}: the engine's workers did not join this trainer: "
                    f"{clip(str(joined.exception()))}"
                    + (f"; vLLM's init_weight_transfer_engine: {engine}" if engine else ""),
                    engine_error=engine, push_error=joined.exception())
            engine = _outcome(rpc, bound)
            if engine is not None:
                raise WeightTransferFailed(
                    f"{BACKEND}: vLLM's init_weight_transfer_engine failed: {engine}",
                    engine_error=engine)
        except BaseException:
            if joined.done() and joined.exception() is None:
                push.close()
            raise
        self.push_client, self.sync_config = push, cfg
        log.info("%s: trainer joined %d engine worker(s) (%s data plane)", BACKEND,
                 cfg.world_size - 1, cfg.backend)

    # ------------------------------------------------------------------ updates

    def _tensors(self) -> Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]:
        """The source as a mapping (announced as a plan, checked before any byte moves) or as
        a stream (each bucket header checked before its bytes move)."""
        plan = self.info.plan
        if plan is None:
            module = getattr(self.source, "_module", None) if isinstance(
                self.source, ModuleSource) else None
            plan = module is not None and not any(
                callable(getattr(p, "full_tensor", None)) for p in module.parameters())
        return dict(iter(self.source)) if plan else iter(self.source)

    def send_adapter(self, adapter: Any, version: int, *, name: str, lora_id: int,
                     rank: int | None = None, alpha: float | None = None,
                     target_modules: list[str] | None = None, force: bool = False
                     ) -> PushResult | None:
        """Push LoRA adapter `name` (id `lora_id`; a PEFT model, or a mapping of PEFT-named
        tensors with `rank`, `alpha`, `target_modules`) as its own `version`, through the same
        vLLM calls as `send_weights`; the engine adds it or replaces its weights (docs/lora.md).
        vLLM's weight version label is left as it is."""
        from vllm_nccl_sync.trainer.sync import adapter_update

        if not self.is_sender:
            return None
        tensors, spec = adapter_update(adapter, name, lora_id, rank, alpha, target_modules)
        return self.send_weights(version, force=force, adapter=(tensors, spec))

    def send_weights(self, version: int | None = None, *, force: bool = False,
                     staged: bool | None = None, adapter: tuple | None = None
                     ) -> PushResult | None:
        """Push the source as `version` (default: the last one + 1) through vLLM's
        `start_weight_update` → `update_weights` (which receives while this pushes) →
        `finish_weight_update(weight_version=str(version))`. Called on every trainer rank;
        others only iterate the source. Raises `WeightTransferFailed` naming both sides.
        `adapter`: `(tensors, AdapterSpec)` pushed instead of the source (`send_adapter`)."""
        if not self.is_sender:
            for _ in self.source:  # materializing may be a collective among trainer ranks
                pass
            return None
        if self.push_client is None or (self.push_client.transport is not None
                                        and self.push_client.transport.broken):
            self._join()  # a failed update gave the group up: both sides join a fresh one
        assert self.push_client is not None and self.sync_config is not None
        cfg = self.sync_config
        version = self.version + 1 if version is None else int(version)
        staged = self.info.staged if staged is None else staged
        tensors = self._tensors() if adapter is None else adapter[0]
        dtype = getattr(torch, self.info.dtype) if self.info.dtype else None
        try:
            self.client.start_weight_update()
        except Exception as e:
            raise WeightTransferFailed(
                f"{BACKEND} update {version}: vLLM's start_weight_update failed: "
                f"{_error_text(e)}", version=version, engine_error=_error_text(e)) from e
        bound = cfg.timeout_s * 3 + 30.0  # the receiver's own waits are bounded by timeout_s
        rpc = _spawn("nccl_sync_update", self.client.update_weights,
                     {"version": version, "timeout_s": cfg.timeout_s})
        try:
            result = self.push_client.push(
                tensors, version, dtype=dtype, force=force, full=self.info.full and not adapter,
                staged=staged, adapter=None if adapter is None else adapter[1])
        except Exception as e:
            engine = _outcome(rpc, bound)
            if engine is None:  # vLLM's session is still open: close it (no new label)
                try:
                    self.client.finish_weight_update()
                except Exception:  # noqa: BLE001 - the push error is the one to report
                    log.exception("%s: finish_weight_update after a failed push", BACKEND)
            raise WeightTransferFailed(
                f"{BACKEND} update {version} failed. vLLM update_weights: "
                f"{engine or 'returned without error'}. Trainer: {clip(str(e))}",
                version=version, engine_error=engine, push_error=e) from e
        engine = _outcome(rpc, bound)
        if engine is not None:  # every worker committed, yet vLLM's call failed
            raise WeightTransferFailed(
                f"{BACKEND} update {version} was committed by every worker, but vLLM's "
                f"update_weights failed: {engine}", version=version, engine_error=engine)
        self.last_result = result
        if adapter is not None:  # adapters have versions of their own: no base label
            self._finish(None)
            return result
        self.version = version
        self._finish(version)
        return result

    def _finish(self, version: int | None) -> None:
        """`finish_weight_update`, labelling vLLM's weight version where vLLM has one (None:
        no label)."""
        try:
            if SURFACE.weight_version and version is not None:
                self.client.finish_weight_update(weight_version=str(version))
            else:
                self.client.finish_weight_update()
        except Exception as e:
            raise WeightTransferFailed(
                f"{BACKEND} update {version} was committed by every worker, but vLLM's "
                f"finish_weight_update failed: {_error_text(e)}", version=version,
                engine_error=_error_text(e)) from e

    def shutdown(self) -> None:
        """Close this trainer's end of the transfer group (the engine keeps serving; its
        workers leave the old group when they next join)."""
        if self.push_client is not None:
            push, self.push_client = self.push_client, None
            push.close()
