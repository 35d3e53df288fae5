"""Unit: planning and packing round-trip bit-exactly; wire bytes are exactly the payload."""

import pytest
import torch

from vllm_nccl_sync.wire.packing import (
    ALIGN,
    Bucket,
    Reassembler,
    pack,
    plan_buckets,
    validate_header,
)
from vllm_nccl_sync.wire.protocol import PROTOCOL_VERSION


def mixed_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        ("emb", torch.randn(50, 16, generator=g).to(torch.bfloat16)),
        ("norm", torch.randn(17, generator=g)),
        ("half", torch.randn(3, 5, generator=g).to(torch.float16)),
        ("ids", torch.randint(-(2**40), 2**40, (7,), generator=g)),
        ("empty", torch.empty(0, 4)),
        ("scalar", torch.tensor(3.5)),
        ("mask", torch.rand(9, generator=g) > 0.5),
        ("odd", torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g)),
        ("big", torch.randn(700, generator=g)),  # 2800 B: larger than a 1024 B bucket
        ("t", torch.randn(4, 6, generator=g).t()),  # not contiguous
    ]


def transfer(tensors, capacity):
    """Plan, pack, validate and unpack every bucket as a receiver would; returns (out, lengths)."""
    buckets = list(plan_buckets(tensors, capacity))
    re = Reassembler()
    out, lengths = {}, []
    for seq, b in enumerate(buckets):
        buf = torch.full((capacity,), 0xAB, dtype=torch.uint8)
        wire = pack(b, buf)
        h = b.header(1, seq, seq == len(buckets) - 1, PROTOCOL_VERSION)
        validate_header(h, seq, capacity)
        assert wire.numel() == h.length
        lengths.append((h.length, sum(s.nbytes for s in h.slots), len(h.slots)))
        rbuf = torch.zeros(capacity, dtype=torch.uint8)
        rbuf[: h.length] = wire
        for name, t in re.unpack(h, rbuf):
            out[name] = t.clone()
    re.finish()
    return out, lengths


@pytest.mark.parametrize("capacity", [1024, 4096, 1 << 20])
def test_round_trip_bit_exact(capacity):
    tensors = mixed_tensors()
    out, _ = transfer(tensors, capacity)
    assert list(out) == [n for n, _ in tensors]
    for name, t in tensors:
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        got, want = out[name].reshape(-1), t.contiguous().reshape(-1)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_big_tensor_is_chunked_and_buckets_stay_within_capacity():
    big = torch.arange(1000, dtype=torch.float32)
    buckets = list(plan_buckets([("big", big)], 1024))
    assert len(buckets) == 4  # 4000 bytes in 1024-byte buckets
    assert all(b.length <= 1024 for b in buckets)
    assert [s.start for b in buckets for s in b.slots] == [0, 1024, 2048, 3072]


def test_wire_bytes_equal_payload():
    _, lengths = transfer(mixed_tensors(), 4096)
    for length, payload, nslots in lengths:
        # Only inter-slot alignment padding, never a partly filled buffer's tail.
        assert payload <= length < payload + ALIGN * nslots
    assert sum(p for _, p, _ in lengths) == sum(
        t.numel() * t.element_size() for _, t in mixed_tensors()
    )


def test_views_are_aligned():
    for b in plan_buckets(mixed_tensors(), 4096):
        assert all(s.offset % ALIGN == 0 for s in b.slots)


def test_tensor_filling_bucket_exactly():
    t = torch.ones(256, dtype=torch.float32)  # 1024 B
    buckets = list(plan_buckets([("a", t), ("b", t)], 1024))
    assert [b.length for b in buckets] == [1024, 1024]


def test_rejects_bad_capacity_and_dtype():
    with pytest.raises(ValueError, match="multiple"):
        next(plan_buckets([("a", torch.ones(1))], 100))
    with pytest.raises(ValueError, match="not supported"):
        next(plan_buckets([("a", torch.ones(1, dtype=torch.complex64))], 1024))


def test_reassembler_rejects_out_of_order_and_incomplete():
    big = torch.arange(1000, dtype=torch.float32)
    buckets = list(plan_buckets([("big", big)], 1024))
    re = Reassembler()
    buf = torch.zeros(1024, dtype=torch.uint8)
    h0 = buckets[0].header(1, 0, False, PROTOCOL_VERSION)
    h2 = buckets[2].header(1, 2, False, PROTOCOL_VERSION)
    re.unpack(h0, buf)
    with pytest.raises(ValueError, match="out of order"):
        re.unpack(h2, buf)
    re2 = Reassembler()
    re2.unpack(h0, buf)
    with pytest.raises(ValueError, match="incomplete tensors: big"):
        re2.finish()


def test_stream_packer_matches_the_plan_and_holds_one_tensor():
    """`StreamPacker` lays buckets out exactly as `plan_buckets` + `pack` do, and never keeps a
    source tensor alive once its bytes are copied: when the next one is pulled, at most the one
    being cut (a chunked tensor spanning buckets) is still referenced."""
    import gc
    import weakref

    from vllm_nccl_sync.wire.packing import StreamPacker

    g = torch.Generator().manual_seed(3)
    shapes = [(7,), (300,), (5, 40), (0,), (1000,), (3,), (64, 64), (2,)]
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float32, torch.uint8,
              torch.float16, torch.float32, torch.bool]
    specs = list(zip(shapes, dtypes, strict=True))
    cap = 2048

    def make(i):
        shape, dt = specs[i]
        return (torch.randn(shape, generator=g) * 10).to(dt)

    ref = [(f"t{i}", make(i)) for i in range(len(specs))]
    want = []
    buf = torch.zeros(cap, dtype=torch.uint8)
    for b in plan_buckets(ref, cap):
        buf.zero_()  # padding between slots: zeros on both sides
        want.append((b.slots, pack(b, buf).clone()))
    alive: list[weakref.ref] = []
    peak = [0]

    def stream():
        for name, t in ref:
            gc.collect()
            peak[0] = max(peak[0], sum(r() is not None for r in alive))
            t = t.clone()  # a fresh tensor, as a gather would make
            alive.append(weakref.ref(t))
            yield name, t
            del t

    packer = StreamPacker(stream(), cap)
    got, last = [], False
    while not last:
        out = torch.zeros(cap, dtype=torch.uint8)
        slots, last = packer.fill(out)
        length = slots[-1].offset + slots[-1].nbytes if slots else 0
        got.append((slots, out[:length].clone()))
    got = [x for x in got if x[0]]  # a trailing empty last bucket is allowed
    assert [s for s, _ in got] == [s for s, _ in want]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want, strict=True))
    assert peak[0] <= 1, peak


def test_oversize_tensors_are_cut_on_whole_rows_and_loaded_by_rows():
    """Chunks of a tensor larger than a bucket are whole rows of dim 0 (28-byte rows here, which
    do not divide the capacity); a `RowLoader` gets them in order, in place, and nothing is
    staged; a loader that declines gets the reassembled tensor instead."""
    g = torch.Generator().manual_seed(5)
    big = torch.randn(300, 7, generator=g)
    small = torch.randn(5, generator=g)
    cap = 1024
    buckets = list(plan_buckets([("small", small), ("big", big)], cap))
    chunks = [s for b in buckets for s in b.slots if s.name == "big"]
    assert len(chunks) > 8 and all(s.start % 28 == 0 and s.nbytes % 28 == 0 for s in chunks)
    assert all(b.length <= cap for b in buckets)
    for takes in (True, False):
        out = torch.zeros_like(big)
        calls = []

        def load_rows(name, rows, first, shape):
            calls.append((name, first, rows.shape[0]))
            if takes:
                out[first : first + rows.shape[0]] = rows
            return takes

        re, got = Reassembler(load_rows), {}
        for k, b in enumerate(buckets):
            buf = torch.zeros(cap, dtype=torch.uint8)
            wire = pack(b, buf)
            for n, t in re.unpack(b.header(1, k, k == len(buckets) - 1, PROTOCOL_VERSION), wire):
                got[n] = t.clone()
        re.finish()
        assert torch.equal(got["small"], small)
        if takes:
            assert "big" not in got and torch.equal(out, big) and re.loaded_by_rows == 1
            assert [c[1] for c in calls] == [s.start // 28 for s in chunks]
        else:
            assert torch.equal(got["big"], big) and calls == [("big", 0, chunks[0].nbytes // 28)]


def test_alone_threshold_gives_large_tensors_buckets_of_their_own():
    """From `alone` bytes a tensor shares no bucket (sent from its own memory, no pack); gloo
    sets that at 4 MiB whatever the bucket, NCCL at half a bucket; below it tensors share."""
    from vllm_nccl_sync.wire.packing import GLOO_ALONE_BYTES, alone_bytes

    cap = 64 << 20
    assert alone_bytes(cap, "gloo") == GLOO_ALONE_BYTES and alone_bytes(cap, "nccl") == cap // 2
    assert alone_bytes(1024, "gloo") == 512
    tensors = [("a", torch.zeros(16)), ("big", torch.zeros(GLOO_ALONE_BYTES // 4)),
               ("b", torch.zeros(16)), ("c", torch.zeros(16))]
    solo = [[s.name for s in b.slots] for b in plan_buckets(tensors, cap, alone_bytes(cap, "gloo"))]
    shared = [[s.name for s in b.slots]
              for b in plan_buckets(tensors, cap, alone_bytes(cap, "nccl"))]
    assert solo == [["a"], ["big"], ["b", "c"]]
    assert shared == [["a", "big", "b", "c"]]


def test_zero_byte_tensors_never_make_a_bucket_of_their_own():
    """A zero-element tensor between tensors that travel alone joins the next bucket (it moves no
    byte), so no bucket is empty; the header stays valid and both tensors come out."""
    cap = 4096
    big = torch.arange(512, dtype=torch.float32)  # 2048 B: alone at the default threshold
    tensors = [("big0", big), ("empty", torch.zeros(0, 3)), ("big1", big + 1)]
    buckets = list(plan_buckets(tensors, cap))
    assert [[s.name for s in b.slots] for b in buckets] == [["big0"], ["empty", "big1"]]
    assert all(b.length for b in buckets)
    got = {}
    re = Reassembler()
    for k, b in enumerate(buckets):
        h = b.header(1, k, k == len(buckets) - 1, PROTOCOL_VERSION)
        validate_header(h, k, cap)
        wire = pack(b, torch.zeros(cap, dtype=torch.uint8))
        got.update({n: t.clone() for n, t in re.unpack(h, wire)})
    assert got["empty"].shape == (0, 3) and torch.equal(got["big1"], big + 1)



def test_a_bucket_read_where_its_slots_lie_unpacks_from_one_part_per_slot():
    """Buckets gathered from where each slot lies (no buffer): the slots' bytes come as one flat
    tensor each, a tensor over the capacity reassembled from its chunks across buckets."""
    from vllm_nccl_sync.wire.packing import as_bytes

    tensors = [(n, t) for n, t in mixed_tensors(3) if t.numel() and t.is_contiguous()]
    capacity = 1024
    buckets = list(plan_buckets(tensors, capacity, capacity + 1))
    re, out = Reassembler(), {}
    for seq, b in enumerate(buckets):
        h = b.header(1, seq, seq == len(buckets) - 1, PROTOCOL_VERSION)
        validate_header(h, seq, capacity)
        parts = [as_bytes(src)[s.start : s.start + s.nbytes].clone()
                 for s, src in zip(b.slots, b.sources, strict=True)]
        out.update((n, t.clone()) for n, t in re.unpack(h, parts))
    re.finish()
    assert len(buckets) < len(tensors) + 2  # gathered, the 2800-byte tensor over 3 buckets
    assert list(out) == [n for n, _ in tensors]
    for name, t in tensors:
        assert torch.equal(out[name].reshape(-1).view(torch.uint8),
                           t.reshape(-1).view(torch.uint8)), name


def test_the_same_bucket_into_the_same_buffer_is_unpacked_into_the_same_views():
    """Given `views`, a bucket of whole tensors unpacked again into the same buffer gives the
    same views (holding the new bytes); another buffer or other slots are unpacked anew, and a
    bucket of chunks is never kept."""
    a = {"x": torch.arange(6.0).reshape(2, 3), "y": torch.ones(5, dtype=torch.bfloat16)}
    [bucket] = plan_buckets(a.items(), 1024)
    h = bucket.header(1, 0, True, PROTOCOL_VERSION)
    bufs, views = [torch.empty(1024, dtype=torch.uint8) for _ in range(2)], {}
    pack(bucket, bufs[0])
    first = Reassembler(views=views).unpack(h, bufs[0])
    b = {"x": a["x"] + 10, "y": a["y"] * 2}
    [again_bucket] = plan_buckets(b.items(), 1024)
    pack(again_bucket, bufs[0])
    again = Reassembler(views=views).unpack(h, bufs[0])
    assert len(again) == 2 and all(x is y for (_, x), (_, y) in zip(again, first))
    assert all(torch.equal(t, b[n]) for n, t in again)
    pack(again_bucket, bufs[1])
    other = Reassembler(views=views).unpack(h, bufs[1])
    assert all(x is not y for (_, x), (_, y) in zip(other, first))
    assert all(torch.equal(t, b[n]) for n, t in other)
    big = {"z": torch.arange(600.0)}  # 2400 bytes: chunks over three buckets of 1024
    chunks = list(plan_buckets(big.items(), 1024))
    chunk_views: dict = {}
    re = Reassembler(views=chunk_views)
    for k, c in enumerate(chunks):
        pack(c, bufs[0])
        re.unpack(c.header(1, k, k == len(chunks) - 1, PROTOCOL_VERSION), bufs[0])
    assert chunk_views == {}


def test_a_bucket_read_again_from_the_same_parts_is_unpacked_into_the_same_views():
    """Given `views`, a bucket read where its slots lie, from the same mapped parts again, gives
    the same views (holding the parts' new bytes); other parts are unpacked anew; and
    `forget_in_place` drops such buckets' views (they hold the sender's memory mapped) while
    keeping those of a receive buffer."""
    from vllm_nccl_sync.wire.packing import as_bytes, forget_in_place

    a = {"x": torch.arange(6.0).reshape(2, 3), "y": torch.ones(5, dtype=torch.bfloat16)}
    [bucket] = plan_buckets(a.items(), 1024)
    h = bucket.header(1, 0, True, PROTOCOL_VERSION)
    parts = [as_bytes(t).clone() for t in a.values()]
    views: dict = {}
    first = Reassembler(views=views).unpack(h, parts)
    b = {"x": a["x"] + 10, "y": a["y"] * 2}
    for part, t in zip(parts, b.values(), strict=True):
        part.copy_(as_bytes(t))
    again = Reassembler(views=views).unpack(h, parts)
    assert len(again) == 2 and all(x is y for (_, x), (_, y) in zip(again, first))
    assert all(torch.equal(t, b[n]) for n, t in again)
    moved = [p.clone() for p in parts]
    other = Reassembler(views=views).unpack(h, moved)
    assert all(x is not y for (_, x), (_, y) in zip(other, first))
    assert all(torch.equal(t, b[n]) for n, t in other)
    buf = torch.empty(1024, dtype=torch.uint8)
    pack(bucket, buf)
    h1 = bucket.header(1, 1, True, PROTOCOL_VERSION)
    Reassembler(views=views).unpack(h1, buf)
    forget_in_place(views)
    assert list(views) == [1]


def test_a_bucket_packed_again_into_the_same_buffer_reuses_its_views_and_is_exact():
    """Given `views`, a bucket of whole tensors packed again into the same buffer is copied
    through the views it got the first time (in one call), and its bytes are the new tensors';
    other slots or another buffer are packed anew; a bucket of chunks keeps no views."""
    a = {"x": torch.arange(6.0).reshape(2, 3), "y": torch.ones(5, dtype=torch.bfloat16),
         "e": torch.empty(0)}
    [bucket] = plan_buckets(a.items(), 1024)
    bufs, views, plain = [torch.zeros(1024, dtype=torch.uint8) for _ in range(2)], {}, \
        torch.zeros(1024, dtype=torch.uint8)
    first = pack(bucket, bufs[0], views, 0).clone()
    assert torch.equal(first, pack(bucket, plain)) and 0 in views
    kept = views[0][2]
    b = {"x": a["x"] + 10, "y": a["y"] * 3, "e": torch.empty(0)}
    [again] = plan_buckets(b.items(), 1024)
    got = pack(again, bufs[0], views, 0)
    assert views[0][2] is kept  # the same slots into the same buffer: the same views
    assert torch.equal(got, pack(again, plain)) and not torch.equal(got, first)
    shaped = Bucket(again.slots, [b[s.name] for s in again.slots])  # its sources not flat
    assert torch.equal(pack(shaped, bufs[0], views, 0), pack(again, plain))
    pack(again, bufs[1], views, 0)
    assert views[0][2] is not kept and views[0][0] == bufs[1].data_ptr()
    [other] = plan_buckets({"x": b["x"].reshape(3, 2)}.items(), 1024)  # other slots
    assert torch.equal(pack(other, bufs[1], views, 0), pack(other, plain))
    assert views[0][1] == other.slots
    big = {"z": torch.arange(600.0)}  # chunks over three buckets of 1024
    chunk_views: dict = {}
    for k, c in enumerate(plan_buckets(big.items(), 1024)):
        assert torch.equal(pack(c, bufs[0], chunk_views, k), pack(c, plain))
    assert chunk_views == {}
