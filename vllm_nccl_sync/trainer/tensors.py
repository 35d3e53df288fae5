"""What goes into a push and what comes out: the tensors' wire form (tied aliases once, the
faithful cast to the engine's dtype) and `PushResult`.

The cast. Each engine announces the dtype it holds its floating-point weights in (`Hello.dtype`).
A floating-point tensor in another of float32, bfloat16 and float16 is cast to it on the trainer
(a bf16 trainer feeding an fp32 engine, fp32 master weights feeding a bf16 engine), except into
float16 from bfloat16 or float32, whose range can overflow: that is refused, naming the option
that casts on purpose. An explicit `dtype` always wins. fp8, float64 and integer tensors are never
cast: the engine's plan check judges them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_nccl_sync.outcomes import PushError
from vllm_nccl_sync.wire.packing import DTYPES, dtype_name
from vllm_nccl_sync.wire.protocol import Ack, Hello

log = logging.getLogger(__name__)

CASTABLE = (torch.float32, torch.bfloat16, torch.float16)
"""The floating-point dtypes a push casts between."""

CAST_OPTION = ("push(dtype=torch.float16) (WeightSync.update(dtype=...), or `dtype` in "
               "NcclSyncTrainerInitInfo)")
"""How a caller casts into float16 on purpose (named by the refusal)."""


@dataclass(frozen=True, slots=True)
class PushResult:
    """What one update moved, and every receiver's acknowledgement."""

    version: int
    buckets: int
    bytes: int
    tensors: int
    seconds: float
    acks: list[Ack]
    per_sender: dict[int, int] = field(default_factory=dict)
    """Several senders, on the coordinator: the bytes each sender rank sent (`bytes`: its own)."""
    per_receiver: dict[int, int] = field(default_factory=dict)
    """Shard to shard: the bytes sent to each receiver rank ({}: every receiver got every
    bucket, `bytes`)."""
    whole: dict[str, str] = field(default_factory=dict)
    """Shard to shard: the tensors some worker reads whole because its loaders could not be
    followed, each with the reason (`Read.why`: a loader that computes, replay refused)."""
    cast: dict[str, str] = field(default_factory=dict)
    """Dtypes this sender cast on the way (`{"bfloat16": "float32"}`: from -> to)."""
    live: list[dict[str, Any]] = field(default_factory=list)
    """`WeightSync.update`: per engine, when the update went live there, as its engine core
    reported it (`integrations.vllm.patches.swap_turn`): `version`, vLLM's `label` ("" where this
    vLLM has
    none) and `time` (`time.time()` of the engine-core turn); {} where it did not report."""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


Progress = Callable[[int, int, float], None]
"""Called after each bucket is sent with (buckets so far, bytes so far, seconds so far)."""


def without_aliases(tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The mapping's items, minus later names for a tensor already listed (tied weights)."""
    seen: set[tuple] = set()
    for name, t in tensors.items():
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        yield name, t


def engine_dtype(hellos: Mapping[int, Hello]) -> str:
    """The floating-point dtype every engine announced ("" if none did); `PushError` naming them
    when engines announce different ones."""
    held: dict[str, list[int]] = {}
    for rank, h in sorted(hellos.items()):
        if h.dtype:
            held.setdefault(h.dtype, []).append(rank)
    if len(held) > 1:
        named = "; ".join(f"ranks {r} hold {d}" for d, r in sorted(held.items()))
        raise PushError(f"the engines hold different dtypes ({named}): push(dtype=...) picks the "
                        "one every engine is sent")
    return next(iter(held), "")


def faithful(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a cast from `src` to `dst` keeps every value in range (float16 holds less range
    than bfloat16 and float32)."""
    return src in CASTABLE and dst in CASTABLE and (dst != torch.float16 or src == dst)


class Caster:
    """Casts each tensor of a push to its wire dtype (see the module text) and records what it
    cast. `dtype`: the caller's explicit choice; `engine`: the engines' announced dtype name."""

    def __init__(self, dtype: torch.dtype | None, engine: str = "") -> None:
        self.dtype = dtype
        self.engine = DTYPES.get(engine) if dtype is None and engine else None
        self.cast: dict[str, str] = {}
        self.counts: dict[str, int] = {}

    def target(self, name: str, src: torch.dtype) -> torch.dtype:
        """The wire dtype of tensor `name` held as `src`; `PushError` for a cast that could
        overflow (into float16) unless the caller asked for it."""
        if self.dtype is not None:
            return self.dtype if src in CASTABLE or src == torch.float64 else src
        dst = self.engine
        if dst is None or src == dst or src not in CASTABLE:
            return src
        if not faithful(src, dst):
            raise PushError(f"tensor {name!r} is {dtype_name(src)} and the engine holds "
                            f"{dtype_name(dst)}: a cast into {dtype_name(dst)} can overflow; "
                            f"cast on purpose with {CAST_OPTION}")
        return dst

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Tensor `name` in its wire dtype."""
        return self.to(t, self.target(name, t.dtype))

    def to(self, t: torch.Tensor, dst: torch.dtype) -> torch.Tensor:
        """`t` cast to `dst`, recorded (`cast`) when that changes its dtype."""
        if dst == t.dtype:
            return t
        key = dtype_name(t.dtype)
        self.cast[key] = dtype_name(dst)
        self.counts[key] = self.counts.get(key, 0) + 1
        return t.to(dst)

    def each(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """`items` cast, letting each tensor go before the next one is pulled (a generator
        expression would keep the previous one alive while the source makes the next)."""
        for name, t in items:
            t = self(name, t)
            yield name, t
            del t

    def report(self, version: int) -> None:
        """Log what this update cast, once (INFO)."""
        if self.cast:
            done = ", ".join(f"{self.counts[s]} {s} -> {d}" for s, d in sorted(self.cast.items()))
            why = "as asked" if self.dtype is not None else "to the engine's dtype"
            log.info("update %d: cast %s tensor(s) %s", version, done, why)
