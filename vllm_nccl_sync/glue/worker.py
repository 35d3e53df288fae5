"""What every vLLM-side entry point does to join a trainer: rank, reference, `Receiver`.

Two front doors reach the same receiver: the worker extension (`Ext.nccl_sync_join`, reached by
`collective_rpc`) and vLLM's weight-transfer backend `nccl_sync` (`weight_transfer.py`, reached
by `init_weight_transfer_engine`). Both join through `join()` here, so ranks, the plan check
against the engine's checkpoint and the receiver's settings cannot drift apart.

vLLM is imported lazily (nothing here runs outside a vLLM worker).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from vllm_nccl_sync.engine.handshake import Reference
from vllm_nccl_sync.engine.receiver import Receiver, ReceiverState
from vllm_nccl_sync.planes.base import local_address
from vllm_nccl_sync.wire.config import SyncConfig


@dataclass(frozen=True, slots=True)
class WorkerRank:
    """Where one vLLM worker sits in the transfer group."""

    rank: int
    """Rank in the transfer group: `rank_offset + replica * workers_per_replica + local`."""
    replica: int
    """Data-parallel index of this worker's engine."""
    tp_rank: int
    tp_size: int
    host: str = ""
    """The address this worker reaches the trainer from (its data plane binds it); "" until
    it joined."""

    def to_dict(self) -> dict[str, int | str]:
        return {"rank": self.rank, "replica": self.replica, "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "host": self.host}


def worker_rank(parallel_config: Any, rank_offset: int) -> WorkerRank:
    """This worker's transfer rank, from vLLM's `ParallelConfig` (the formula vLLM's own NCCL
    backend uses, `vllm/distributed/weight_transfer/nccl_common.py`: `worker_init_process_group`).

    `parallel_config.rank` is the worker's rank inside its engine (tensor x prefill context x
    pipeline parallel, tensor innermost) and `world_size` that engine's worker count, whatever
    parallelism makes it up; with the `external_launcher` executor both already span the
    data-parallel replicas. The replica is `data_parallel_index` (0.32), else
    `data_parallel_rank` (0.26).
    """
    if rank_offset < 1:
        raise ValueError(f"rank_offset {rank_offset} must be >= 1 (rank 0 is the trainer)")
    tp_size = int(parallel_config.tensor_parallel_size)
    local = int(parallel_config.rank)
    replica = getattr(parallel_config, "data_parallel_index", None)
    if replica is None:
        replica = getattr(parallel_config, "data_parallel_rank", 0)
    replica = int(replica or 0)
    if getattr(parallel_config, "distributed_executor_backend", None) == "external_launcher":
        rank = rank_offset + local  # world_size and rank already include data parallelism
    else:
        rank = rank_offset + replica * int(parallel_config.world_size) + local
    return WorkerRank(rank=rank, replica=replica, tp_rank=local % tp_size, tp_size=tp_size)


def name_mapping(model_config: Any) -> Callable[[str], str | None] | None:
    """The model class's `hf_to_vllm_mapper` as a function (None if it has none): the renaming
    its `load_weights` applies to every checkpoint name before loading (None: dropped)."""
    from vllm.model_executor.model_loader.utils import get_model_architecture

    cls, _ = get_model_architecture(model_config)
    mapper = getattr(cls, "hf_to_vllm_mapper", None)
    if mapper is None:
        return None
    return lambda name: next(iter(mapper.apply_list([name])), None)


def reference(vllm_config: Any) -> Reference | None:
    """The engine's tensors in HF terms, from its checkpoint's safetensors headers, with names
    compared through the model's own mapping."""
    from vllm_nccl_sync.engine.handshake import checkpoint_reference
    from vllm_nccl_sync.wire.packing import dtype_name

    mc = vllm_config.model_config
    tied = bool(getattr(mc.hf_text_config, "tie_word_embeddings", False)
                or getattr(mc.hf_config, "tie_word_embeddings", False))
    return checkpoint_reference(mc.model, tied, dtype_name(mc.dtype), name_mapping(mc),
                                getattr(mc, "revision", None))


def join(cfg: SyncConfig, rank_offset: int, vllm_config: Any, device: Any,
         state: ReceiverState, adapters: Any = None) -> tuple[Receiver, WorkerRank]:
    """Join the trainer's transfer group as this worker; blocks until the trainer's
    `PushClient.connect()` meets it (at most `cfg.timeout_s`).

    `device` is the worker's device (used for the NCCL data plane; gloo receives on the host);
    `state` is what the worker holds across re-joins (version, consistency, counters);
    `adapters` makes the loader of a LoRA adapter update (`lora.AdapterStore.loader`; None: the
    engine refuses adapter updates).
    """
    where = replace(worker_rank(vllm_config.parallel_config, rank_offset),
                    host=local_address(cfg.host))
    dev = torch.device(device) if cfg.backend == "nccl" else None
    receiver = Receiver(
        cfg, where.rank, replica=where.replica, tp_rank=where.tp_rank, tp_size=where.tp_size,
        device=dev, reference=reference(vllm_config), state=state, adapters=adapters,
    )
    return receiver, where
