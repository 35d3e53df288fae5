"""What an engine can take: the reference every announced tensor is checked against.

Before any byte moves, each receiver checks the trainer's plan (and every bucket header) against
a `Reference`: the HF names, dtypes and full shapes of the engine's model. The trainer always
sends full HF-named tensors, so the reference is in those terms too, whatever vLLM does with them
afterwards (qkv/gate_up stacking, TP shards, CPU packing). For a vLLM engine it is read from the
safetensors headers of the checkpoint the engine was started from (metadata only, no weights),
a local directory or a model id in the Hugging Face hub cache.

Names are compared the way the model's own loader sees them: through `canon`, the model's
`hf_to_vllm_mapper` (vLLM's `WeightsMapper`), so a trainer may send any spelling the loader
accepts (e.g. a VLM's `model.language_model.*` against a checkpoint saved as `model.*`), and a name
the loader drops (the mapper returns None) is refused before any byte moves.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_nccl_sync.outcomes import Kind, Problem
from vllm_nccl_sync.wire.protocol import TensorSpec

_ST_DTYPES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8",
    "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool",
}
_FLOATS = {"bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"}
_MAX_HEADER = 100 * 1024 * 1024
_BLOCK_SCALE = "_scale_inv"  # beside a block-FP8 weight (see integrations.vllm.block_fp8)


@dataclass(slots=True)
class Reference:
    """Tensors an engine accepts: `{name: (dtype, shape)}`, plus tied aliases and cast targets."""

    tensors: dict[str, tuple[str, list[int]]]
    aliases: dict[str, str] = field(default_factory=dict)
    """`{alias: canonical}`: e.g. `lm_head.weight` -> `model.embed_tokens.weight` when tied."""
    float_dtypes: set[str] = field(default_factory=set)
    """Floating dtypes accepted for any floating tensor besides its own (the engine's dtype)."""
    canon: Callable[[str], str | None] | None = None
    """The model loader's name mapping (None: names are taken as they are); `tensors` and
    `aliases` are keyed by the checkpoint's names and mapped through it too."""
    _canonical: dict[str, str] | None = field(default=None, init=False, repr=False)

    def _index(self) -> dict[str, str]:
        """`{canonical name: checkpoint name}`."""
        if self._canonical is None:
            self._canonical = {}
            for name in self.tensors:
                key = self.canon(name) if self.canon else name
                if key is not None:
                    self._canonical.setdefault(key, name)
        return self._canonical

    def resolve(self, name: str) -> str | None:
        """The checkpoint name that `name` (any spelling the loader accepts, or a tied alias)
        stands for, or None if the model has no such weight."""
        name = self.aliases.get(name, name)
        if name in self.tensors:
            return name
        if self.canon is None:
            return None
        key = self.canon(name)
        found = self._index().get(key) if key is not None else None
        if found is None and key is not None:  # an alias spelled another way
            for alias, target in self.aliases.items():
                if self.canon(alias) == key:
                    return target
        return found

    def problems(self, specs: list[TensorSpec], full: bool = False) -> list[Problem]:
        """Every way `specs` disagrees with this reference, each a `Kind.MODEL` problem (empty:
        acceptable)."""
        out: list[str] = []
        seen: set[str] = set()
        for s in specs:
            name = self.resolve(s.name)
            if name is None:
                dropped = self.canon is not None and self.canon(s.name) is None
                out.append(f"unknown tensor {s.name!r}: " + (
                    "the model's loader drops this name" if dropped
                    else "the engine's model has no such weight"))
                continue
            seen.add(name)
            ref = self.tensors[name]
            dtype, shape = ref
            if list(s.shape) != shape:
                out.append(f"tensor {s.name!r}: shape {list(s.shape)} != engine's {shape}")
            blocks = name + _BLOCK_SCALE in self.tensors  # block-FP8: the engine quantizes
            ok = s.dtype == dtype or (
                dtype in _FLOATS and s.dtype in _FLOATS and (
                    (s.dtype in self.float_dtypes and not dtype.startswith("float8"))
                    or (dtype.startswith("float8") and blocks))
            )
            if blocks and s.dtype != dtype:
                seen.add(name + _BLOCK_SCALE)  # made with the weight
            if not ok and dtype.startswith("float8"):
                out.append(f"tensor {s.name!r}: dtype {s.dtype}, but the engine's checkpoint "
                           f"stores it as {dtype} with a per-tensor or per-channel scale that a "
                           "bf16 tensor does not carry. Send the quantized tensor and its scale, "
                           "or serve an unquantized checkpoint with quantization='fp8' "
                           "(re-quantized on load)")
            elif not ok:
                out.append(f"tensor {s.name!r}: dtype {s.dtype} != engine's {dtype}")
        if full:
            missing = sorted(set(self.tensors) - seen)
            if missing:
                shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
                out.append(f"full update misses {len(missing)} tensors: {shown}")
        return [Problem(Kind.MODEL, text) for text in out]


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


def local_model_dir(model: str, revision: str | None = None) -> str | None:
    """`model` if it is a directory, else its snapshot in the local Hugging Face hub cache (never
    downloads), else None."""
    if model and os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True,
                                 allow_patterns=["*.safetensors", "*.json"])
    except Exception:  # noqa: BLE001 - not a cached model id: the caller says what that means
        return None


def checkpoint_reference(
    model_dir: str, tie_word_embeddings: bool, engine_dtype: str | None,
    canon: Callable[[str], str | None] | None = None, revision: str | None = None,
) -> Reference | None:
    """The `Reference` of an engine started from the checkpoint `model_dir` (a directory or a
    cached hub model id), or None (and a warning) if it has no local safetensors: then only the
    protocol's own checks apply.

    A tied checkpoint without `lm_head.weight` accepts it as an alias of the embedding; floating
    tensors may also arrive in the engine's dtype (`engine_dtype`, a wire dtype name); `canon` is
    the model loader's name mapping (see `Reference.canon`)."""
    path = local_model_dir(model_dir, revision) if model_dir else None
    index = read_safetensors_index(path) if path else {}
    if not index:
        logging.getLogger(__name__).warning(
            "no local safetensors for %r: pushed tensors are not checked against the model",
            model_dir,
        )
        return None
    aliases = {}
    if tie_word_embeddings and "lm_head.weight" not in index:
        embed = [n for n in index if n.endswith("embed_tokens.weight")]
        if len(embed) == 1:  # e.g. model.language_model.embed_tokens.weight in a VLM
            aliases["lm_head.weight"] = embed[0]
    return Reference(index, aliases, {engine_dtype} if engine_dtype else set(), canon)
