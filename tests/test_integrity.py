"""The bucket checksums: what a transfer fault does to the bytes changes the value."""

from __future__ import annotations

import pytest
import torch

from vllm_nccl_sync.wire.integrity import checksum, checksum_gpu, read_back

N = 3 * 4096 + 8 * 5 + 3  # whole 4 KiB rows, a tail of words, and loose bytes


def _faults(data: torch.Tensor) -> dict[str, torch.Tensor]:
    """Copies of `data` as a faulty transfer could leave them."""
    out: dict[str, torch.Tensor] = {}
    for pos in (0, 7, 4095, 4096, 4096 * 2 + 77, N - 45, N - 9, N - 1):  # rows, tail, loose
        t = data.clone()
        t[pos] ^= 0x10
        out[f"bit flip at {pos}"] = t
    t = data.clone()
    t[0:4096], t[4096:8192] = data[4096:8192].clone(), data[0:4096].clone()
    out["two rows swapped"] = t
    t = data.clone()
    t[1:] = data[:-1].clone()
    out["shifted by one byte"] = t
    t = data.clone()
    t[8:] = data[:-8].clone()
    out["shifted by one word"] = t
    t = data.clone()
    t[4096:] = 0
    out["tail never written"] = t
    out["truncated"] = data[:-1]
    out["one byte more"] = torch.cat([data, data[:1]])
    return out


@pytest.mark.parametrize("fn", ["cpu", "cuda"])
def test_faults_change_the_checksum(fn: str) -> None:
    if fn == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (N,), dtype=torch.uint8, generator=g)
    if fn == "cuda":
        data = data.cuda()

    def value(t: torch.Tensor) -> int:
        return checksum(t) if fn == "cpu" else read_back([checksum_gpu(t)])[0]

    ref = value(data)
    assert ref == value(data.clone()) and 0 < ref < 2**63 and ref % 2 == 1
    for what, bad in _faults(data).items():
        assert value(bad) != ref, what


def test_cpu_checksum_ignores_the_start_address() -> None:
    """A view starting off a word boundary gives the value of the same bytes aligned."""
    g = torch.Generator().manual_seed(4)
    data = torch.randint(0, 256, (N + 3,), dtype=torch.uint8, generator=g)
    assert checksum(data[3:]) == checksum(data[3:].clone())
    assert checksum(data[:0]) == checksum(torch.empty(0, dtype=torch.uint8)) != 0


def test_gpu_checksum_equals_the_cpu_one() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (N + 3,), dtype=torch.uint8, generator=g)
    for view in (data, data[3:], data[:511], data[:0]):
        assert read_back([checksum_gpu(view.cuda())]) == [checksum(view)]
