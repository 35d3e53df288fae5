"""The same-host planes' registry of storages exported for reading in place
(`planes.segments.Exports`): one segment per live storage, and the segments of dead storages
handed back to be forgotten (the plane deletes their published handles), so fresh tensors every
step leak nothing. The registry only sees addresses and lifetimes."""

from __future__ import annotations

import torch

from vllm_nccl_sync.planes.segments import Exports


def storage(t: torch.Tensor) -> torch.UntypedStorage:
    return t.untyped_storage()


def test_a_live_storage_keeps_its_segment_and_an_unknown_one_has_none():
    ex = Exports()
    a, b = torch.empty(256), torch.empty(256)
    assert ex.get(storage(a)) is None
    assert ex.add(storage(a), 0) == []
    assert ex.get(storage(a)) == 0
    assert ex.get(storage(a[10:].view(-1))) == 0  # a view: the same storage
    assert ex.get(storage(b)) is None


def test_storages_that_died_are_swept_and_their_segments_handed_back():
    ex = Exports()
    kept = [torch.empty(64) for _ in range(10)]
    dropped = [torch.empty(64) for _ in range(90)]
    dead_segments, unexportable = set(), set()
    handed: list[int] = []
    for i, t in enumerate(kept):
        handed += ex.add(storage(t), i)
    for i, t in enumerate(dropped):
        seg = -1 if i % 10 == 0 else 100 + i  # -1: a storage that could not be exported
        (unexportable if seg < 0 else dead_segments).add(seg)
        handed += ex.add(storage(t), seg)
    assert handed == []  # all alive so far: nothing swept
    del dropped, t
    late = []  # more storages pushed later: the registry sweeps once it doubled (a new one
    for _ in range(128):  # at a dead one's address replaces it at once)
        late.append(torch.empty(64))
        handed += ex.add(storage(late[-1]), 1001 + len(late) - 1)
    assert set(handed) == dead_segments and len(handed) == len(dead_segments)  # never -1
    assert len(ex) == len(kept) + len(late)  # only the live ones are left
    assert [ex.get(storage(t)) for t in kept] == list(range(10))
    assert [ex.get(storage(t)) for t in late] == [1001 + i for i in range(len(late))]


def test_a_new_storage_at_a_dead_ones_address_is_a_new_segment():
    ex = Exports()
    memory = bytearray(1024)  # two storages over it, one after the other: the same address
    t = torch.frombuffer(memory, dtype=torch.uint8)
    address = t.data_ptr()
    ex.add(storage(t), 5)
    del t
    u = torch.frombuffer(memory, dtype=torch.uint8)
    assert u.data_ptr() == address
    assert ex.get(storage(u)) is None  # not the dead storage's segment
    assert ex.add(storage(u), 6) == [5]  # the dead one's handle goes
    assert ex.get(storage(u)) == 6 and len(ex) == 1
