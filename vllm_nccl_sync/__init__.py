"""vllm-nccl-sync: hot-swap the weights of a running vLLM engine from an RL trainer.

Trainer side: `SyncConfig`, `PushClient` (one push to many engines), `WeightSync` (drives the
engines it holds: `LLMHandle`, `AsyncLLMHandle`, `HTTPHandle`), `full_tensors` (FSDP2 sources).
Engine side: `Ext`, the vLLM worker extension (`--worker-extension-cls vllm_nccl_sync.Ext`);
`lora_request` names an adapter pushed into it.
Checks: `verify` (the engine holds exactly the trainer's tensors). Outcomes: `SyncError` and its
kinds, `WorkerSummary`. The layout of the package is drawn in docs/architecture.md.
"""

from vllm_nccl_sync.integrations.vllm.handles import AsyncLLMHandle, HTTPHandle, LLMHandle
from vllm_nccl_sync.integrations.vllm.ext import Ext
from vllm_nccl_sync.integrations.vllm.lora import lora_request
from vllm_nccl_sync.moved import install as _install_moved
from vllm_nccl_sync.outcomes import (
    PeerFailed,
    ProtocolError,
    PushError,
    SyncError,
    UpdateFailed,
    UpdateRefused,
    WorkerSummary,
)
from vllm_nccl_sync.trainer.push import PushClient, PushResult
from vllm_nccl_sync.trainer.sources import full_tensors
from vllm_nccl_sync.trainer.sync import EngineHandle, WeightSync
from vllm_nccl_sync.verify import verify
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.protocol import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION", "AsyncLLMHandle", "EngineHandle", "Ext", "HTTPHandle", "LLMHandle",
    "PeerFailed", "ProtocolError", "PushClient", "PushError", "PushResult", "SyncConfig",
    "SyncError", "UpdateFailed", "UpdateRefused", "WeightSync", "WorkerSummary", "full_tensors",
    "lora_request", "verify",
]
__version__ = "0.1.0"
_install_moved()  # old import paths keep working, with a DeprecationWarning (moved.MOVED)
