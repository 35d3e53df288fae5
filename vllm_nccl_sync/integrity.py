"""Per-bucket integrity: a checksum of the wire bytes, computed by the sender, checked by receivers.

CPU (gloo): CRC-32 of the bytes. CUDA (NCCL): a position-weighted sum of the bytes' 32-bit words
computed on the GPU (sensitive to changed, swapped and shifted words), since copying a bucket to
the host to hash it would cost more than the transfer. Both sides of one group use the same
device type, hence the same function. The result is never 0 (0 means "no checksum" on the wire).
"""

from __future__ import annotations

import zlib

import torch

_CHUNK = 1 << 22  # words per step on CUDA: bounds the temporary int64 tensors to 32 MiB
_weights: dict[torch.device, torch.Tensor] = {}
_MASK = (1 << 63) - 1


def checksum(data: torch.Tensor) -> int:
    """Checksum of a flat uint8 tensor; blocks until the bytes are ready (a host sync on CUDA)."""
    if data.device.type == "cpu":
        return (zlib.crc32(memoryview(data.numpy())) << 1) | 1
    n4 = data.numel() // 4 * 4
    words = data[:n4].view(torch.int32)
    w = _weights.get(data.device)
    if w is None:
        w = _weights[data.device] = torch.arange(1, _CHUNK + 1, dtype=torch.int64, device=data.device)
    acc = torch.zeros((), dtype=torch.int64, device=data.device)
    for i, start in enumerate(range(0, words.numel(), _CHUNK)):
        part = words[start : start + _CHUNK].to(torch.int64)
        acc += (part * (w[: part.numel()] + i)).sum()
    tail = data[n4:].to(torch.int64).sum() * 1_000_003
    total = int((acc + tail).item()) & _MASK
    return ((total ^ data.numel()) << 1) | 1
