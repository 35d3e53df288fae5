"""The trainer side of the `nccl_sync` weight-transfer backend (see `weight_transfer`)."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from functools import partial
from typing import Any, ClassVar

from vllm_nccl_sync.integrations.vllm.transfer.backend import BACKEND, check_version, register

SURFACE = check_version()  # raises UnsupportedVllm, naming the supported versions, elsewhere

import torch  # noqa: E402
from vllm.config.weight_transfer import WeightTransferConfig  # noqa: E402
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from vllm_nccl_sync.integrations.vllm.transfer.clients import (  # noqa: E402
    as_client,
    error_text,
)
from vllm_nccl_sync.outcomes import SyncError, clip, label_version, version_label  # noqa: E402
from vllm_nccl_sync.trainer.adapters import adapter_update  # noqa: E402
from vllm_nccl_sync.trainer.beside import beside  # noqa: E402
from vllm_nccl_sync.trainer.push import PushClient, PushResult  # noqa: E402
from vllm_nccl_sync.wire.config import BACKENDS, SyncConfig  # noqa: E402

log = logging.getLogger(__name__)

_DEFAULT = SyncConfig.defaults()

DEFAULT_LABEL = "default"
"""vLLM's weight version of an engine that never took an update (`/weight_info`)."""


@dataclass
class NcclSyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the `nccl_sync` backend (`backend`, vLLM's dispatch key, selects
    it in `WeightTransferTrainerFactory`).

    The transfer's knobs are `SyncConfig`'s, with its defaults; the data plane is `transport`
    because vLLM reads `backend` as the dispatch key. vLLM's `NCCLTrainerInitInfo` fields are
    accepted with their meaning here: `master_address` is `host`, `master_port` is `group_port`,
    `packed_buffer_size_bytes` is `bucket_bytes`, `packed` is accepted either way (this backend
    always packs), `packed_num_buffers` must be 2 (two buffers on each side). `rank` is this
    trainer process's rank, as in vLLM: 0 sends; every other rank only iterates the source (its
    collectives, e.g. FSDP's gathers). `from_vllm` converts another backend's init info.
    """

    backend: ClassVar[str] = BACKEND

    world_size: int
    """1 (this trainer) + every receiving worker of the engine (TP x PP x DP; the HTTP server's
    `/get_world_size` + 1)."""
    host: str = _DEFAULT["host"]
    """Address this trainer binds and the workers connect to (control socket, rendezvous)."""
    control_port: int = 0
    """0: a free port is chosen at each (re-)join."""
    group_port: int = 0
    """The data plane's rendezvous port; 0: a free port is chosen at each (re-)join."""
    transport: str = "auto"
    """`SyncConfig.backend`: `nccl`, `gloo`, `ipc` (the engine on this trainer's GPU), `shm`
    (a CPU engine on this host), or `auto` (nccl when this trainer has a GPU)."""
    bucket_bytes: int = _DEFAULT["bucket_bytes"]
    timeout_s: float = _DEFAULT["timeout_s"]
    """Bound on every wait of the handshake and of each update."""
    secret: str = _DEFAULT["secret"]
    """Hex key authenticating control frames (HMAC-SHA256); empty: off."""
    rank_offset: int = 1
    device: str | None = None
    """This trainer's data-plane device (default: the current CUDA device for nccl)."""
    dtype: str | None = None
    """Cast floating-point tensors to this dtype (e.g. "bfloat16"); without it they are cast to
    the engine's dtype where that is faithful (a cast into float16 needs it)."""
    full: bool = False
    """The plan must cover every tensor of the engine's checkpoint."""
    staged: bool = False
    """Workers load nothing until every bucket of every worker arrived and verified."""
    plan: bool | None = None
    """Announce the whole update as a plan checked before any byte moves. None (auto): with
    `shard`, or when the source is a `ModuleSource` over unsharded parameters (free). True:
    always (the source is materialized first, so sharded sources hold every gathered tensor at
    once). False: stream; each bucket header is still checked before its bytes move."""
    shard: bool = _DEFAULT["shard"]
    """`SyncConfig.shard`, shard to shard: every worker publishes its read set as it joins, and
    each update sends it only the blocks its loaders read (gloo, nccl), from rank 0's full
    tensors. The source is then pushed as a state dict (`plan`; False is refused), so a sharded
    source's gathered tensors are held at once; adapters (`send_adapter`) still go whole."""
    master_address: str = ""
    """vLLM's name of `host`."""
    master_port: int = 0
    """vLLM's name of `group_port`."""
    packed: bool = True
    """Accepted for vLLM's `NCCLTrainerInitInfo`; tensors are always packed into buckets here."""
    packed_buffer_size_bytes: int = 0
    """vLLM's name of `bucket_bytes`."""
    packed_num_buffers: int = 2
    """Must be 2: each side holds two bucket buffers."""

    def __post_init__(self) -> None:
        self._spelling = {"backend": "transport"}
        for alias, name, unset in (("master_address", "host", _DEFAULT["host"]),
                                   ("master_port", "group_port", 0),
                                   ("packed_buffer_size_bytes", "bucket_bytes",
                                    _DEFAULT["bucket_bytes"])):
            given, own = getattr(self, alias), getattr(self, name)
            if given and own not in (unset, given):
                raise ValueError(f"{alias}={given!r} and {name}={own!r} name the same setting")
            if given:
                setattr(self, name, given)
                self._spelling[name] = alias
        if self.packed_num_buffers != 2:
            raise ValueError(f"packed_num_buffers={self.packed_num_buffers}: the {BACKEND} "
                             "backend holds two bucket buffers on each side")
        if self.rank < 0:
            raise ValueError(f"rank {self.rank} must be >= 0 (0 sends)")
        if self.transport != "auto" and self.transport not in BACKENDS:
            raise ValueError(f"transport {self.transport!r}: choose 'auto' or one of "
                             f"{list(BACKENDS)}")
        if self.dtype is not None and not isinstance(getattr(torch, self.dtype, None),
                                                     torch.dtype):
            raise ValueError(f"dtype {self.dtype!r} is not a torch dtype")
        SyncConfig.check(**self._sync_fields(), door=type(self).__name__,
                         spelling=self._spelling)
        if self.shard and self.plan is False:
            raise ValueError("shard=True pushes the source as a state dict; plan=False would "
                             "stream it, every tensor whole")

    def _sync_fields(self) -> dict[str, Any]:
        """This info's `SyncConfig` fields under SyncConfig's names (`auto` resolved)."""
        backend = self.transport
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        return {"host": self.host, "control_port": self.control_port,
                "group_port": self.group_port, "world_size": self.world_size,
                "backend": backend, "bucket_bytes": self.bucket_bytes,
                "timeout_s": self.timeout_s, "secret": self.secret, "shard": self.shard}

    def sync_config(self) -> SyncConfig:
        """The `SyncConfig` this info names: ports of 0 become ports free now (each join)."""
        return SyncConfig.build(**self._sync_fields(), door=type(self).__name__,
                                spelling=self._spelling)

    @classmethod
    def from_vllm(cls, info: Any, **extra: Any) -> NcclSyncTrainerInitInfo:
        """This backend's init info from another backend's (e.g. vLLM's `NCCLTrainerInitInfo`,
        or a mapping of its fields) plus `extra`; `ValueError` naming every field that has no
        meaning here."""
        given = {f.name: getattr(info, f.name) for f in fields(info)} if is_dataclass(info) \
            else dict(info)
        given.update(extra)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"{unknown} have no meaning for the {BACKEND} backend (its fields: "
                             f"{sorted(known)})")
        return cls(**given)


class WeightTransferFailed(SyncError, RuntimeError):
    """An update through vLLM's API failed; the text holds what vLLM's `update_weights` call
    reported (the engine's side) and what the push reported (this trainer's side)."""

    def __init__(self, message: str, *, version: int | None = None,
                 engine_error: str | None = None, push_error: BaseException | None = None):
        super().__init__(message)
        self.version = version
        self.engine_error = engine_error
        self.push_error = push_error


def _held_version(client: Any, timeout_s: float) -> tuple[int, str]:
    """The weight version vLLM reports for the engine (`get_weight_version()`, or an HTTP
    client's `/weight_info`): as an int (0 when it is not a number) and as vLLM's label
    ("default": the engine never took an update)."""
    if not SURFACE.weight_version:
        return 0, DEFAULT_LABEL
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
            return 0, DEFAULT_LABEL
        label = DEFAULT_LABEL if label is None else str(label)
        return max(label_version(label), 0), label
    except Exception:  # noqa: BLE001 - no label, or not ours: start from 1
        return 0, DEFAULT_LABEL


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
        where the engine is), else 0 (vLLM's "default": the engine never took an update)."""
        self.held = DEFAULT_LABEL
        """The weight version vLLM reported at `trainer_init`."""
        self.last_result: PushResult | None = None

    @classmethod
    def trainer_init(cls, init_info: NcclSyncTrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None, config: Any = None
                     ) -> NcclSyncTrainerEngine:
        """Join the engine's workers: the sender calls `init_weight_transfer_engine` through
        `client` while it opens the transfer group; other trainer ranks only keep `source`.
        (vLLM 0.32 calls this with `init_info`, `client`, `source`; 0.26 adds `config`.)"""
        if not isinstance(init_info, NcclSyncTrainerInitInfo):
            raise TypeError(f"the {BACKEND} backend takes NcclSyncTrainerInitInfo (see its "
                            f"from_vllm), got {type(init_info).__name__}")
        if source is None:
            raise ValueError(f"the {BACKEND} backend needs a WeightSource "
                             "(e.g. ModuleSource(model))")
        engine = cls(init_info, client=client, source=source, config=config)
        if engine.is_sender:
            engine.version, engine.held = _held_version(engine.client, init_info.timeout_s)
            log.info("%s: the engine holds weight version %r; the next push is version %d",
                     BACKEND, engine.held, engine.version + 1)
            engine._join()
        return engine

    # ------------------------------------------------------------------ handshake

    def _device(self, cfg: SyncConfig) -> torch.device | None:
        if self.info.device is not None:
            return torch.device(self.info.device)
        if cfg.backend in ("nccl", "ipc"):
            return torch.device("cuda", torch.cuda.current_device())
        return None

    def _join(self) -> None:
        """Open the transfer group while the engine's workers join it through vLLM's
        `init_weight_transfer_engine`; either side's failure is raised at once."""
        self.shutdown()
        cfg = self.info.sync_config()
        device = self._device(cfg)
        push = PushClient(cfg, device)
        gave_up = threading.Event()

        def connect() -> None:
            try:
                if device is not None and device.type == "cuda":
                    torch.cuda.set_device(device)
                push.connect()
            except BaseException:
                push.close()
                raise
            if gave_up.is_set():  # the join was already reported failed
                push.close()

        init_info = {"sync_config": cfg.to_dict(), "rank_offset": self.info.rank_offset}
        joined, [rpc] = beside([partial(self.client.init_weight_transfer_engine, init_info)],
                               connect, cfg.timeout_s, name="nccl_sync_join", fail_fast=True)
        engine = None if rpc.ok else error_text(rpc.error)
        if not joined.ok:
            gave_up.set()  # a connect still running closes its client when it ends
        if rpc.done and rpc.error is not None and not joined.done:
            raise WeightTransferFailed(f"{BACKEND}: vLLM's init_weight_transfer_engine failed: "
                                       f"{engine}", engine_error=engine)
        if not joined.done:
            raise WeightTransferFailed(f"{BACKEND}: the transfer group did not form: "
                                       f"{joined.error}")
        if joined.error is not None:
            raise WeightTransferFailed(
                f"{BACKEND}: the engine's workers did not join this trainer: "
                f"{clip(str(joined.error))}"
                + (f"; vLLM's init_weight_transfer_engine: {engine}" if engine else ""),
                engine_error=engine, push_error=joined.error)
        if engine is not None:
            push.close()
            raise WeightTransferFailed(f"{BACKEND}: vLLM's init_weight_transfer_engine failed: "
                                       f"{engine}", engine_error=engine)
        self.push_client, self.sync_config = push, cfg
        log.info("%s: trainer joined %d engine worker(s) (%s data plane)", BACKEND,
                 cfg.world_size - 1, cfg.backend)

    # ------------------------------------------------------------------ updates

    def _tensors(self) -> Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]:
        """The source as a mapping (announced as a plan, checked before any byte moves; shard
        to shard needs one) or as a stream (each bucket header checked before its bytes move)."""
        plan = self.info.plan
        if plan is None:
            module = getattr(self.source, "_module", None) if isinstance(
                self.source, ModuleSource) else None
            plan = self.info.shard or (module is not None and not any(
                callable(getattr(p, "full_tensor", None)) for p in module.parameters()))
        return dict(iter(self.source)) if plan else iter(self.source)

    def _checked(self, tensors: Mapping | Iterable, dtype: torch.dtype | None,
                 adapter: Any) -> Mapping | Iterable:
        """`tensors` once `PushClient.check` passed (on a stream's first tensor only)."""
        mapping = isinstance(tensors, Mapping)
        it = iter(() if mapping else tensors)
        first = [] if mapping else list(itertools.islice(it, 1))
        self.push_client.check(tensors if mapping else dict(first), dtype=dtype, adapter=adapter)
        return tensors if mapping else itertools.chain(first, it)

    def send_adapter(self, adapter: Any, version: int, *, name: str, lora_id: int,
                     rank: int | None = None, alpha: float | None = None,
                     target_modules: list[str] | None = None, force: bool = False
                     ) -> PushResult | None:
        """Push LoRA adapter `name` (id `lora_id`; a PEFT model, or a mapping of PEFT-named
        tensors with `rank`, `alpha`, `target_modules`) as its own `version`, through the same
        vLLM calls as `send_weights`; the engine adds it or replaces its weights (docs/lora.md).
        vLLM's weight version label is left as it is."""
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
        cfg = self.sync_config
        version = self.version + 1 if version is None else int(version)
        staged = self.info.staged if staged is None else staged
        tensors = self._tensors() if adapter is None else adapter[0]
        dtype = getattr(torch, self.info.dtype) if self.info.dtype else None
        try:  # refused here, before vLLM's update_weights waits for a plan that will not come
            tensors = self._checked(tensors, dtype, None if adapter is None else adapter[1])
        except Exception as e:
            raise WeightTransferFailed(f"{BACKEND} update {version} refused before it began: "
                                       f"{clip(str(e))}", version=version, push_error=e) from e
        try:
            self.client.start_weight_update()
        except Exception as e:
            raise WeightTransferFailed(
                f"{BACKEND} update {version}: vLLM's start_weight_update failed: "
                f"{error_text(e)}", version=version, engine_error=error_text(e)) from e
        pushed, [rpc] = beside(
            [partial(self.client.update_weights, {"version": version, "timeout_s": cfg.timeout_s})],
            partial(self.push_client.push, tensors, version, dtype=dtype, force=force,
                    full=self.info.full and not adapter, staged=staged,
                    adapter=None if adapter is None else adapter[1]),
            cfg.timeout_s, name="nccl_sync_update")
        engine = None if rpc.ok else error_text(rpc.error)
        if pushed.error is not None:
            if engine is None:  # vLLM's session is still open: close it (no new label)
                try:
                    self.client.finish_weight_update()
                except Exception:  # noqa: BLE001 - the push error is the one to report
                    log.exception("%s: finish_weight_update after a failed push", BACKEND)
            raise WeightTransferFailed(
                f"{BACKEND} update {version} failed. vLLM update_weights: "
                f"{engine or 'returned without error'}. Trainer: {clip(str(pushed.error))}",
                version=version, engine_error=engine, push_error=pushed.error) from pushed.error
        if engine is not None:  # every worker committed, yet vLLM's call failed
            raise WeightTransferFailed(
                f"{BACKEND} update {version} was committed by every worker, but vLLM's "
                f"update_weights failed: {engine}", version=version, engine_error=engine)
        self.last_result = pushed.value
        if adapter is None:  # adapters have versions of their own: no base label
            self.version = version
        self._finish(None if adapter is not None else version)
        return pushed.value

    def _finish(self, version: int | None) -> None:
        """`finish_weight_update`, labelling vLLM's weight version where vLLM has one (None:
        no label)."""
        try:
            if SURFACE.weight_version and version is not None:
                self.client.finish_weight_update(weight_version=version_label(version))
            else:
                self.client.finish_weight_update()
        except Exception as e:
            raise WeightTransferFailed(
                f"{BACKEND} update {version} was committed by every worker, but vLLM's "
                f"finish_weight_update failed: {error_text(e)}", version=version,
                engine_error=error_text(e)) from e

    def shutdown(self) -> None:
        """Close this trainer's end of the transfer group (the engine keeps serving; its
        workers leave the old group when they next join)."""
        if self.push_client is not None:
            push, self.push_client = self.push_client, None
            push.close()


# A process that only unpickles the init info (a Ray actor handed it by the driver) imports this
# module alone, and vLLM's plugins never ran there: the backend must be known all the same.
register()
