"""The engine side of the `nccl_sync` weight-transfer backend (see `weight_transfer`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from vllm_nccl_sync.patches.vllm_weight_transfer import check_version

SURFACE = check_version()  # raises UnsupportedVllm, naming the supported versions, elsewhere

import torch  # noqa: E402
from vllm.config.weight_transfer import WeightTransferConfig  # noqa: E402
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from vllm_nccl_sync.engine.receiver import ReceiverState  # noqa: E402
from vllm_nccl_sync.outcomes import clip  # noqa: E402
from vllm_nccl_sync.wire.config import SyncConfig  # noqa: E402

log = logging.getLogger(__name__)




@dataclass
class NcclSyncInitInfo(WeightTransferInitInfo):
    """What `init_weight_transfer_engine` carries to every worker (JSON-safe; the trainer
    engine builds it)."""

    sync_config: dict[str, Any]
    """`SyncConfig.to_dict()` of the trainer: its address, ports, world size, data plane."""
    rank_offset: int = 1
    """Transfer rank of this engine's first worker (1 for the first engine behind a trainer)."""


@dataclass
class NcclSyncUpdateInfo(WeightTransferUpdateInfo):
    """What `update_weights` carries: which update to expect, and how long to wait for it."""

    version: int
    """The version the trainer pushes; the worker refuses to report success for another."""
    timeout_s: float | None = None
    """Bound on the wait for the push to start (default: the config's `timeout_s`)."""


class NcclSyncWeightTransferEngine(WeightTransferEngine[NcclSyncInitInfo, NcclSyncUpdateInfo]):
    """vLLM worker-side weight-transfer engine running this project's `Receiver`."""

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
        super().__init__(config, vllm_config, device, model)
        self.state = ReceiverState()  # outlives re-joins, like Ext's
        self.receiver: Any = None
        self.where: Any = None
        self.last: dict[str, Any] | None = None
        """Summary of the last update (ok, version, consistent, bytes, error, ...)."""
        self._loader: Any = None
        self._adapters: Any = None  # lora.AdapterStore, LoRA engines only (outlives re-joins)

    def init_transfer_engine(self, init_info: NcclSyncInitInfo) -> None:
        """Join the trainer's transfer group (blocks until the trainer connects, bounded)."""
        from vllm_nccl_sync.glue.worker import join

        cfg = SyncConfig.from_dict(dict(init_info.sync_config))  # ValueError names the field
        self.shutdown()
        if getattr(self, "model", None) is not None:  # refuse a model it cannot update, first
            self._loader_for(self.model)
        try:
            self.receiver, self.where = join(cfg, int(init_info.rank_offset), self.vllm_config,
                                             self.device, self.state, self._adapter_loaders())
        except Exception as e:
            raise RuntimeError(f"nccl_sync: could not join the trainer at {cfg.host} "
                               f"(control port {cfg.control_port}, group port {cfg.group_port}) "
                               f"within {cfg.timeout_s:.0f} s: {clip(repr(e))}") from e
        log.info("nccl_sync: joined the trainer's group as rank %d", self.where.rank)

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
        """Run `Receiver.receive` while the trainer pushes; raise if the update failed."""
        receiver = self._require_joined()
        adapters_before = dict(self.state.adapters)
        summary = receiver.receive(self._loader_for(self.model), update_info.timeout_s)
        self.last = summary
        if not summary.get("ok"):
            held = (f"it still holds version {summary.get('version')}"
                    if summary.get("consistent") else
                    f"its weights may mix version {summary.get('version')} with the failed "
                    "update (consistent: false until the next complete update)")
            raise RuntimeError(f"nccl_sync: update {update_info.version} failed on rank "
                               f"{receiver.rank}: {summary.get('error')} ({held})")
        adapter = any(v == update_info.version and adapters_before.get(n) != v
                      for n, v in self.state.adapters.items())  # a LoRA adapter's update
        if summary.get("version") != update_info.version and not adapter:
            raise RuntimeError(f"nccl_sync: rank {receiver.rank} received update "
                               f"{summary.get('version')}, but update_weights announced "
                               f"{update_info.version}")

    def finish_weight_update(self) -> None:
        """Nothing left: the commit round already ran inside `update_weights`."""

    def shutdown(self) -> None:
        """Leave the transfer group (vLLM keeps serving)."""
        if self.receiver is not None:
            receiver, self.receiver = self.receiver, None
            try:
                receiver.close()
            except Exception:  # noqa: BLE001 - shutting down must not fail the engine
                log.exception("nccl_sync: closing the receiver failed")

    def _adapter_loaders(self) -> Any:
        """`AdapterStore.loader` when the engine runs with LoRA enabled, else None."""
        if getattr(self.vllm_config, "lora_config", None) is None:
            return None
        if self._adapters is None:
            from vllm_nccl_sync.glue.lora import AdapterStore
            from vllm_nccl_sync.glue.worker import reference

            self._adapters = AdapterStore.for_model(self.model, reference(self.vllm_config))
        return self._adapters.loader

    def _require_joined(self) -> Any:
        if self.receiver is None:
            raise RuntimeError("nccl_sync: this worker has not joined a trainer; call "
                               "init_weight_transfer_engine first")
        return self.receiver

    def _loader_for(self, model: torch.nn.Module) -> Any:
        from vllm_nccl_sync.glue.vllm_loader import VllmWeightLoader

        if self._loader is None or self._loader.model is not model:
            view = SimpleNamespace(model_runner=SimpleNamespace(model=model), device=self.device,
                                   vllm_config=self.vllm_config)
            self._loader = VllmWeightLoader(view)
        return self._loader
