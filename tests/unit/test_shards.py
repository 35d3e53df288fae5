"""Shard to shard, piece by piece (no processes, no sockets, no vLLM): the trainer's buckets for
workers that published read sets (`trainer.shards`), the header rules of blocks
(`packing.validate_header`), a worker's reassembly of blocks (`packing.Reassembler`), its checks
of a plan against its own read set (`engine.update`), and where the feature is refused.

Three receivers throughout: ranks 1 and 2 are the workers of a TP=2 engine (replica 0), rank 3
the one worker of a TP=1 engine (replica 1), which reads every tensor whole."""

from __future__ import annotations

from collections.abc import Collection

import msgspec
import pytest
import torch

from vllm_nccl_sync.engine.update import Update
from vllm_nccl_sync.outcomes import Kind, Problem, PushError
from vllm_nccl_sync.planes.base import Handle, Transport
from vllm_nccl_sync.planes.registry import plane
from vllm_nccl_sync.trainer.shards import read_sets, shard_buckets
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.packing import (
    ALIGN,
    Blocks,
    Bucket,
    Reassembler,
    Region,
    align_up,
    alone_bytes,
    block_index,
    dtype_name,
    pack,
    validate_header,
    wholes,
)
from vllm_nccl_sync.wire.protocol import (
    PROTOCOL_VERSION,
    Block,
    BucketHeader,
    Hello,
    Plan,
    Read,
    ReadSet,
    Slot,
    TensorSpec,
)
from vllm_nccl_sync.wire.reads import nbytes, whole

P = PROTOCOL_VERSION
CAP = 2048
"""Bucket capacity: each half of `embed.weight` (4 KiB) is cut over several buckets."""
PLACES = {1: (0, 0, 2), 2: (0, 1, 2), 3: (1, 0, 1)}
"""rank: (replica, tp_rank, tp_size)."""


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "qkv.weight": torch.randn(16, 8, generator=g),  # rows split
        "o.weight": torch.randn(8, 16, generator=g).to(torch.bfloat16),  # columns split
        "norm.weight": torch.randn(8, generator=g),  # read whole by every worker
        "embed.weight": torch.randn(64, 32, generator=g),  # rows split, each half > a bucket
        "head.weight": torch.randn(4, 8, generator=g),  # TP worker 1 reads none of it
    }


def tp_read(name: str, t: torch.Tensor, worker: int, tp: int) -> Read:
    """What worker `worker` of a TP=`tp` engine reads of tensor `name`."""
    dt, shape = dtype_name(t.dtype), list(t.shape)
    if tp == 1 or name == "norm.weight" or (name == "head.weight" and worker == 0):
        return whole(dt, shape)
    if name == "head.weight":
        return Read(dt, shape, [])
    d = 1 if name == "o.weight" else 0
    n = shape[d] // tp
    start, stop = [0] * len(shape), list(shape)
    start[d], stop[d] = worker * n, (worker + 1) * n
    return Read(dt, shape, [Block(start, stop)])


def hellos(sd: dict[str, torch.Tensor]) -> dict[int, Hello]:
    return {rank: Hello(P, rank, replica, tp_rank, tp, CAP, "gloo", reads=ReadSet(
                tp_rank, {n: tp_read(n, t, tp_rank, tp) for n, t in sd.items()}))
            for rank, (replica, tp_rank, tp) in PLACES.items()}


def planned(sd: dict[str, torch.Tensor],
            reads: dict[int, ReadSet]) -> list[tuple[BucketHeader, torch.Tensor]]:
    """Every bucket of `sd` shard to shard: its header (checked as a receiver checks it) and its
    wire bytes."""
    buckets = list(shard_buckets(list(sd.items()), reads, CAP, alone_bytes(CAP, "gloo")))
    out = []
    for seq, b in enumerate(buckets):
        h = b.header(1, seq, seq == len(buckets) - 1, P)
        validate_header(h, seq, CAP)
        out.append((h, pack(b, torch.empty(CAP, dtype=torch.uint8))))
    return out


def joins(h: BucketHeader, rank: int) -> bool:
    return h.to is None or rank in h.to


def received(buckets: list[tuple[BucketHeader, torch.Tensor]], rank: int,
             rs: ReadSet) -> dict[str, torch.Tensor]:
    """What receiver `rank` reassembles from the buckets it joins."""
    re = Reassembler(reads=rs.tensors)
    got: dict[str, torch.Tensor] = {}
    for h, wire in buckets:
        for name, t in re.unpack(h, wire) if joins(h, rank) else ():
            assert name not in got, name
            got[name] = t
    re.finish()
    return got


def mask(read: Read) -> torch.Tensor:
    """True where `read` reads."""
    out = torch.zeros(read.shape, dtype=torch.bool)
    for b in read.blocks:
        out[block_index(b)] = True
    return out


@pytest.fixture
def shards() -> tuple[dict[str, torch.Tensor], dict[int, ReadSet], list]:
    sd = state()
    reads = read_sets(hellos(sd))
    return sd, reads, planned(sd, reads)


# ---------------------------------------------------------------- the trainer's buckets

def test_each_receiver_gets_exactly_what_it_reads(shards):
    """Unpacked from the buckets it joins, each receiver holds the source on the elements it
    reads and NaN elsewhere, nothing of a tensor it reads none of, and accepts the plan."""
    sd, reads, buckets = shards
    specs = [TensorSpec(n, dtype_name(t.dtype), list(t.shape)) for n, t in sd.items()]
    plan = Plan(P, 1, specs, buckets=[h for h, _ in buckets])
    for rank, rs in reads.items():
        got = received(buckets, rank, rs)
        assert sorted(got) == sorted(n for n, r in rs.tensors.items() if r.blocks), rank
        for name, t in got.items():
            m = mask(rs.tensors[name])
            assert t.dtype == sd[name].dtype and t.shape == sd[name].shape, name
            assert torch.equal(t[m], sd[name][m]), (rank, name)
            assert t[~m].isnan().all(), (rank, name)
        assert Update(rank, CAP, version=1, reads=dict(rs.tensors)).open(plan, None) is None


def test_a_staged_worker_keeps_copies_of_its_blocks_only_until_they_are_made_whole(shards):
    """Staged (`keep_blocks`), a tensor read in blocks is kept as copies of those blocks only
    (the read set's bytes, whatever happens to the buffer after), and `wholes` makes it the
    tensor the in-place path gets, in batches bounded by the limit."""
    sd, reads, buckets = shards
    for rank, rs in reads.items():
        re, kept = Reassembler(reads=rs.tensors, keep_blocks=torch.clone), []
        for h, wire in buckets:
            if joins(h, rank):
                buf = wire.clone()
                kept += [(n, t) for n, t in re.unpack(h, buf) if isinstance(t, Blocks)]
                buf.fill_(0)  # the buffer is reused for the next bucket
        re.finish()
        partial = {n for n, r in rs.tensors.items() if r.blocks
                   and r != whole(dtype_name(sd[n].dtype), list(sd[n].shape))}
        assert {n for n, _ in kept} == partial, rank
        held = sum(p.nbytes for _, b in kept for _, p in b.parts)
        assert held == sum(nbytes(rs.tensors[n]) for n in partial), rank
        batches = list(wholes(kept, 200))
        assert [n for b in batches for n, _ in b] == [n for n, _ in kept]
        assert len(batches) == len(kept), rank  # each tensor here is over 200 bytes
        assert len(kept) > 1 or rank == 3  # the TP=1 worker reads every tensor whole
        for name, t in (x for b in batches for x in b):
            m = mask(rs.tensors[name])
            assert t.shape == sd[name].shape and torch.equal(t[m], sd[name][m]), (rank, name)
            assert t[~m].isnan().all(), (rank, name)
    plain = [("a", torch.ones(4)), ("b", torch.zeros(4))]
    assert [[x[1] is y[1] for x, y in zip(b, plain)] for b in wholes(plain, 0)] == [[True, True]]


def test_each_receiver_joins_its_read_sets_bytes_and_alignment_only(shards):
    """The payload of the buckets a receiver joins is exactly the bytes it reads; the rest is
    padding, under `ALIGN` per slot."""
    _, reads, buckets = shards
    for rank, rs in reads.items():
        joined = [h for h, _ in buckets if joins(h, rank)]
        assert sum(s.nbytes for h in joined for s in h.slots) == nbytes(rs), rank
        for h in joined:
            assert 0 <= h.length - sum(s.nbytes for s in h.slots) < ALIGN * len(h.slots), h


def test_buckets_go_to_every_receiver_only_for_tensors_every_receiver_reads_whole(shards):
    """`to=None` holds only tensors all read whole; a bucket naming receivers carries each one's
    own blocks (or the whole tensor to one reading it whole), never a tensor it reads none of."""
    sd, reads, buckets = shards
    everyone = {n for n, t in sd.items()
                if all(rs.tensors[n] == whole(dtype_name(t.dtype), list(t.shape))
                       for rs in reads.values())}
    assert everyone == {"norm.weight"}
    for h, _ in buckets:
        for s in h.slots:
            assert (h.to is None) == (s.name in everyone), (h.to, s.name)
            for rank in h.to or ():
                read = reads[rank].tensors[s.name]
                assert read.blocks, f"rank {rank} is sent {s.name!r}, which it reads none of"
                assert s.blocks in (None, read.blocks) and (s.blocks is None) == (
                    read == whole(read.dtype, read.shape)), (rank, s)
    assert any(s.blocks and s.start for h, _ in buckets for s in h.slots)  # a region chunked


# ---------------------------------------------------------------- a worker's reassembly

W = [8, 4]
TOP, BOTTOM = Block([0, 0], [2, 4]), Block([2, 0], [4, 4])
READ = Read("float32", W, [Block([0, 0], [4, 4])])
"""This worker reads rows 0..4 of `w`: `TOP` and `BOTTOM`."""


def carried(t: torch.Tensor, blocks: list[Block], seq: int = 0) -> tuple[BucketHeader,
                                                                           torch.Tensor]:
    """A bucket whose one slot carries `blocks` of tensor `w` (`t`), and its wire bytes."""
    n = sum(b.numel() for b in blocks) * t.element_size()
    bucket = Bucket([Slot("w", dtype_name(t.dtype), list(t.shape), 0, n, blocks=blocks)],
                    [Region(t, blocks)])
    return bucket.header(1, seq, True, P), pack(bucket, torch.empty(n, dtype=torch.uint8))


def test_blocks_in_two_slots_complete_the_tensor_after_the_second():
    """Two senders' halves of what this worker reads: the tensor is handed on after both,
    whichever comes first, with NaN where the worker reads nothing."""
    t = torch.arange(32.0).view(W)
    re = Reassembler(reads={"w": READ})
    assert re.unpack(*carried(t, [BOTTOM])) == []
    [(name, got)] = re.unpack(*carried(t, [TOP], seq=1))
    assert name == "w" and torch.equal(got[:4], t[:4]) and got[4:].isnan().all()
    re.finish()


def test_blocks_left_incomplete_or_unread_are_refused_by_name():
    t = torch.arange(32.0).view(W)
    re = Reassembler(reads={"w": READ})
    assert re.unpack(*carried(t, [TOP])) == []
    with pytest.raises(ValueError, match="update ended with incomplete tensors: w$"):
        re.finish()
    with pytest.raises(ValueError, match="tensor 'w': blocks of it arrived, and this worker "
                                         "published no read of it"):
        Reassembler(reads={"x": READ}).unpack(*carried(t, [TOP]))


# ---------------------------------------------------------------- header rules of blocks

def one_slot(blocks: list[Block], nbytes: int) -> BucketHeader:
    return BucketHeader(P, 1, 0, nbytes, True, [Slot("w", "float32", W, 0, nbytes,
                                                     blocks=blocks)])


def test_a_slot_of_disjoint_blocks_inside_its_tensor_passes():
    validate_header(one_slot([TOP, BOTTOM], 64), 0, CAP)


@pytest.mark.parametrize("blocks, nbytes, why", [
    ([Block([6, 0], [9, 4])], 48, r"block \[6, 0\]..\[9, 4\] is outside the tensor's shape"),
    ([Block([0, 0], [3, 4]), BOTTOM], 80,
     r"blocks \[0, 0\]..\[3, 4\] and \[2, 0\]..\[4, 4\] overlap"),
    ([Block([0], [4])], 16, r"block \[0\]..\[4\] has not the 2 dims of \[8, 4\]"),
    ([TOP], 64, r"bytes \[0, 64\) exceed its size 32"),
    ([Block([0, 0], [0, 4])], 0, "a slot of blocks holding no element"),
    ([], 0, "a slot of blocks holding no element"),
])
def test_validate_header_refuses_blocks_that_break_a_rule(blocks, nbytes, why):
    with pytest.raises(ValueError, match=f"^tensor 'w': {why}"):
        validate_header(one_slot(blocks, nbytes), 0, CAP)


# ---------------------------------------------------------------- a worker's plan checks

READS = {"w": READ, "v": whole("float32", [4])}


def blocks_of(blocks: list[Block], name: str = "w", start: int = 0,
              nbytes: int | None = None) -> Slot:
    n = sum(b.numel() for b in blocks) * 4 if nbytes is None else nbytes
    return Slot(name, "float32", W if name == "w" else [4], 0, n, start, blocks)

WHOLE_W = Slot("w", "float32", W, 0, 128)


def header(seq: int, slots: list[Slot], last: bool, to: list[int] | None = None) -> BucketHeader:
    """Bucket `seq` of update 1 holding `slots`, laid out at aligned offsets."""
    laid, end = [], 0
    for s in slots:
        laid.append(msgspec.structs.replace(s, offset=align_up(end)))
        end = laid[-1].offset + s.nbytes
    return BucketHeader(P, 1, seq, end, last, laid, to=to)


def opened(*buckets: list[Slot], reads: dict[str, Read] | None = READS, last: bool = True,
           to: list[int] | None = None) -> tuple[Update, Problem | None]:
    """Receiver rank 1 reading `reads`, given a plan of one header per bucket."""
    u = Update(1, CAP, version=1, reads=None if reads is None else dict(reads))
    heads = [header(k, b, last and k == len(buckets) - 1, to) for k, b in enumerate(buckets)]
    return u, u.open(Plan(P, 1, [], buckets=heads), None)


def test_a_plan_naming_every_element_read_in_blocks_is_accepted():
    u, problem = opened([blocks_of([TOP])], [blocks_of([BOTTOM])])
    assert problem is None and u.accepted == 1 and u.regions == {"w": [TOP, BOTTOM]}


def test_a_plan_naming_half_of_what_the_worker_reads_is_refused():
    u, problem = opened([blocks_of([TOP])])
    assert problem is not None and problem.kind is Kind.READS
    assert problem.text == ("rank 1 refused update 1: its plan names 8 of the 16 elements this "
                            "worker reads of tensor 'w'")
    assert u.failed is problem and u.accepted == -1 and u.headers == {}  # refused as a whole


@pytest.mark.parametrize("buckets, reads, kind, why", [
    ([[blocks_of([Block([4, 0], [6, 4])])]], READS, Kind.READS,
     "block [4, 0]..[6, 4] of tensor 'w' is not one this worker reads"),
    ([[blocks_of([TOP])], [blocks_of([TOP])]], READS, Kind.HEADER,
     "tensor 'w' is named twice in update 1"),
    ([[blocks_of([TOP])], [blocks_of([Block([1, 0], [4, 4])])]], READS, Kind.READS,
     "blocks of tensor 'w' named twice"),
    ([[blocks_of([TOP])]], None, Kind.READS,
     "blocks of tensor 'w', and this worker published no read set"),
    ([[blocks_of([TOP])]], {"v": READS["v"]}, Kind.READS,
     "blocks of tensor 'w', of which this worker published no read"),
    ([[blocks_of([TOP])], [WHOLE_W]], READS, Kind.READS,
     "tensor 'w' comes whole after blocks of it"),
    ([[WHOLE_W], [blocks_of([TOP])]], READS, Kind.READS,
     "blocks of tensor 'w' after the whole of it"),
])
def test_blocks_against_the_workers_read_set_are_refused(buckets, reads, kind, why):
    _, problem = opened(*buckets, reads=reads)
    assert problem is not None and problem.kind is kind, problem
    assert problem.text.startswith(f"rank 1 rejected bucket {len(buckets) - 1}: {why}"), problem


def test_a_header_for_another_receiver_is_accepted_unchecked_and_not_joined():
    """Blocks this worker does not read, of a tensor it has no read of, for rank 2: none of
    rank 1's business; the same header naming rank 1 is refused."""
    slots = [blocks_of([Block([4, 0], [8, 4])]), blocks_of([Block([0], [2])], name="x")]
    u, problem = opened(slots, to=[2])
    assert problem is None and u.accepted == 0 and not u.mine(u.headers[0])
    assert u.regions == {} and u.covered == {}
    _, problem = opened(slots, to=[2, 1])
    assert problem is not None and problem.kind is Kind.READS, problem


def test_blocks_in_a_stream_header_after_the_plan_are_refused():
    u, problem = opened([blocks_of([TOP, BOTTOM])], last=False)
    assert problem is None
    refused = u.accept(header(1, [blocks_of([Block([0], [4])], name="v")], True))
    assert refused is not None and refused.kind is Kind.READS
    assert refused.text == "rank 1 rejected bucket 1: blocks of tensor 'v' outside a plan's headers"


def test_a_chunk_renaming_blocks_already_named_is_refused():
    """The worker reads rows 0..6; the plan names TOP, then TOP+BOTTOM from byte 32 (BOTTOM's
    bytes only): TOP twice, rows 4..6 never, yet 8 + 8 + 8 = 24 elements."""
    reads = {"w": Read("float32", W, [Block([0, 0], [6, 4])])}
    _, problem = opened([blocks_of([TOP])], [blocks_of([TOP, BOTTOM], start=32, nbytes=32)],
                        reads=reads)
    assert problem is not None and problem.kind is Kind.READS


# ---------------------------------------------------------------- the trainer's read sets

def test_read_sets_are_every_receivers_once_each_replica_tiles_its_tensors():
    sd = state()
    got = read_sets(hellos(sd))
    assert sorted(got) == [1, 2, 3] and got[2].tensors["head.weight"].blocks == []


def test_a_receiver_without_a_read_set_is_named():
    his = hellos(state())
    his[2] = msgspec.structs.replace(his[2], reads=None)
    with pytest.raises(PushError, match=r"ranks \[2\] published no read set"):
        read_sets(his)


def test_overlapping_blocks_of_one_worker_refuse_its_replica_by_name():
    his = hellos(state())
    rows = [Block([8, 0], [13, 8]), Block([12, 0], [16, 8])]
    reads = his[2].reads
    assert reads is not None
    reads.tensors["qkv.weight"] = Read("float32", [16, 8], rows)
    with pytest.raises(PushError, match=r"refused the read sets of replica 0 \(ranks \[1, 2\]\): "
                                        r"worker 1, tensor 'qkv.weight': blocks .* overlap"):
        read_sets(his)


def test_each_replica_must_tile_its_tensors_on_its_own():
    """Rows 12..16 of `qkv.weight` read by no worker of replica 0: refused, though the TP=1
    worker of replica 1 reads them."""
    his = hellos(state())
    reads = his[2].reads
    assert reads is not None
    reads.tensors["qkv.weight"] = Read("float32", [16, 8], [Block([8, 0], [12, 8])])
    with pytest.raises(PushError, match=r"replica 0 \(ranks \[1, 2\]\): tensor 'qkv.weight': "
                                        r"element \[12, 0\] of \[16, 8\] is read by no worker"):
        read_sets(his)


# ---------------------------------------------------------------- where it is refused

@pytest.mark.parametrize("backend", ["gloo", "nccl", "shm", "ipc"])
def test_shard_is_taken_on_every_plane(backend):
    cfg = {"control_port": 1, "group_port": 2, "world_size": 2, "backend": backend}
    assert SyncConfig(**cfg, shard=True).shard
    several = SyncConfig(control_port=1, group_port=2, world_size=3, shard=True,
                         senders=(("127.0.0.1", 3),))
    assert several.shard and several.num_senders == 2


class Done:
    def wait(self) -> bool:
        return True


class Groupless(Transport):
    """A plane without a group (no rendezvous): what `broadcast` checks before posting."""

    backend = "groupless"
    digest_per_bucket = False
    canary_bytes = 0
    peer_harm = "a peer can do nothing: there is none"

    def __init__(self) -> None:
        self.broken, self.device, self.bytes_moved, self.collectives = "", torch.device("cpu"), 0, 0
        self.world_size = 3
        self.posted: list[Collection[int] | None] = []

    def _device(self, device: torch.device | None) -> torch.device:
        return torch.device("cpu")

    def _group(self, store: object, cfg: SyncConfig) -> None:
        raise AssertionError("never called: this plane has no group")

    def _post(self, tensor: torch.Tensor, src: int, to: Collection[int] | None) -> Handle:
        self.posted.append(to)
        return Done()

    def _abort_group(self, pg: object) -> None:
        pass


class Reaching(Groupless):
    reaches_some = True


def test_a_bucket_for_some_receivers_needs_a_plane_that_reaches_some():
    wire = torch.zeros(8, dtype=torch.uint8)
    everyone = Groupless()
    with pytest.raises(ValueError, match="the groupless plane sends every bucket to every "
                                         "receiver"):
        everyone.broadcast(wire, to=[1])
    assert everyone.posted == [] and everyone.collectives == 0
    everyone.broadcast(wire).wait()
    some = Reaching()
    some.broadcast(wire, to=[2]).wait()
    assert (everyone.posted, some.posted) == ([None], [[2]])
    for outside in ([3], [0], [-1]):  # past the group, the sender itself: refused, not posted
        with pytest.raises(ValueError, match="outside the group's other ranks"):
            some.broadcast(wire, to=outside)
    assert some.posted == [[2]]
    assert all(plane(n).reaches_some for n in ("gloo", "nccl", "shm", "ipc"))


# ---------------------------------------------------------------- a layout agreed once

def _plan(buckets: list, version: int, specs: list[TensorSpec], staged: bool = False) -> Plan:
    heads = [msgspec.structs.replace(h, version=version, staged=staged) for h in buckets]
    return Plan(P, version, specs, buckets=heads, staged=staged)


def test_a_plan_of_the_layout_last_accepted_is_kept_as_it_was_checked(shards):
    """The next plan of the same layout (a new version) is accepted without checking each header
    again, leaving exactly what checking it would; a staged one is another layout."""
    sd, reads, planned_ = shards
    specs = [TensorSpec(n, dtype_name(t.dtype), list(t.shape)) for n, t in sd.items()]
    heads = [h for h, _ in planned_]
    for rank, rs in reads.items():
        first = Update(rank, CAP, version=1, reads=dict(rs.tensors))
        assert first.open(_plan(heads, 1, specs), None) is None and not first.kept
        again = Update(rank, CAP, version=2, reads=dict(rs.tensors), layout=first.layout)
        fresh = Update(rank, CAP, version=2, reads=dict(rs.tensors))
        assert again.open(_plan(heads, 2, specs), None) is None and again.kept
        assert fresh.open(_plan(heads, 2, specs), None) is None and not fresh.kept
        for f in ("covered", "regions", "named", "headers", "accepted", "last"):
            assert getattr(again, f) == getattr(fresh, f), (rank, f)
        staged = Update(rank, CAP, version=3, staged=True, reads=dict(rs.tensors),
                        layout=again.layout)
        assert staged.open(_plan(heads, 3, specs, staged=True), None) is None and not staged.kept


def test_a_plan_like_the_last_but_wrong_is_checked_and_refused():
    """A header of another version, or a tensor named twice, in a plan otherwise the last
    accepted one: checked, and refused as a whole."""
    good = [header(0, [blocks_of([TOP])], False), header(1, [blocks_of([BOTTOM])], True)]
    u = Update(1, CAP, version=1, reads=dict(READS))
    assert u.open(Plan(P, 1, [], buckets=good), None) is None
    stale = [msgspec.structs.replace(good[0], version=2), good[1]]  # one header still of 1
    twice = [msgspec.structs.replace(h, version=2) for h in
             (good[0], header(1, [blocks_of([TOP])], True))]
    for heads, why in ((stale, "header of update 1 in update 2"), (twice, "named twice")):
        v = Update(1, CAP, version=2, reads=dict(READS), layout=u.layout)
        problem = v.open(Plan(P, 2, [], buckets=heads), None)
        assert problem is not None and why in problem.text and not v.kept, problem
        assert v.accepted == -1 and v.headers == {}
