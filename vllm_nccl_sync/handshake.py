"""What an engine can take: the reference every announced tensor is checked against.

Before any byte moves, each receiver checks the trainer's plan (and every bucket header) against
a `Reference`: the HF names, dtypes and full shapes of the engine's model. The trainer always
sends full HF-named tensors, so the reference is in those terms too, whatever vLLM does with them
afterwards (qkv/gate_up stacking, TP shards, CPU packing). For a vLLM engine it is read from the
safetensors headers of the checkpoint the engine was started from (metadata only, no weights).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import struct
from dataclasses import dataclass, field

from .protocol import TensorSpec

_ST_DTYPES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8",
    "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool",
}
_FLOATS = {"bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(slots=True)
class Reference:
    """Tensors an engine accepts: `{name: (dtype, shape)}`, plus tied aliases and cast targets."""

    tensors: dict[str, tuple[str, list[int]]]
    aliases: dict[str, str] = field(default_factory=dict)
    """`{alias: canonical}`: e.g. `lm_head.weight` -> `model.embed_tokens.weight` when tied."""
    float_dtypes: set[str] = field(default_factory=set)
    """Floating dtypes accepted for any floating tensor besides its own (the engine's dtype)."""

    def problems(self, specs: list[TensorSpec], full: bool = False) -> list[str]:
        """Every way `specs` disagrees with this reference (empty: acceptable)."""
        out: list[str] = []
        seen: set[str] = set()
        for s in specs:
            name = self.aliases.get(s.name, s.name)
            seen.add(name)
            ref = self.tensors.get(name)
            if ref is None:
                out.append(f"unknown tensor {s.name!r}: the engine's model has no such weight")
                continue
            dtype, shape = ref
            if list(s.shape) != shape:
                out.append(f"tensor {s.name!r}: shape {list(s.shape)} != engine's {shape}")
            ok = s.dtype == dtype or (
                dtype in _FLOATS and s.dtype in _FLOATS and s.dtype in self.float_dtypes
            )
            if not ok:
                out.append(f"tensor {s.name!r}: dtype {s.dtype} != engine's {dtype}")
        if full:
            missing = sorted(set(self.tensors) - seen)
            if missing:
                shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
                out.append(f"full update misses {len(missing)} tensors: {shown}")
        return out


def read_safetensors_index(model_dir: str) -> dict[str, tuple[str, list[int]]]:
    """`{name: (dtype, shape)}` from the headers of every `*.safetensors` file in `model_dir`."""
    out: dict[str, tuple[str, list[int]]] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER:
                raise ValueError(f"{path}: safetensors header of {n} bytes is implausible")
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            out[name] = (_ST_DTYPES.get(meta["dtype"], meta["dtype"].lower()), list(meta["shape"]))
    return out


def checkpoint_reference(
    model_dir: str, tie_word_embeddings: bool, engine_dtype: str | None
) -> Reference | None:
    """The `Reference` of an engine started from the checkpoint in `model_dir`, or None (and a
    warning) if there are no local safetensors: then only the protocol's own checks apply.

    A tied checkpoint without `lm_head.weight` accepts it as an alias of the embedding; floating
    tensors may also arrive in the engine's dtype (`engine_dtype`, a wire dtype name)."""
    index = read_safetensors_index(model_dir) if model_dir and os.path.isdir(model_dir) else {}
    if not index:
        logging.getLogger(__name__).warning(
            "no local safetensors for %r: pushed tensors are not checked against the model",
            model_dir,
        )
        return None
    aliases = {}
    if tie_word_embeddings and "lm_head.weight" not in index:
        aliases["lm_head.weight"] = "model.embed_tokens.weight"
    return Reference(index, aliases, {engine_dtype} if engine_dtype else set())
