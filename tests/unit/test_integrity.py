"""The bucket checksums: what a transfer fault does to the bytes changes the value."""

from __future__ import annotations

import pytest
import torch

from vllm_nccl_sync.wire.cuda_sums import Row
from vllm_nccl_sync.wire.integrity import (
    Pending,
    checksum,
    checksum_gpu,
    checksum_parts,
    checksum_parts_gpu,
    read_back,
    reading,
)

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


@pytest.mark.gpu
def test_gpu_checksum_equals_the_cpu_one() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (N + 3,), dtype=torch.uint8, generator=g)
    for view in (data, data[3:], data[:511], data[:0]):
        assert read_back([checksum_gpu(view.cuda())]) == [checksum(view)]


def _parts(seed: int) -> list[torch.Tensor]:
    """Parts of a gathered bucket: whole rows, rows and a tail, a tail only, loose bytes."""
    g = torch.Generator().manual_seed(seed)
    sizes = (2 * 4096, 64 * 4096 * 3 + 8 * 7, 8 * 33, 8 * 5 + 3, 8)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_a_gathered_bucket_of_one_part_has_that_parts_checksum_and_faults_change_it(
        native: bool, monkeypatch) -> None:
    """Host parts are summed in one native call where it was built (else by torch): either way a
    part alone has its `checksum`, and every fault changes the bucket's."""
    from vllm_nccl_sync.wire import integrity

    if native and integrity._copy_many is None:
        pytest.skip("the native summing copy was not built here")
    if not native:
        monkeypatch.setattr(integrity, "_copy_many", None)
    parts = _parts(6)
    assert checksum_parts(parts[1:2]) == checksum(parts[1])
    ref = checksum_parts(parts)
    assert read_back([checksum_parts_gpu(parts)]) == [ref]  # queued: the native sums are ints
    assert 0 < ref < 2**63 and ref % 2 == 1
    bad = {"two parts swapped": [parts[1], parts[0], *parts[2:]],
           "a part missing": parts[:-1],
           "bytes moved from one part to the next": [parts[0][:-8], torch.cat(
               [parts[0][-8:], parts[1]]), *parts[2:]]}
    for k in (0, 1, 3):
        flipped = [p.clone() for p in parts]
        flipped[k][-1] ^= 0x01
        bad[f"a bit flipped in part {k}"] = flipped
    for what, got in bad.items():
        assert checksum_parts(got) != ref, what


def test_read_back_reads_rows_of_one_launch_as_their_own_tensors() -> None:
    """Terms named as rows of one tensor of sums (`Row`: what one kernel launch computed) read
    back as the same terms held as tensors of their own, beside ints and other tensors, each
    row where it lies."""
    sums = torch.tensor([5, -7, 2**62 + 3, 11], dtype=torch.int64)
    loose = torch.tensor(-(2**40), dtype=torch.int64)
    as_rows = [Pending([(Row(sums, 2), 1), (loose, 3), (Row(sums, 0), 5)], 100), 17,
               Pending([(Row(sums, 1), 7), (Row(sums, 3), 9)], 9)]
    as_tensors = [Pending([(sums[2].clone(), 1), (loose.clone(), 3), (sums[0].clone(), 5)], 100),
                  17, Pending([(sums[1].clone(), 7), (sums[3].clone(), 9)], 9)]
    got = read_back(as_rows)
    assert got == read_back(as_tensors) and got[1] == 17
    swapped = [Pending([(Row(sums, 0), 1), (loose, 3), (Row(sums, 2), 5)], 100)]
    assert read_back(swapped)[0] != got[0]


def test_a_reading_gathers_the_sums_when_queued_and_reads_them_when_called() -> None:
    """`reading` gathers the device's sums when it is made (on CUDA: queued behind the work
    that computes them), so the receiver can do it before it waits for its loads; calling it
    gives `read_back`'s values, of the sums as they were gathered."""
    sums = torch.tensor([5, -7, 2**62 + 3, 11], dtype=torch.int64)
    loose = torch.tensor(-(2**40), dtype=torch.int64)
    pending = [Pending([(Row(sums, 2), 1), (loose, 3)], 100), 17,
               Pending([(Row(sums, 1), 7), (Row(sums, 3), 9), (Row(sums, 0), 5)], 9)]
    want = read_back(pending)
    read = reading(pending)
    sums.add_(1)  # after the gather: a later write to the sums' memory is not what is read
    loose.add_(1)
    assert read() == want and read() == want
    assert read_back(pending) != want
    assert reading([3, 0])() == [3, 0]


@pytest.mark.gpu
def test_gathered_gpu_checksums_equal_the_cpu_ones_misaligned_parts_included() -> None:
    """On CUDA the parts' whole words are summed by one kernel (where Triton is installed),
    the rest by torch: the values must be the CPU formula's, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    parts = _parts(7)
    odd = torch.randint(0, 256, (4096 + 9,), dtype=torch.uint8)
    host = [*parts, odd[1:]]  # a part not aligned to 8 bytes
    dev = [p.cuda() for p in parts] + [odd.cuda()[1:]]
    for _ in range(2):  # the second call reuses the kernel's cached table
        assert read_back([checksum_parts_gpu(dev)]) == [checksum_parts(host)]
    dev[1][5] ^= 0x40  # the cached table holds addresses, never values
    assert read_back([checksum_parts_gpu(dev)]) != [checksum_parts(host)]


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_a_host_copy_sums_exactly_the_bytes_it_writes(native: bool, monkeypatch) -> None:
    """`copies_summed_host`, native or by torch, copies every byte of every pair in one call
    (many rows, a short run, a tail of words and loose bytes; a destination 16-byte aligned,
    whose stores stream, and one only 8-byte aligned) and gives the terms of what it wrote: the
    same checksum as summing the copy. The bytes around each destination are left alone; pairs
    of different sizes, or not contiguous, are refused before anything is copied."""
    from vllm_nccl_sync.wire import integrity
    from vllm_nccl_sync.wire.integrity import copies_summed_host

    if native and integrity._copy_many is None:
        pytest.skip("the native summing copy was not built here")
    if not native:
        monkeypatch.setattr(integrity, "_copy_many", None)
    pairs, rooms = [], []
    for n in (N, 600 * 4096 + 8 * 7 + 5, 16, 3, 0):
        for shift in (0, 8):
            src = torch.randint(0, 256, (n,), dtype=torch.uint8)
            room = torch.zeros(n + 32, dtype=torch.uint8)
            start = (-room.data_ptr()) % 16 + shift
            pairs.append((room[start : start + n], src))
            rooms.append((room, start, n))
    got = copies_summed_host(pairs)
    for (dst, src), (room, start, n), terms in zip(pairs, rooms, got, strict=True):
        assert torch.equal(dst, src), (n, start)
        assert not room[:start].any() and not room[start + n :].any(), (n, start)
        parts = [torch.randint(0, 256, (4096,), dtype=torch.uint8), src]
        assert checksum_parts(parts, [None, terms]) == checksum_parts(parts), (n, start)
    dst = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="different sizes"):
        copies_summed_host([(dst, torch.ones(16, dtype=torch.uint8))])
    with pytest.raises(ValueError, match="not contiguous"):
        copies_summed_host([(dst, torch.ones(16, dtype=torch.uint8)[::2])])
    assert not dst.any()


def test_the_native_summing_copy_is_built_where_a_compiler_is() -> None:
    """`pip install` builds `_copysum` wherever a C compiler is found (it is optional, so a
    failed build would otherwise go unnoticed and every host copy take the slower torch path);
    it refuses addresses not 8-byte aligned."""
    import os
    import shutil
    import sysconfig

    from vllm_nccl_sync.wire import integrity

    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not (shutil.which("cc") or shutil.which("gcc")) or not os.path.exists(headers):
        pytest.skip("no C compiler here")
    assert integrity._copy_many is not None, "setup.py did not build vllm_nccl_sync.wire._copysum"
    buf = torch.zeros(2 * 4096 + 16, dtype=torch.uint8)
    out = torch.zeros(3, dtype=torch.int64)
    table = torch.tensor([buf.data_ptr() + 1, buf.data_ptr() + 4096, 4096])
    with pytest.raises(ValueError, match="aligned"):
        integrity._copy_many(table.data_ptr(), 1, out.data_ptr())
    assert not buf.any()


def test_a_tapped_module_load_sums_what_it_copies_and_only_what_the_tap_wants() -> None:
    """`ModuleLoader` under a receiver's tap copies the tensors the tap wants through the
    summing copy (their terms handed over), the others plainly; all land bit for bit."""
    from vllm_nccl_sync.engine.loaders import ModuleLoader
    from vllm_nccl_sync.wire.taps import Tap, tapping

    model = torch.nn.Linear(64, 48)
    w, b = torch.randn(48, 64), torch.randn(48)
    tap = Tap()
    tap.want(w.view(-1).view(torch.uint8))
    token = tapping.set(tap)
    try:
        ModuleLoader(model).load([("weight", w), ("bias", b)])
    finally:
        tapping.reset(token)
    assert torch.equal(model.weight.detach(), w) and torch.equal(model.bias.detach(), b)
    got = tap.take(w.view(-1).view(torch.uint8))
    flat = w.view(-1).view(torch.uint8)
    assert got is not None and checksum_parts([flat], [got]) == checksum(flat)
    assert tap.take(b.view(-1).view(torch.uint8)) is None
