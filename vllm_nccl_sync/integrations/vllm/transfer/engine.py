"""The engine side of the `nccl_sync` weight-transfer backend (see `weight_transfer`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from vllm_nccl_sync.integrations.vllm.transfer.backend import check_version

SURFACE = check_version()  # raises UnsupportedVllm, naming the supported versions, elsewhere

import torch  # noqa: E402
from vllm.config.weight_transfer import WeightTransferConfig  # noqa: E402
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from vllm_nccl_sync.engine.state import held_weights  # noqa: E402
from vllm_nccl_sync.outcomes import clip  # noqa: E402
from vllm_nccl_sync.wire.config import SyncConfig, spelled  # noqa: E402

log = logging.getLogger(__name__)


@dataclass
class NcclSyncInitInfo(WeightTransferInitInfo):
    """What `init_weight_transfer_engine` carries to every worker (JSON-safe; the trainer
    engine builds it)."""

    sync_config: dict[str, Any] | SyncConfig
    """`SyncConfig.to_dict()` of the trainer (or the `SyncConfig` itself): its address, ports,
    world size, data plane, `shard` (each worker then publishes its read set as it joins);
    refused at construction if invalid."""
    rank_offset: int = 1
    """Transfer rank of this engine's first worker (1 for the first engine behind a trainer)."""

    def __post_init__(self) -> None:
        self._config = self.sync_config if isinstance(self.sync_config, SyncConfig) else \
            _door_config(dict(self.sync_config))

    def config(self) -> SyncConfig:
        """The trainer's `SyncConfig` (checked at construction)."""
        return self._config


def _door_config(d: dict[str, Any]) -> SyncConfig:
    """`SyncConfig.from_dict(d)`; a refusal names the field as `sync_config[...]`."""
    spelling = {name: f"sync_config[{name!r}]" for name in SyncConfig.__struct_fields__}
    with spelled(NcclSyncInitInfo.__name__, spelling):
        try:
            return SyncConfig.from_dict(d)
        except TypeError as e:  # a required field missing
            raise ValueError(f"sync_config: {e}") from None


@dataclass
class NcclSyncUpdateInfo(WeightTransferUpdateInfo):
    """What `update_weights` carries: which update to expect, and how long to wait for it."""

    version: int
    """The version the trainer pushes; the worker refuses to report success for another."""
    timeout_s: float | None = None
    """Bound on the wait for the push to start (default: the config's `timeout_s`)."""


class NcclSyncWeightTransferEngine(WeightTransferEngine[NcclSyncInitInfo, NcclSyncUpdateInfo]):
    """vLLM worker-side weight-transfer engine: a thin adapter over the worker's `EngineSession`."""

    init_info_cls = NcclSyncInitInfo
    update_info_cls = NcclSyncUpdateInfo
    supports_draft_weight_update = False
    """Plans are checked against the main model's checkpoint; a draft model has another one."""

    @staticmethod
    def trainer_send_weights(*args: Any, **kwargs: Any) -> None:
        """vLLM 0.26's base class asks every engine for a trainer-side sender; this backend's
        trainer side is `NcclSyncTrainerEngine` (through `WeightTransferTrainerFactory`)."""
        raise NotImplementedError(
            "nccl_sync sends from the trainer through WeightTransferTrainerFactory.trainer_init("
            "NcclSyncTrainerInitInfo(...), ...).send_weights()")

    def __init__(self, config: WeightTransferConfig, vllm_config: Any, device: torch.device,
                 model: torch.nn.Module) -> None:
        from vllm_nccl_sync.integrations.vllm.lora import AdapterStore
        from vllm_nccl_sync.integrations.vllm.worker import vllm_session

        super().__init__(config, vllm_config, device, model)
        self.worker = _Worker(self)
        """What vLLM's worker would offer, over the current target model."""
        self.session = vllm_session(
            self.worker, lambda w, ref: AdapterStore.for_model(w.model_runner.model, ref))
        self.last: dict[str, Any] | None = None
        """Summary of the last update (ok, version, consistent, bytes, error, ...)."""

    def init_transfer_engine(self, init_info: NcclSyncInitInfo) -> None:
        """Join the trainer's transfer group (blocks until the trainer connects, bounded)."""
        from vllm_nccl_sync.integrations.vllm.worker import join, loaders

        cfg = init_info.config()
        self.shutdown()
        made = loaders(self.worker)
        made()  # refuses, saying why, a model it cannot update in place: before joining
        try:
            where = join(self.session, cfg, int(init_info.rank_offset), self.worker, made)
        except Exception as e:
            raise RuntimeError(f"nccl_sync: could not join the trainer at {cfg.host} "
                               f"(control port {cfg.control_port}, group port {cfg.group_port}) "
                               f"within {cfg.timeout_s:.0f} s: {clip(repr(e))}") from e
        log.info("nccl_sync: joined the trainer's group as rank %d", where.rank)

    def start_weight_update(self) -> None:
        """Nothing to prepare (loading is set up per update by `VllmWeightLoader`); refuses
        early when the worker never joined."""
        self._require_joined()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one whole update (vLLM's base would also call
        `torch.accelerator.synchronize()`, which fails on the CPU backend; the receiver returns
        only once its loads have completed)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: NcclSyncUpdateInfo) -> None:
        """Receive while the trainer pushes; raise if the update failed or was another one."""
        rank = self._require_joined()
        summary = self.session.receive(update_info.timeout_s)
        self.last = summary.to_dict()
        if not summary.ok:
            held = (f"it still holds {held_weights(summary.version)}" if summary.consistent else
                    f"its weights may mix {held_weights(summary.version)} with the failed "
                    "update (consistent: false until the next complete update)")
            raise RuntimeError(f"nccl_sync: update {update_info.version} failed on rank "
                               f"{rank}: {summary.error} ({held})")
        adapter = summary.extra.get("adapter")
        got = summary.version if adapter is None else self.session.state.adapters[adapter]
        if got != update_info.version:
            raise RuntimeError(f"nccl_sync: rank {rank} received update {got}, but "
                               f"update_weights announced {update_info.version}")

    def finish_weight_update(self) -> None:
        """Nothing left: the commit round already ran inside `update_weights`."""

    def shutdown(self) -> None:
        """Leave the transfer group (vLLM keeps serving)."""
        try:
            self.session.close()
        except Exception:  # noqa: BLE001 - shutting down must not fail the engine
            log.exception("nccl_sync: closing the receiver failed")

    def _require_joined(self) -> int:
        """This worker's rank; raises when it never joined."""
        if self.session.receiver is None:
            raise RuntimeError("nccl_sync: this worker has not joined a trainer; call "
                               "init_weight_transfer_engine first")
        return self.session.receiver.rank


class _Worker:
    """The worker as `VllmWeightLoader` and the session see it: vLLM hands the engine the model
    that receives the update (which `set_weight_update_target` may change), not the worker."""

    def __init__(self, engine: NcclSyncWeightTransferEngine) -> None:
        self._engine = engine
        self.device = engine.device
        self.vllm_config = engine.vllm_config

    @property
    def model_runner(self) -> SimpleNamespace:
        return SimpleNamespace(model=self._engine.model)
