"""Tensor-name conventions both ends share: PEFT's LoRA adapter names."""

from __future__ import annotations

PEFT_PREFIX = "base_model.model."
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def split_name(name: str) -> tuple[str, bool]:
    """`(module, is_lora_a)` of a PEFT LoRA tensor name; ValueError for anything else."""
    for suffix in LORA_SUFFIXES:
        if name.endswith(suffix):
            module = name[: -len(suffix)]
            return module.removeprefix(PEFT_PREFIX), suffix == LORA_SUFFIXES[0]
    raise ValueError(f"tensor {name!r} is not a LoRA weight (expected a name ending in "
                     "'.lora_A.weight' or '.lora_B.weight')")
