"""verl: the checkpoint-engine backend `vllm_nccl_sync` (`checkpoint_engine`). Importing this
package registers it, so verl's `custom_backend_module: vllm_nccl_sync.integrations.verl` works."""

from vllm_nccl_sync.integrations.verl.checkpoint_engine import (
    NAME,
    VllmNcclSyncCheckpointEngine,
    register,
)

__all__ = ["NAME", "VllmNcclSyncCheckpointEngine", "register"]
