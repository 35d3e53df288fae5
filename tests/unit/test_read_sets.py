"""Read sets (`wire/reads.py`): the checker over one engine replica's workers, and the bounds."""

from __future__ import annotations

import msgspec
import pytest

from vllm_nccl_sync.outcomes import Kind
from vllm_nccl_sync.wire.reads import Block, Read, ReadSet, nbytes, problems, whole

QKV = [64, 32]  # a column-parallel weight: each worker reads a range of rows
O = [32, 64]  # a row-parallel weight: each worker reads a range of columns
NORM = [32]


def rows(shape: list[int], a: int, b: int) -> Read:
    return Read("float32", shape, [Block([a, 0], [b, shape[1]])])


def cols(shape: list[int], a: int, b: int) -> Read:
    return Read("float32", shape, [Block([0, a], [shape[0], b])])


def tp2() -> list[ReadSet]:
    """A valid TP=2 split: rows of q, columns of o, the norm whole on both."""
    return [ReadSet(w, {"q.weight": rows(QKV, 32 * w, 32 * (w + 1)),
                        "o.weight": cols(O, 32 * w, 32 * (w + 1)),
                        "norm.weight": whole("float32", NORM)}) for w in (0, 1)]


def texts(sets: list[ReadSet]) -> list[str]:
    found = problems(sets)
    assert all(p.kind is Kind.READS for p in found)
    return [p.text for p in found]


def test_a_tensor_parallel_split_is_accepted_and_counts_replicated_bytes_twice():
    sets = tp2()
    assert texts(sets) == []
    model = (64 * 32 + 32 * 64 + 32) * 4
    assert sum(nbytes(s) for s in sets) == model + 32 * 4  # the norm, once more


def test_a_block_outside_its_tensor_is_refused_by_name():
    sets = tp2()
    sets[1].tensors["q.weight"] = rows(QKV, 32, 65)
    text, unread = texts(sets)  # a refused read covers nothing
    assert "worker 1, tensor 'q.weight'" in text and "outside the tensor's shape" in text
    assert unread == "tensor 'q.weight': element [32, 0] of [64, 32] is read by no worker"


def test_blocks_of_one_worker_that_overlap_are_refused_by_name():
    sets = tp2()
    sets[0].tensors["q.weight"] = Read("float32", QKV, [Block([0, 0], [32, 32]),
                                                         Block([16, 0], [40, 32])])
    [text] = texts(sets)
    assert "worker 0, tensor 'q.weight'" in text and "overlap" in text


def test_an_element_no_worker_reads_is_refused_by_name():
    sets = tp2()
    sets[1].tensors["o.weight"] = cols(O, 32, 63)  # the last column: nobody's
    assert texts(sets) == ["tensor 'o.weight': element [0, 63] of [32, 64] is read by no worker"]
    sets[1].tensors.pop("o.weight")
    assert texts(sets) == ["tensor 'o.weight': element [0, 32] of [32, 64] is read by no worker"]


def test_disagreeing_shapes_dims_and_whole_reads_are_refused():
    sets = tp2()
    sets[1].tensors["norm.weight"] = whole("float32", [33])
    sets[0].tensors["q.weight"] = Read("float32", QKV, [Block([0], [32])])
    sets[0].tensors["o.weight"] = Read("float32", O, [Block([0, 0], [32, 32])], why="computed")
    assert texts(sets) == [
        "worker 0, tensor 'q.weight': block [0]..[32] has not the 2 dims of [64, 32]",
        ("worker 0, tensor 'o.weight': read whole (computed) but its blocks are not the whole "
         "tensor"),
        "worker 1, tensor 'norm.weight': float32[33] but another worker reads it as float32[32]",
        "tensor 'q.weight': element [0, 0] of [64, 32] is read by no worker",
        "tensor 'o.weight': element [0, 0] of [32, 64] is read by no worker"]

def test_read_sets_round_trip_and_their_bounds_are_enforced_on_decode():
    sets = tp2()
    back = msgspec.convert(msgspec.to_builtins(sets[0]), ReadSet)
    assert back == sets[0]
    raw = msgspec.to_builtins(sets[0])
    raw["tensors"]["q.weight"]["blocks"][0]["start"][0] = -1
    with pytest.raises(msgspec.ValidationError, match="blocks"):
        msgspec.convert(raw, ReadSet)


def test_a_loaders_views_become_blocks_exactly():
    """`integrations.vllm.reads.block_of`: the views TP loaders copy from (`narrow` of rows,
    of columns, a whole tensor, a flattened one) are blocks; a strided view is none."""
    import torch

    from vllm_nccl_sync.integrations.vllm.reads import block_of, merged

    t = torch.empty(8, 6)

    def view(v: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        return v.storage_offset(), tuple(v.shape), tuple(v.stride())

    assert block_of(view(t.narrow(0, 4, 4)), [8, 6]) == Block([4, 0], [8, 6])
    assert block_of(view(t.narrow(1, 3, 3)), [8, 6]) == Block([0, 3], [8, 6])
    assert block_of(view(t.reshape(-1)), [8, 6]) == Block([0, 0], [8, 6])
    assert block_of(view(t[2:3].unsqueeze(0)), [8, 6]) == Block([2, 0], [3, 6])
    assert block_of(view(t[:, ::2]), [8, 6]) is None
    assert block_of(view(t.reshape(-1)[3:9]), [8, 6]) is None  # rows 0 and 1, in part
    assert merged([Block([0, 0], [4, 6]), Block([4, 0], [8, 6]), Block([0, 0], [4, 6])]) == [
        Block([0, 0], [8, 6])]
    assert merged([Block([2, 0], [3, 6]), Block([0, 0], [2, 6]), Block([2, 0], [4, 6])]) == [
        Block([0, 0], [4, 6])]  # joined, then joined with one it overlaps
    assert len(whole("float32", [1], "x" * 5000).why) == 1024
