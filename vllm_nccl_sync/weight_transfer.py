"""vLLM's own RL weight-sync API as the front door: the `nccl_sync` weight-transfer backend.

This module is the backend's public import path (its code lives in `integrations.vllm.transfer`).

RL frameworks drive weight updates through vLLM's native API: `init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update` on `LLM`, `AsyncLLM` or the HTTP
server's RL routes, with the backend chosen by name (`weight_transfer_config={"backend": ...}`).
This module is that backend for this project, on both sides:

* Engine side, `NcclSyncWeightTransferEngine` (vLLM's `WeightTransferEngineFactory`, name
  `nccl_sync`): `init_weight_transfer_engine` joins the trainer's transfer group through
  `integrations.vllm.worker.join` (the same join, rank formula and checkpoint reference as `Ext`);
  `update_weights` runs one whole `EngineSession.receive` into `VllmWeightLoader` (plan check, exact
  headers, checksums, commit round, timeouts). A failed update raises, which is how vLLM reports
  a failed weight-transfer call: the engine core catches it and keeps serving, `LLM`/`AsyncLLM`
  raise "Call to collective_rpc method failed: Worker failed with error 'nccl_sync: ...'", and
  the HTTP route answers 500 with that message. The receiver's state says whether the weights
  stayed intact.
* Trainer side, `NcclSyncTrainerEngine` (vLLM's `WeightTransferTrainerFactory`, same name):
  takes vLLM's `WeightSource` (`ModuleSource(model)` or a framework's) and a
  `VLLMWeightSyncClient` (`HTTPVLLMWeightSyncClient(url)`, `RayVLLMWeightSyncClient(actors)`, or
  an in-process `LLM`, wrapped here), and pushes with `PushClient` while the engine's
  `update_weights` call receives.

A trainer written against vLLM's API needs only the init info::

    info = NcclSyncTrainerInitInfo(world_size=1 + n_engine_workers, rank=0)
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(model))
    trainer.send_weights()          # version 1, 2, ... (or send_weights(version=step))

Importing this module registers the backend with both factories (the `vllm.general_plugins`
entry point registers it in every vLLM process without importing this module). Which vLLM
versions get what: `integrations/vllm/transfer/backend.py`.
"""

from __future__ import annotations

from vllm_nccl_sync.integrations.vllm.transfer.backend import BACKEND, register
from vllm_nccl_sync.integrations.vllm.transfer.clients import AsyncEngineClient, OfflineClient
from vllm_nccl_sync.integrations.vllm.transfer.engine import (
    SURFACE,
    NcclSyncInitInfo,
    NcclSyncUpdateInfo,
    NcclSyncWeightTransferEngine,
)
from vllm_nccl_sync.integrations.vllm.transfer.source import FSDPWeightSource
from vllm_nccl_sync.integrations.vllm.transfer.trainer import (
    NcclSyncTrainerEngine,
    NcclSyncTrainerInitInfo,
    WeightTransferFailed,
)

__all__ = [
    "BACKEND",
    "SURFACE",
    "AsyncEngineClient",
    "FSDPWeightSource",
    "NcclSyncInitInfo",
    "NcclSyncTrainerEngine",
    "NcclSyncTrainerInitInfo",
    "NcclSyncUpdateInfo",
    "NcclSyncWeightTransferEngine",
    "OfflineClient",
    "WeightTransferFailed",
]

register()  # a trainer that imports this module finds the backend in vLLM's factories
