"""Block-FP8 checkpoints (DeepSeek-V3, Qwen3-FP8): let the trainer send its bf16 weights.

Upstream: `Fp8LinearMethod` with `weight_block_size` in
`vllm/model_executor/layers/quantization/fp8.py`, which loads a `float8_e4m3fn` weight and a
float32 `weight_scale_inv` per 128 x 128 block (dequantized = fp8 * scale_inv) from the checkpoint.
vLLM would copy a bf16 tensor into the FP8 weight without a scale, silently wrong; so a floating
tensor sent for a weight the checkpoint stores block-quantized is quantized here first, the way
those checkpoints are made (scale_inv = block amax / 448), and loaded with its scale.

Bit for bit on every device: PyTorch's CUDA division by a Python number multiplies by its rounded
reciprocal (`x * (1/448)`, up to one ulp off `x / 448`, which the CPU computes), and one ulp of a
block's scale moves FP8 roundings of that block. So every division here is tensor by tensor (IEEE
correctly rounded on CPU and CUDA alike), and the engine quantizes exactly as a checkpoint made on
CPU was (vLLM then post-processes both the same way, e.g. DeepGEMM's UE8M0 requantization).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE = "_scale_inv"


@torch.no_grad()
def quantize(t: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(fp8 weight, float32 scale_inv per block)` of a 2-D tensor (edge blocks may be partial)."""
    n, k = t.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = t.float().new_zeros(rows * bn, cols * bk)
    padded[:n, :k] = t.float()
    blocks = padded.reshape(rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / torch.full_like(amax, FP8_MAX)  # not `/ FP8_MAX`: see the module docstring
    q = (blocks / scale[:, None, :, None]).reshape(rows * bn, cols * bk)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def blocks_of(index: dict[str, tuple[str, list[int]]], block: list[int] | None
              ) -> dict[str, tuple[int, int]]:
    """`{weight name: block}` of every weight a checkpoint `index` (`{name: (dtype, shape)}`)
    stores block-quantized (an FP8 tensor with a `<name>_scale_inv` beside it)."""
    if not block:
        return {}
    return {n: (int(block[0]), int(block[1])) for n, (d, _) in index.items()
            if d.startswith("float8") and n + SCALE in index}


def expand(batch: list[tuple[str, torch.Tensor]], blocks: dict[str, tuple[int, int]]
           ) -> list[tuple[str, torch.Tensor]]:
    """`batch` with every floating, non-FP8 tensor for a block-quantized weight replaced by its
    FP8 weight and scale (tensors already FP8 pass as they are)."""
    out = []
    for name, t in batch:
        block = blocks.get(name)
        if block is None or t.dtype == torch.float8_e4m3fn or not t.is_floating_point():
            out.append((name, t))
            continue
        q, scale = quantize(t, block)
        out += [(name, q), (name + SCALE, scale)]
    return out
