"""SGLang: trainer-side handles (`handles`) and the custom weight loader run in each worker
(`worker`). `--custom-weight-loader vllm_nccl_sync.integrations.sglang.load` names `load` here."""

from vllm_nccl_sync.integrations.sglang.handles import (
    SGLangEngineHandle,
    SGLangHTTPHandle,
    http_payload,
    wait_healthy,
)
from vllm_nccl_sync.integrations.sglang.worker import (
    COMMAND_PREFIX,
    LOADER,
    METHODS,
    command_tensors,
    load,
    parse_command,
)

__all__ = [
    "COMMAND_PREFIX", "LOADER", "METHODS", "SGLangEngineHandle", "SGLangHTTPHandle",
    "command_tensors", "http_payload", "load", "parse_command", "wait_healthy",
]
