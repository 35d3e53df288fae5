"""vllm-nccl-sync: hot-swap the weights of a running vLLM engine from an RL trainer.

Trainer side: `SyncConfig`, `PushClient` (and `WeightSync` to drive engines it holds).
Engine side: `Ext`, the vLLM worker extension (`--worker-extension-cls vllm_nccl_sync.Ext`).
"""

from .config import SyncConfig
from .ext import Ext
from .protocol import PROTOCOL_VERSION
from .sender import PushClient, PushError, PushResult

__all__ = ["PROTOCOL_VERSION", "Ext", "PushClient", "PushError", "PushResult", "SyncConfig"]
__version__ = "0.1.0"
