"""`FSDPWeightSource`: `full_tensors` as a vLLM `WeightSource`, for trainer backends written
against vLLM's weight-transfer API. Following that contract it yields on every rank (vLLM's
trainer engines drop the tensors on non-sender ranks); it is also a plain iterable of
`(name, tensor)`, so `PushClient.push(source, ...)` takes it as well."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from vllm_nccl_sync.trainer.sources import full_tensors, named_sources, wire_dtype


class FSDPWeightSource(WeightSource):
    """vLLM `WeightSource` over an FSDP2 (or plain) module: full tensors one at a time.

    `metadata()` reads the global shapes and gathers nothing; each `iter()` is a fresh pass that
    gathers every parameter in that order, on every rank (a collective per parameter; every rank
    yields, as vLLM's trainer engines expect). Names, tied weights and `dtype` as in
    `full_tensors`.
    """

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype | None = None) -> None:
        self._module = module
        self._dtype = dtype

    def metadata(self) -> list[Any]:
        return [ParamMeta(name, wire_dtype(t, self._dtype), tuple(t.shape))
                for name, t in named_sources(self._module)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return full_tensors(self._module, dtype=self._dtype, push_rank=None)
