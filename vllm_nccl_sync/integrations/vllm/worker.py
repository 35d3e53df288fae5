"""What a vLLM worker tells its `EngineSession`: rank, loader, reference, dtype, adapters.

Two front doors reach the same session: the worker extension (`Ext`, reached by
`collective_rpc`) and vLLM's weight-transfer backend `nccl_sync` (`transfer_engine`, reached by
`init_weight_transfer_engine`). Both build it with `vllm_session` and join through `join` here,
so ranks, the plan check against the engine's checkpoint and the receiver's settings cannot drift
apart. vLLM is imported lazily (nothing here runs outside a vLLM worker).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from vllm_nccl_sync.engine.handshake import Reference, checkpoint_reference
from vllm_nccl_sync.engine.session import EngineSession, Placement
from vllm_nccl_sync.integrations.vllm.checksums import VllmLayout
from vllm_nccl_sync.integrations.vllm.reads import read_set_of
from vllm_nccl_sync.planes.rendezvous import local_address
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.packing import dtype_name


def worker_rank(parallel_config: Any, rank_offset: int) -> Placement:
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
    return Placement(rank=rank, replica=replica, tp_rank=local % tp_size, tp_size=tp_size)


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
    mc = vllm_config.model_config
    tied = bool(getattr(mc.hf_text_config, "tie_word_embeddings", False)
                or getattr(mc.hf_config, "tie_word_embeddings", False))
    return checkpoint_reference(mc.model, tied, dtype_name(mc.dtype), name_mapping(mc),
                                getattr(mc, "revision", None))


def _tensor_parallel() -> tuple[int, int]:
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def vllm_session(worker: Any, adapters: Callable[[Any, Reference | None], Any]) -> EngineSession:
    """The session of a vLLM worker, or of anything shaped like one (`model_runner.model`,
    `device`, `vllm_config`); `adapters(worker, reference)` makes its LoRA adapter store when the
    engine runs with LoRA enabled (`lora.AdapterStore.for_worker` or `for_model`)."""
    from vllm_nccl_sync.integrations.vllm.patches.sleep import install

    install()  # in case the plugin entry point did not run in this process (idempotent)
    lora = getattr(worker.vllm_config, "lora_config", None) is not None
    return EngineSession(lambda: worker.model_runner.model, _tensor_parallel,
                         (lambda: adapters(worker, reference(worker.vllm_config))) if lora
                         else None, VllmLayout)


def loaders(worker: Any) -> Callable[[], Any]:
    """The `VllmWeightLoader` of `worker`'s current model, made once per model object."""
    from vllm_nccl_sync.integrations.vllm.loader import VllmWeightLoader

    held: list[Any] = []

    def current() -> Any:
        if not held or held[0].model is not worker.model_runner.model:
            held[:] = [VllmWeightLoader(worker)]  # refuses, saying why, a model it cannot update
        return held[0]

    return current


def join(session: EngineSession, cfg: SyncConfig, rank_offset: int, worker: Any,
         made: Callable[[], Any]) -> Placement:
    """Join the trainer's transfer group as `worker`, loading through `made` (`loaders`);
    blocks until the trainer's `PushClient.connect()` meets it (at most `cfg.timeout_s`). This
    worker's rank is `rank_offset + replica * workers_per_replica + local rank` (`worker_rank`)."""
    vc = worker.vllm_config
    where = replace(worker_rank(vc.parallel_config, rank_offset),
                    details={"host": local_address(cfg.host)})
    ref = reference(vc)
    return session.join(cfg, where, made, reference=ref, dtype=dtype_name(vc.model_config.dtype),
                        device=torch.device(worker.device), reads=lambda: read_set_of(worker, ref))
