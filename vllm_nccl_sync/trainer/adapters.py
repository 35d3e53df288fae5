"""LoRA adapter updates on the trainer side: the tensors and `AdapterSpec` of one adapter.

An adapter update is a mapping of PEFT-named LoRA tensors (`base_model.model....lora_A.weight`)
plus the adapter's config; the engine adds the adapter or replaces its weights (docs/lora.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vllm_nccl_sync.wire.names import split_name
from vllm_nccl_sync.wire.protocol import AdapterSpec


def adapter_update(adapter: Any, name: str, lora_id: int, rank: int | None = None,
                   alpha: float | None = None, target_modules: list[str] | None = None
                   ) -> tuple[dict[str, torch.Tensor], AdapterSpec]:
    """The tensors and `AdapterSpec` of a LoRA adapter update, from a PEFT model (its active
    adapter, through `peft.get_peft_model_state_dict`) or from a mapping plus its config.

    Raises `TypeError` for anything else, `ValueError` when a mapping comes without `rank`,
    `alpha` and `target_modules`."""
    if hasattr(adapter, "peft_config"):
        from peft import get_peft_model_state_dict

        cfg = adapter.peft_config[adapter.active_adapter]
        tensors = dict(get_peft_model_state_dict(adapter))
        rank = cfg.r if rank is None else rank
        alpha = cfg.lora_alpha if alpha is None else alpha
        targets = cfg.target_modules if target_modules is None else target_modules
        if isinstance(targets, str):  # a regex or "all-linear": the modules the tensors name
            targets = {split_name(n)[0] for n in tensors}
        target_modules = sorted({t.rsplit(".", 1)[-1] for t in targets})  # PEFT may give paths
    elif isinstance(adapter, Mapping):
        tensors = dict(adapter)
    else:
        raise TypeError(f"adapter must be a PEFT model or a mapping, not {type(adapter).__name__}")
    if rank is None or alpha is None or target_modules is None:
        raise ValueError("a mapping of LoRA tensors needs rank, alpha and target_modules")
    return tensors, AdapterSpec(name, lora_id, int(rank), float(alpha), list(target_modules))
