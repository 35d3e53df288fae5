"""Per-bucket integrity: a checksum of the wire bytes, computed by the sender, checked by receivers.

Both are position-weighted sums of the bytes' words (wrap-around integer arithmetic), so a changed
word changes the sum and a swap or shift changes the weights it meets. CPU (gloo, `checksum`): the
64-bit words summed in rows of 512 bytes (one read of the data at memory speed: about 4x CRC-32
here), then the row sums weighted by their positions. CUDA (NCCL, `checksum_gpu`): 32-bit
words, computed on the GPU into a 0-d tensor without any host sync, so a whole update's checksums
are read back once. Both sides of one group use the same device type, hence the same function.
Values are positive and below 2**63 and never 0 (0 means "no checksum" on the wire).
"""

from __future__ import annotations

import torch

_COLS = 4096  # words per row of the 2-D view the GPU checksum reduces
_MASK = (1 << 62) - 1
_ramps: dict[torch.device, torch.Tensor] = {}


def _ramp(n: int, device: torch.device) -> torch.Tensor:
    """1, 2, ..., n as int64 on `device` (cached, grown on demand)."""
    r = _ramps.get(device)
    if r is None or r.numel() < n:
        r = _ramps[device] = torch.arange(1, max(n, _COLS) + 1, dtype=torch.int64, device=device)
    return r[:n]


def checksum_gpu(data: torch.Tensor) -> torch.Tensor:
    """Checksum of a flat uint8 tensor as a 0-d int64 tensor on its device, queued on the
    current stream (no host sync), read back once per update.

    The 32-bit words, viewed as rows of `_COLS`, are summed along rows and along columns (two
    reads of the data, no copy; 32-bit wrap-around sums), then the row and column sums are
    weighted by their positions: a changed word changes both, a swap or shift changes the
    weighted sums. Temporaries stay below 1/4096 of the bucket.
    """
    dev = data.device
    n4 = data.numel() // 4
    rows = n4 // _COLS
    words = data[: n4 * 4].view(torch.int32)
    acc = torch.zeros((), dtype=torch.int64, device=dev)
    if rows:
        block = words[: rows * _COLS].view(rows, _COLS)
        acc += (block.sum(dim=1, dtype=torch.int32).to(torch.int64) * _ramp(rows, dev)).sum()
        acc += (block.sum(dim=0, dtype=torch.int32).to(torch.int64) * _ramp(_COLS, dev)).sum() * 7919
    tail = words[rows * _COLS :]
    if tail.numel():
        acc += (tail.to(torch.int64) * _ramp(tail.numel(), dev)).sum() * 31
    rest = data[n4 * 4 :]
    if rest.numel():
        acc += (rest.to(torch.int64) * _ramp(rest.numel(), dev)).sum() * 1_000_003
    return (((acc & _MASK) ^ data.numel()) << 1) | 1


_CPU_COLS = 64  # 64-bit words per row of the CPU checksum (512 B)
_odds: list[torch.Tensor] = []


def _odd(n: int) -> torch.Tensor:
    """1, 3, 5, ... (n values) as int64 on the CPU (cached, grown on demand): odd weights, so no
    change of a row can be multiplied away modulo 2**64."""
    if not _odds or _odds[0].numel() < n:
        _odds[:] = [torch.arange(1, 2 * max(n, _CPU_COLS), 2, dtype=torch.int64)]
    return _odds[0][:n]


def checksum(data: torch.Tensor) -> int:
    """Checksum of a flat uint8 CPU tensor (one read of the data); CUDA uses `checksum_gpu`.

    The 64-bit words in rows of 512 bytes are summed per row (wrap-around; the reduction runs at
    memory speed), then the row sums are weighted by odd position weights: a changed word changes
    its row's sum, and a moved, shifted, stale or missing row meets another weight. Words
    permuted inside one row are not told apart: transports move byte ranges, not words.
    """
    if data.data_ptr() % 8:
        data = data.clone()  # 64-bit words need an aligned start
    n8 = data.numel() // 8
    rows = n8 // _CPU_COLS
    words = data[: n8 * 8].view(torch.int64)
    acc = 0
    if rows:
        per_row = words[: rows * _CPU_COLS].view(rows, _CPU_COLS).sum(dim=1)
        acc += int(torch.dot(per_row, _odd(rows)))
    tail = words[rows * _CPU_COLS :]
    if tail.numel():
        acc += int(torch.dot(tail, _odd(tail.numel()))) * 31
    rest = data[n8 * 8 :]
    if rest.numel():
        acc += int(torch.dot(rest.to(torch.int64), _odd(rest.numel()))) * 1_000_003
    return (((acc & _MASK) ^ data.numel()) << 1) | 1
