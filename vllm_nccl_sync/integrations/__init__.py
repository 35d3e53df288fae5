"""Adapters that plug vllm-nccl-sync into RL frameworks (each imports its framework lazily)."""
