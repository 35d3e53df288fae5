"""vLLM's weight-transfer backend `nccl_sync`: its registration per vLLM version (`backend`), the
worker engine (`engine`), the trainer engine (`trainer`) and the clients it drives (`clients`).
Users import it from `vllm_nccl_sync.weight_transfer`."""
