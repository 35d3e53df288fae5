"""Fuzz (property-based): hostile or broken input never gets past the checks unsafely.

(a) `protocol.decode` on arbitrary bytes, mutated valid frames and mutated msgpack maps: a `Message`
    or `ProtocolError`, nothing else. (b) `decode` then `packing.validate_header` (the types'
    bounds, then the rules between fields) on generated and mutated headers: a `ValueError`
    naming the problem, or a header that is checked here to be safe.
(c) a real `Receiver` (only its data-plane transport stood in) on a real `ReceiverChannel`, fed
    by a hostile sender on a real ROUTER socket (protocol 3: a `Plan` with every header or a
    stream's first ones, `Go`, buckets with their `Digest`s, then `Seal` and `Commit`):
    every hostile sequence ends in `{"ok": False, "error": ...}` naming the problem within its
    timeout (or, where it is harmless, in a committed update), no version is stamped without a
    `Commit`, no collective is joined before a `Ready` covering it, and no data of a refused
    bucket, or of one whose checksum is missing or wrong, reaches
    the loader. A few sequences run over a real 2-rank gloo group as well (checksums required).

Deterministic (derandomized, no example database). Every frame or header tried is counted; the last
test reports the counts (terminal line and `record_property`) and asserts at least 10,000.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import threading
import time
import types
import typing
from collections import Counter

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vllm_nccl_sync.engine.receiver as receiver_mod
from tests.conftest import free_port
from vllm_nccl_sync.planes.base import Transport
from vllm_nccl_sync.planes.registry import open_transport
from vllm_nccl_sync.wire.channel import _META, _TO_RECEIVER, FRAMING, SenderChannel, _mac
from vllm_nccl_sync.wire.config import SyncConfig
from vllm_nccl_sync.wire.integrity import checksum
from vllm_nccl_sync.wire.packing import (
    ALIGN,
    DTYPES,
    Reassembler,
    align_up,
    dtype_name,
    pack,
    plan_buckets,
    tensor_nbytes,
    validate_header,
)
from vllm_nccl_sync.wire.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    BucketHeader,
    Commit,
    Digest,
    Error,
    Go,
    Message,
    Plan,
    ProtocolError,
    Ready,
    Seal,
    Slot,
    TensorSpec,
    decode,
    encode,
)

P = PROTOCOL_VERSION
COUNTS: Counter[str] = Counter()
"""Frames/headers/sequences tried, per test (reported by `test_fuzz_totals`)."""
MIN_TOTAL = 10_000


def fuzz(n: int):
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


# ---------------------------------------------------------------- (a) the decoder

MESSAGE_TYPES = typing.get_args(Message)
TAGS = {c.__struct_config__.tag for c in MESSAGE_TYPES}
INT64 = st.integers(-(2**63), 2**63 - 1)
INTS = st.one_of(st.integers(-3, 70), INT64, st.integers(2**63, 2**64 - 1))


def unwrap(tp):
    """`(base type, its msgspec.Meta or None)` of a field type (`Annotated` carries bounds)."""
    if typing.get_origin(tp) is typing.Annotated:
        base, *extra = typing.get_args(tp)
        return base, next((m for m in extra if isinstance(m, msgspec.Meta)), None)
    return tp, None


def for_type(tp) -> st.SearchStrategy:
    """A strategy of valid values for a field type of the protocol (works for new fields too),
    within the bounds its `Annotated` metadata sets."""
    tp, meta = unwrap(tp)
    lo = getattr(meta, "ge", None)
    hi = getattr(meta, "le", None)
    size = getattr(meta, "max_length", None)
    if tp is bool:
        return st.booleans()
    if tp is int:
        if lo is None and hi is None:
            return INTS
        lo = -(2**63) if lo is None else lo
        hi = 2**64 - 1 if hi is None else hi
        return st.one_of(st.integers(lo, min(lo + 70, hi)), st.integers(lo, hi))
    if tp is float:
        return st.floats() if lo is None else st.floats(min_value=lo, allow_nan=False)
    if tp is str:
        return st.text(max_size=min(12, size or 12))
    if tp is type(None):
        return st.none()
    if typing.get_origin(tp) is list:
        return st.lists(for_type(typing.get_args(tp)[0]), max_size=min(4, size or 4))
    if typing.get_origin(tp) is dict:  # e.g. `Sent.checksums`
        key, value = typing.get_args(tp)
        return st.dictionaries(for_type(key), for_type(value), max_size=4)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # e.g. `AdapterSpec | None`
        return st.one_of([for_type(a) for a in typing.get_args(tp)])
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return struct_of(tp)
    raise TypeError(f"no strategy for {tp!r}")


def struct_of(cls) -> st.SearchStrategy:
    kw = {f.name: st.just(P) if f.name == "protocol" else for_type(f.type)
          for f in msgspec.structs.fields(cls)}
    return st.builds(cls, **kw)


MESSAGES = st.one_of([struct_of(c) for c in MESSAGE_TYPES])


def check_decode(frame) -> Message | None:
    """The property: a valid `Message` of this protocol version, or `ProtocolError` with a text."""
    COUNTS["decode"] += 1
    try:
        msg = decode(frame)
    except ProtocolError as e:
        assert str(e)
        return None
    assert isinstance(msg, MESSAGE_TYPES) and msg.protocol == P
    again = encode(msg)
    assert encode(decode(again)) == again  # a decoded message is a well-formed, stable value
    return msg


@fuzz(2000)
@given(st.binary(max_size=300))
def test_decode_arbitrary_bytes(frame):
    for f in (frame, frame[: len(frame) // 2], frame + frame[:7]):  # itself, cut, extended
        check_decode(f)
    try:
        decode(memoryview(frame))  # zero-copy input behaves the same
    except ProtocolError:
        pass


MUTATION = st.tuples(
    st.sampled_from(["flip", "set", "insert", "delete", "truncate", "extend", "dup"]),
    st.integers(0, 2**16),
    st.binary(min_size=1, max_size=9),
)


def mutate(frame: bytes, op: str, pos: int, data: bytes) -> bytes:
    n = len(frame)
    i = pos % (n + 1)
    if op == "flip" and n:
        i %= n
        return frame[:i] + bytes([frame[i] ^ (1 << (data[0] % 8))]) + frame[i + 1 :]
    if op == "set" and n:
        i %= n
        return frame[:i] + data[:1] + frame[i + 1 :]
    if op == "insert":
        return frame[:i] + data + frame[i:]
    if op == "delete":
        return frame[:i] + frame[i + 1 + data[0] % 4 :]
    if op == "truncate":
        return frame[:i]
    if op == "extend":
        return frame + data
    if op == "dup":
        return frame[:i] + frame[i : i + 1 + data[0] % 16] + frame[i:]
    return frame


@fuzz(500)
@given(MESSAGES, st.lists(MUTATION, min_size=1, max_size=12))
def test_decode_mutated_valid_frames(msg, mutations):
    frame = encode(msg)
    assert encode(check_decode(frame)) == frame
    for op, pos, data in mutations:  # every step of the chain is a frame of its own
        frame = mutate(frame, op, pos, data)
        check_decode(frame)


MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@fuzz(300)
@given(MSGPACK_VALUES)
def test_decode_arbitrary_msgpack(value):
    check_decode(msgspec.msgpack.encode(value))


WRONG_KINDS = {"none": None, "bool": True, "int": 7, "float": 1.5, "str": "x", "bytes": b"x",
               "list": [1], "map": {"k": 1}}
ACCEPTED_KINDS = {int: {"int"}, bool: {"bool"}, float: {"float", "int"}, str: {"str"}}


def wrong_value_for(tp, kind: str):
    """A value of `kind` that `tp` does not accept, or None if `kind` fits `tp` (its type; a
    value of that type may still be out of its bounds)."""
    tp, _ = unwrap(tp)
    ok = ACCEPTED_KINDS.get(tp, {"list"} if typing.get_origin(tp) is list else set())
    return None if kind in ok else WRONG_KINDS[kind]


MAP_MUTATIONS = ["wrong_type", "extra_field", "missing_field", "wrong_tag", "no_tag",
                 "wrong_version", "slot_extra_field", "slot_wrong_type", "same_type"]


@fuzz(700)
@given(MESSAGES, st.sampled_from(MAP_MUTATIONS), st.data())
def test_decode_mutated_maps(msg, mutation, data):
    """Maps with wrong types, extra or missing fields, wrong tags or versions are rejected."""
    d = msgspec.to_builtins(msg)
    fields = {f.name: f for f in msgspec.structs.fields(type(msg))}
    must_fail = True
    match = None
    if mutation == "wrong_type":
        name = data.draw(st.sampled_from(sorted(fields)))
        kind = data.draw(st.sampled_from(sorted(WRONG_KINDS)))
        value = wrong_value_for(fields[name].type, kind)
        if value is None:
            must_fail = False
        else:
            d[name] = value
    elif mutation == "extra_field":
        key = data.draw(st.text(max_size=8).filter(lambda k: k not in fields and k != "type"))
        d[key] = data.draw(MSGPACK_VALUES)
        match = "unknown field"
    elif mutation == "missing_field":
        required = sorted(n for n, f in fields.items() if f.required)
        del d[data.draw(st.sampled_from(required))]
        match = "missing required field"
    elif mutation == "wrong_tag":
        d["type"] = data.draw(st.one_of(st.text(max_size=8).filter(lambda t: t not in TAGS),
                                        INT64, st.none()))
    elif mutation == "no_tag":
        del d["type"]
    elif mutation == "wrong_version":
        d["protocol"] = data.draw(INT64.filter(lambda v: v != P))
        match = "protocol version"
    elif mutation in ("slot_extra_field", "slot_wrong_type"):
        if not isinstance(msg, BucketHeader) or not msg.slots:
            must_fail = False
        elif mutation == "slot_extra_field":
            d["slots"][0]["zz_extra"] = 1
            match = "unknown field"
        else:
            d["slots"][-1]["shape"] = "not a list"
    else:  # same_type: another valid value for one field still decodes, to that value
        name = data.draw(st.sampled_from(sorted(n for n in fields if n != "protocol")))
        value = data.draw(for_type(fields[name].type))
        d[name] = msgspec.to_builtins(value)
        must_fail = False
    frame = msgspec.msgpack.encode(d)
    if not must_fail:
        got = check_decode(frame)
        if mutation == "same_type":
            assert got is not None and encode(getattr(got, name)) == encode(value)
        return
    COUNTS["decode"] += 1
    with pytest.raises(ProtocolError, match=match):
        decode(frame)


def test_decode_deep_nesting_is_a_protocol_error():
    """Regression: msgspec skipping a deeply nested unknown value raised RecursionError."""
    frame = b"\x82\xa1x" + b"\x91" * 200_000 + b"\xc0" + b"\xa4type\xa2go"
    COUNTS["decode"] += 1
    with pytest.raises(ProtocolError, match="nested too deeply"):
        decode(frame)


# ---------------------------------------------------------------- (b) the header validator

BOUND = r"Expected `(int|array)` (>= 0|<= \d+|of length <= \d+)"
"""What `decode` says of a value past its type's bounds (`protocol.py`), before any rule."""
PROBLEMS = {
    "seq_gap": "sequence gap",
    "seq_repeat": "sequence repeat",
    "length_over": r"outside \[0, capacity",
    "length_negative": BOUND,
    "length_short": "past the bucket length",
    "length_long": r"!= end of its last tensor|outside \[0, capacity",
    "misalign": "not aligned",
    "overlap": "overlaps the previous slot",
    "negative_offset": BOUND,
    "offset_out_of_range": r"past the bucket length",
    "unknown_dtype": "unknown dtype",
    "negative_dim": BOUND,
    "huge_dim": rf"too large|{BOUND}",
    "not_whole": "whole .* elements",
    "start_beyond": "exceed its size",
    "empty_chunk": "empty chunk",
    "duplicate_name": "duplicate name",
}
ANY_PROBLEM = "|".join(PROBLEMS.values())
MUTATIONS = sorted(PROBLEMS) + ["random_int", "random_int", "random_int"]


@st.composite
def valid_headers(draw):
    """A header obeying every rule (gaps between slots allowed), with its capacity and seq."""
    capacity = draw(st.sampled_from([64, 256, 1024, 4096]))
    seq = draw(st.integers(0, 5))
    slots: list[Slot] = []
    end = 0
    for i in range(draw(st.integers(0, 6))):
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        itemsize = DTYPES[dtype].itemsize
        shape = draw(st.lists(st.integers(0, 12), max_size=3))
        numel = math.prod(shape)
        total = numel * itemsize
        start, nbytes = 0, total
        if numel > 1 and draw(st.booleans()):  # a chunk of a tensor split over buckets
            a = draw(st.integers(0, numel - 1))
            b = draw(st.integers(a + 1, numel))
            start, nbytes = a * itemsize, (b - a) * itemsize
        offset = align_up(end) + ALIGN * draw(st.integers(0, 2))
        if offset + nbytes > capacity:
            break
        slots.append(Slot(f"t{i}", dtype, shape, offset, nbytes, start))
        end = offset + nbytes
    h = BucketHeader(P, draw(st.integers(0, 9)), seq, end, draw(st.booleans()), slots)
    return h, capacity, seq


def _replace_slot(h: BucketHeader, i: int, **kw) -> BucketHeader:
    slots = list(h.slots)
    slots[i] = msgspec.structs.replace(slots[i], **kw)
    return msgspec.structs.replace(h, slots=slots)


def apply_header_mutation(data, h: BucketHeader, capacity: int, seq: int, kind: str):
    """Returns (header, expected_seq, invalidates): the mutated header and whether it must fail."""
    r = msgspec.structs.replace
    n = len(h.slots)
    pick = lambda lo=0: data.draw(st.integers(lo, n - 1))  # noqa: E731

    def sane(s: Slot) -> bool:  # an earlier mutation may have broken the slot already
        return s.dtype in DTYPES and all(0 <= d < 2**20 for d in s.shape) and len(s.shape) < 8
    if kind == "seq_gap":
        return r(h, seq=seq + data.draw(st.integers(1, 2**40))), seq, True
    if kind == "seq_repeat":
        return h, seq + data.draw(st.integers(1, 2**40)), True
    if kind == "length_over":
        return r(h, length=capacity + data.draw(st.integers(1, 2**62))), seq, True
    if kind == "length_negative":
        return r(h, length=-data.draw(st.integers(1, 2**62))), seq, True
    if kind == "length_short" and n and h.length > h.slots[-1].offset:
        return r(h, length=data.draw(st.integers(h.slots[-1].offset, h.length - 1))), seq, True
    if kind == "length_long":
        return r(h, length=h.length + data.draw(st.integers(1, capacity))), seq, True
    if kind == "misalign" and n:
        i = pick()
        off = h.slots[i].offset + data.draw(st.integers(1, 63))
        return _replace_slot(h, i, offset=off), seq, True
    if kind == "overlap" and n > 1:
        i = pick(1)
        prev = h.slots[i - 1]
        if prev.nbytes:
            return _replace_slot(h, i, offset=prev.offset + prev.nbytes - 1), seq, True
    if kind == "negative_offset" and n:
        return _replace_slot(h, 0, offset=-ALIGN * data.draw(st.integers(1, 2**40))), seq, True
    if kind == "offset_out_of_range" and n:
        off = align_up(capacity) + ALIGN * data.draw(st.integers(0, 2**40))
        return _replace_slot(h, n - 1, offset=off), seq, True
    if kind == "unknown_dtype" and n:
        bad = data.draw(st.text(max_size=10).filter(lambda t: t not in DTYPES))
        return _replace_slot(h, pick(), dtype=bad), seq, True
    if kind == "negative_dim" and n:
        i = pick()
        shape = list(h.slots[i].shape) + [-data.draw(st.integers(1, 2**63))]
        return _replace_slot(h, i, shape=data.draw(st.permutations(shape))), seq, True
    if kind == "huge_dim" and n:
        i = pick()
        big = data.draw(st.sampled_from([[2**63], [2**64 - 1], [2**40, 2**40], [3] * 60]))
        return _replace_slot(h, i, shape=big), seq, True
    if kind == "not_whole" and n and sane(h.slots[i := pick()]):
        itemsize = DTYPES[h.slots[i].dtype].itemsize
        if itemsize > 1:
            field = data.draw(st.sampled_from(["nbytes", "start"]))
            bump = data.draw(st.integers(1, itemsize - 1))
            return _replace_slot(h, i, **{field: getattr(h.slots[i], field) + bump}), seq, True
    if kind == "start_beyond" and n and sane(h.slots[i := pick()]):
        s = h.slots[i]
        itemsize = DTYPES[s.dtype].itemsize
        total = math.prod(s.shape) * itemsize
        start = total - s.nbytes + itemsize * data.draw(st.integers(1, 100))
        return _replace_slot(h, i, start=start), seq, True
    if kind == "empty_chunk" and n and sane(h.slots[i := pick()]):
        if math.prod(h.slots[i].shape):
            return _replace_slot(h, i, nbytes=0, start=0), seq, True
    if kind == "duplicate_name" and n > 1:
        i = pick(1)
        return _replace_slot(h, i, name=h.slots[data.draw(st.integers(0, i - 1))].name), seq, True
    if kind == "random_int":  # any integer anywhere: may or may not break a rule
        if n and data.draw(st.booleans()):
            i = pick()
            field = data.draw(st.sampled_from(["offset", "nbytes", "start"]))
            return _replace_slot(h, i, **{field: data.draw(INTS)}), seq, False
        return r(h, length=data.draw(INTS)), seq, False
    return h, seq, False


def assert_safe(h: BucketHeader, capacity: int) -> None:
    """The invariant an accepted header must satisfy, checked independently of the validator."""
    assert 0 <= h.length <= capacity
    end, names = 0, set()
    for s in h.slots:
        assert s.dtype in DTYPES and s.name not in names
        names.add(s.name)
        itemsize = DTYPES[s.dtype].itemsize
        assert all(0 <= d < 2**63 for d in s.shape)
        total = (0 if 0 in s.shape else math.prod(s.shape)) * itemsize
        assert end <= s.offset and s.offset % ALIGN == 0  # in order, aligned, no overlap
        assert 0 <= s.nbytes and s.offset + s.nbytes <= h.length  # inside [0, length]
        assert s.nbytes % itemsize == 0 and s.start % itemsize == 0 and s.start >= 0
        assert s.start + s.nbytes <= total and (s.nbytes > 0 or total == 0)
        end = s.offset + s.nbytes
    assert end == h.length
    buf = torch.zeros(capacity, dtype=torch.uint8)
    try:
        out = Reassembler().unpack(h, buf)
    except ValueError:  # e.g. a lone middle chunk: refused, nothing else
        return
    by_name = {s.name: s for s in h.slots}
    for name, t in out:
        s = by_name[name]
        assert t.dtype == DTYPES[s.dtype] and list(t.shape) == s.shape
        if t.numel() and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
            lo = t.data_ptr() - buf.data_ptr()  # a view of the buffer: inside the payload
            assert lo == s.offset and lo + s.nbytes <= h.length


@fuzz(1200)
@given(valid_headers(), st.lists(st.sampled_from(MUTATIONS), max_size=3), st.data())
def test_validate_header_rejects_or_is_safe(base, mutations, data):
    h, capacity, seq = base
    COUNTS["header"] += 1
    if not mutations:
        validate_header(h, seq, capacity)  # the generator makes valid headers
        assert_safe(h, capacity)
        return
    invalidating = []
    for kind in mutations:
        h, seq, bad = apply_header_mutation(data, h, capacity, seq, kind)
        if bad:
            invalidating.append(kind)
    try:
        h = decode(encode(h))  # the types' bounds first, as every received header passes them
        validate_header(h, seq, capacity)
    except ValueError as e:  # a ProtocolError is one
        assert re.search(ANY_PROBLEM, str(e)), f"unnamed problem: {e}"
        if len(mutations) == 1 and invalidating:
            assert re.search(PROBLEMS[mutations[0]], str(e)), (mutations, str(e))
        return
    assert not (len(mutations) == 1 and invalidating), f"{mutations} accepted: {h}"
    assert_safe(h, capacity)


@fuzz(300)
@given(st.lists(st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 40),
                                                                    max_size=2),
                          st.integers(0, 2)), max_size=10),
       st.sampled_from([64, 256, 1024]), st.booleans())
def test_multi_sender_plan_is_valid(tensors, capacity, balance):
    """Several senders: whatever the offers, every header of the plan passes the receivers'
    check, names the sender that owns each of its tensors, and every tensor is sent whole."""
    from vllm_nccl_sync.trainer.owners import plan_headers, plan_owners

    COUNTS["plan"] += 1
    specs = [TensorSpec(f"t{i}", d, shape) for i, (d, shape, _) in enumerate(tensors)]
    if balance:
        offers = {r: (specs, False) for r in range(3)}
    else:
        offers = {r: ([t for t, (_, _, o) in zip(specs, tensors) if o == r], True)
                  for r in range(3)}
    owner = plan_owners(offers)
    assert set(owner) == {t.name for t in specs}
    order = {r: [t for t in offered if owner[t.name] == r] for r, (offered, _) in offers.items()}
    headers = plan_headers(order, capacity, 1, P)
    sent: Counter[str] = Counter()
    for k, h in enumerate(headers):
        validate_header(h, k, capacity)
        assert h.is_last == (k == len(headers) - 1)
        for slot in h.slots:
            assert owner[slot.name] == h.src
            sent[slot.name] += slot.nbytes
    assert sent + Counter() == Counter({t.name: tensor_nbytes(t.dtype, t.shape) for t in specs
                                        if tensor_nbytes(t.dtype, t.shape)})
    assert decode(encode(Plan(P, 1, specs, buckets=headers))).buckets == headers


# ---------------------------------------------------------------- (c) the receiver end to end

SECRET = "5ec7e7" * 8
T = 0.3  # every wait of the receiver in these tests (queued frames arrive in microseconds)
CAP = 1024


class StandInTransport:
    """The data plane only: `broadcast` fills the buffer with a marker (its call number) and is
    done at once. `log` (shared with the receiver's channel spy) orders answers and broadcasts.
    Its policy is gloo's: a `Digest` per bucket, a canary past each bucket's length."""

    digest_per_bucket = True
    canary_bytes = 8
    shares_buffers = False
    backend = "stand-in"
    export, mapped, keep_mapped = Transport.export, Transport.mapped, Transport.keep_mapped  # none
    hand_over, side_socket = Transport.hand_over, Transport.side_socket
    receive_buffers = Transport.receive_buffers  # memory of its own

    def __init__(self, cfg, rank, device=None):
        self.device = torch.device("cpu")
        self.calls = 0
        self.log: list[tuple[str, int]] = []

    broken = ""
    armed = staticmethod(lambda seconds, what: contextlib.nullcontext())

    def extend(self, seconds):
        pass

    def abort(self, reason):
        pass

    def broadcast(self, tensor, src=0, *, length=None, to=None):
        self.calls += 1
        tensor[:length].fill_(self.calls)
        self.log.append(("broadcast", self.calls))
        return self

    def wait(self):
        return True

    def close(self):
        pass


class RecordingLoader:
    def __init__(self):
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.began = self.finished = self.aborted = False

    def begin(self):
        self.began = True

    def load(self, named):
        for n, t in named:
            self.loaded.append((n, t.contiguous().reshape(-1).view(torch.uint8).clone()))
        return {n for n, _ in named}

    def finish(self):
        self.finished = True

    def abort(self):
        self.aborted = True


@pytest.fixture(scope="module")
def hostile():
    """A real ROUTER socket (the trainer's channel) and the receivers' config; Receiver gets
    the data-plane stand-in while this module runs."""
    port = free_port()
    cfg = SyncConfig(control_port=port, group_port=free_port(), world_size=2, bucket_bytes=CAP,
                     timeout_s=T, secret=SECRET)
    trainer = SenderChannel("127.0.0.1", port, cfg.secret_bytes)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(receiver_mod, "open_transport", StandInTransport)
        yield trainer, cfg
    trainer.close()


def new_receiver(trainer: SenderChannel, cfg: SyncConfig, require_checksums: bool = False,
                 on_ack=None):
    """A real `Receiver` (fresh session); returns it and the list of messages it sends.
    `on_ack()` runs each time it has sent an `Ack` (the sender's turn in the commit round)."""
    rx = receiver_mod.Receiver(cfg, 1, require_checksums=require_checksums)
    sent: list[Message] = []
    real_send = rx.channel.send
    log = rx.transport.log

    def spy(m, *a, **kw):
        sent.append(m)
        if isinstance(m, (Ready, Error)):
            log.append((type(m).__name__, m.seq))
        real_send(m, *a, **kw)
        if isinstance(m, Ack) and on_ack is not None:
            on_ack()

    rx.channel.send = spy
    deadline = time.monotonic() + 5
    while trainer._by_rank.get(1) != rx.channel.session:
        trainer.recv(deadline)  # its Hello (earlier sessions' leftovers are skipped)
    return rx, sent


TENSORS = st.lists(
    st.tuples(st.sampled_from(["float32", "bfloat16", "int64", "uint8", "bool"]),
              st.lists(st.integers(0, 24), max_size=2)),
    min_size=1, max_size=5,
)

VIOLATION = r"expected [A-Za-z]+ (for|after) bucket -?\d+, got"
TIMEOUT = r"waited [\d.]+ s for .*(no control message from the sender within|the deadline passed)"
REFUSED_GO = r"sent Go for bucket \d+, refused: "
SCENARIOS = {  # name: (weight, expected error pattern; None: harmless, the update completes)
    "seq_gap": (3, r"bucket sequence gap"),
    "no_plan": (1, TIMEOUT),  # headers and Gos without a Plan open nothing: ignored
    "seq_repeat": (3, rf"bucket sequence repeat|follows the last bucket|{VIOLATION} BucketHeader"),
    "dup_is_last": (3, rf"follows the last bucket|incomplete tensors|{VIOLATION}"),
    "dup_after_last": (2, r"refused update \d+: it holds version \d+"),  # a replayed plan
    "go_wrong_seq": (3, rf"{VIOLATION}|{REFUSED_GO}"),  # a Go covering less: what follows
    "go_wrong_version": (2, VIOLATION),  # skipped as another update's: what follows is wrong
    "abort": (3, r"sender aborted update \d+ (at bucket -?\d+|in the commit round)"),
    "abort_other_version": (2, None),  # an Abort of another update is none of this one's concern
    # junk before the plan is dropped (named in the result); after it, it ends the update
    "garbage": (3, r"undecodable frame|invalid message|protocol version"),
    "bad_length_go": (3, REFUSED_GO + r".*(!= end of its last tensor|past the bucket length"
                         r"|outside)"),
    "bad_length_abort": (2, r"rejected bucket \d+: .*(!= end of its last tensor|past the bucket "
                            r"length|outside)"),
    "bad_header_go": (3, REFUSED_GO + r".*(not aligned|unknown dtype|overlaps"
                         r"|duplicate name|sender \d+ is not one of the 1 sender)"),
    "header_other_version": (2, rf"{VIOLATION} Go|{REFUSED_GO}header of update"),
    "digest_no_checksum": (2, r"Digest for bucket \d+ carries no checksum, and this receiver "
                              r"requires one"),
    "digest_bad_checksum": (2, r"bucket \d+ arrived corrupted or short: its checksum does not "
                              r"match the sender's"),
    "seal_bad_checksum": (2, r"bucket \d+ arrived corrupted: its checksum does not match the "
                            r"sender's"),
    "seal_no_checksum": (1, r"no checksum for bucket \d+ in the seal, and this receiver requires"),
    "seal_wrong_count": (2, r"sealed update \d+ with \d+ buckets / \d+ checksums, \d+ arrived"),
    "commit_wrong": (2, r"expected Commit\(1\) of update \d+, got (Commit|Seal|Go)"),
    "commit_early": (2, rf"{VIOLATION} Commit"),
    "commit_other_version": (1, TIMEOUT),  # it stamps nothing: this update never commits
    "forged_go": (1, rf"{TIMEOUT} .*bad MAC.*same secret"),
    "truncated": (1, TIMEOUT),
}
TIMING_OUT = ["forged_go", "truncated"]  # end by a timeout: few cases, each costs T
EXAMPLES_PER_WEIGHT = 8
STRICT = {"digest_no_checksum", "seal_no_checksum"}
"""Scenarios about a missing checksum: the receiver requires them (elsewhere it is drawn)."""


@dataclasses.dataclass
class Case:
    """One hostile sequence and how it must end."""

    events: list[tuple[str, object]]
    markers: list[int]
    """Per bucket, the marker the stand-in fills it with in a legit run (0: empty, never sent)."""
    expect: str | None
    """Pattern of the last receive()'s error; None: the sequence is harmless and must succeed."""
    calls: int = 1
    """receive() calls the sequence takes."""
    require_checksums: bool = False
    unloaded: set[int] = dataclasses.field(default_factory=set)
    """Markers no loader may ever see (buckets the receiver joined but must not load)."""
    told: bool = True
    """The receiver's last message must be the `Error` telling the sender."""
    opened: bool = True
    """The update opened (the plan came): the `Error` names its version; else nobody asked, and
    the sender is told nothing."""


def legit_events(tensors, version, ahead: int | None) -> tuple[list[tuple[str, object]], list[int]]:
    """What a correct sender sends when every receiver agrees: the Plan with the first `ahead`
    headers (None: all of them), one Go; per bucket its Digest, and for a stream the next header
    and its Go; then Seal, Commit(1).

    Each `Digest` and the `Seal` carry the checksum of what the stand-in broadcasts into a fresh
    receiver's bucket (its call number: 1, 2, ... over the non-empty buckets), as a gloo sender
    would; returns the events and each bucket's marker.
    """
    named = []
    for i, (dtype, shape) in enumerate(tensors):
        named.append((f"w{i}", torch.zeros(shape, dtype=DTYPES[dtype])))
    specs = [TensorSpec(n, dtype_name(t.dtype), list(t.shape)) for n, t in named]
    buckets = list(plan_buckets(named, CAP))
    n = len(buckets)
    headers = [b.header(version, k, k == n - 1, P) for k, b in enumerate(buckets)]
    a = n if ahead is None else min(ahead, n)
    events: list[tuple[str, object]] = [
        ("msg", Plan(P, version, specs if ahead is None else [], buckets=headers[:a])),
        ("msg", Go(P, version, a - 1)),
    ]
    markers, sums = [], []
    for k, b in enumerate(buckets):
        marker = (max(markers, default=0) + 1) if b.length else 0
        digest = checksum(torch.full((b.length,), marker, dtype=torch.uint8)) if b.length else 0
        markers.append(marker)
        sums.append(digest)
        if b.length:
            events.append(("msg", Digest(P, version, k, digest)))
        if k + a < n:
            events += [("msg", headers[k + a]), ("msg", Go(P, version, k + a))]
    events.append(("msg", Seal(P, version, n, sums)))
    events.append(("msg", Commit(P, version, 1)))
    return events, markers


def _headers(events) -> list[tuple[int, int | None, BucketHeader]]:
    """Every header of `events` as (event index, index in the plan or None, header)."""
    out = []
    for i, (_, m) in enumerate(events):
        if isinstance(m, Plan):
            out += [(i, j, h) for j, h in enumerate(m.buckets)]
        elif isinstance(m, BucketHeader):
            out.append((i, None, m))
    return out


def _set_header(events, where: tuple[int, int | None, BucketHeader], h: BucketHeader) -> None:
    """Replace one header (in the plan or on its own) by `h`."""
    i, j, _ = where
    if j is None:
        events[i] = ("msg", h)
    else:
        plan = events[i][1]
        hs = list(plan.buckets)
        hs[j] = h
        events[i] = ("msg", msgspec.structs.replace(plan, buckets=hs))


def hostile_events(data, scenario: str, version: int) -> Case:
    """A legit update (all headers in the plan, or a stream announcing 1-2 ahead) turned
    hostile by `scenario`."""
    tensors = data.draw(TENSORS)
    if data.draw(st.booleans()):
        tensors.insert(data.draw(st.integers(0, len(tensors))), ("float32", [300]))  # 2+ buckets
    if "checksum" in scenario and not any(math.prod(shape) for _, shape in tensors):
        tensors.append(("float32", [3]))  # a bucket that moves bytes, hence has a checksum
    ahead = data.draw(st.sampled_from([None, 1, 2]))
    events, markers = legit_events(tensors, version, ahead)
    heads = _headers(events)
    seal_at = len(events) - 2
    nb = len(heads)
    r = msgspec.structs.replace
    case = Case(events, markers, SCENARIOS[scenario][1],
                require_checksums=scenario in STRICT or data.draw(st.booleans()))
    moving = [j for j in range(nb) if markers[j]]  # buckets with bytes (a checksum to get wrong)
    digests = {m.seq: i for i, (_, m) in enumerate(events) if isinstance(m, Digest)}
    k = data.draw(st.integers(0, nb - 1))
    if scenario == "seq_gap":
        _set_header(events, heads[k], r(heads[k][2], seq=heads[k][2].seq + data.draw(
            st.integers(1, 5))))
    elif scenario == "no_plan":
        plan = events[0][1]
        events[0:1] = [("msg", h) for h in plan.buckets]
        case.opened = False
    elif scenario == "seq_repeat":
        i, j, h = heads[k]
        if j is None or data.draw(st.booleans()):  # sent again on its own, later
            events.insert(data.draw(st.integers(i + 1, seal_at)), ("msg", h))
        else:  # twice in the plan
            hs = list(events[i][1].buckets)
            events[i] = ("msg", r(events[i][1], buckets=hs[: j + 1] + [h] + hs[j + 1 :]))
    elif scenario == "dup_is_last":
        if nb < 2:  # a second "last" header where the Seal belongs
            events.insert(seal_at, ("msg", r(heads[0][2], seq=1)))
        else:
            k = data.draw(st.integers(0, nb - 2))
            _set_header(events, heads[k], r(heads[k][2], is_last=True))
    elif scenario == "dup_after_last":  # the plan replayed as a new update
        events += [events[0], events[1]]
        case.calls = 2
    elif scenario == "go_wrong_seq":
        gos = [i for i, (_, m) in enumerate(events) if isinstance(m, Go)]
        i = data.draw(st.sampled_from(gos))
        delta = data.draw(st.sampled_from([-1, 1, 2, 2**40]))
        if events[i][1].seq + delta < 0:  # no Go covers nothing: the decoder refuses seq -1
            delta = 1
        events[i] = ("msg", r(events[i][1], seq=events[i][1].seq + delta))
    elif scenario == "go_wrong_version":
        gos = [i for i, (_, m) in enumerate(events) if isinstance(m, Go)]
        i = data.draw(st.sampled_from(gos))
        events[i] = ("msg", r(events[i][1], version=version + 1))
    elif scenario in ("abort", "abort_other_version"):
        v = version if scenario == "abort" else version + 1
        at = data.draw(st.integers(1, len(events) - 1))  # anywhere before the Commit
        events.insert(at, ("msg", Abort(P, v, k, "hostile abort")))
        case.told = scenario != "abort"
    elif scenario == "garbage":
        at = data.draw(st.integers(0, len(events) - 1))
        junk = data.draw(st.one_of(st.binary(max_size=64),
                                   st.just(encode(Go(P + 1, version, 0))),
                                   st.just(encode(Go(P, version, 0))[:-1])))
        events.insert(at, ("authenticated", junk))
        if at == 0:  # junk before the update opens is skipped (left over from before)
            case.expect = None
    elif scenario in ("bad_length_go", "bad_length_abort", "bad_header_go"):
        i, j, h = heads[k]
        if scenario == "bad_header_go":
            if not h.slots:
                h = r(h, slots=[Slot("e", "float32", [0], 0, 0)], length=0)
            s0 = h.slots[0]
            # (values past the types' bounds, negative ones, never decode: (a) covers them)
            how = data.draw(st.sampled_from(["misalign", "dtype", "overlap", "dup", "src"]))
            if how == "misalign":
                s0 = r(s0, offset=s0.offset + 8)
            elif how == "dtype":
                s0 = r(s0, dtype="complex128")
            slots = [s0, *h.slots[1:]]
            if how == "overlap" and not h.slots[0].nbytes:
                how = "dup"
            if how in ("overlap", "dup"):
                twin = "x" if how == "overlap" else h.slots[0].name
                slots = [h.slots[0], r(h.slots[0], name=twin)]
            bad = r(h, slots=slots)
            if how == "src":  # a sender this receiver has no group with (it has one: 0)
                bad = r(h, src=data.draw(st.sampled_from([1, 2, 2**40])))
        else:
            delta = data.draw(st.sampled_from([-1, 1, ALIGN, CAP + 1]))
            if h.length + delta < 0:
                delta = 1
            bad = r(h, length=h.length + delta)
        _set_header(events, heads[k], bad)
        nxt = i + 1  # the Go that answers it: right after its plan, or after it
        if scenario == "bad_length_abort":
            events[nxt] = ("msg", Abort(P, version, h.seq, "a receiver refused"))
        del events[nxt + 1 :]
    elif scenario == "header_other_version":
        _set_header(events, heads[k], r(heads[k][2], version=version + 1))
        del events[heads[k][0] + 2 :]  # up to the Go that would cover it
    elif scenario in ("digest_no_checksum", "digest_bad_checksum"):
        k = data.draw(st.sampled_from(moving))
        d = events[digests[k]][1]
        flip = data.draw(st.sampled_from([2, 6, 2**40]))  # keeps it nonzero (checksums are odd)
        bad = 0 if scenario == "digest_no_checksum" else d.checksum ^ flip
        events[digests[k]] = ("msg", r(d, checksum=bad))
        case.unloaded = set(markers[k:]) - {0}  # joined (to stay in step), never loaded
    elif scenario in ("seal_bad_checksum", "seal_no_checksum", "seal_wrong_count"):
        seal = events[seal_at][1]
        sums = list(seal.checksums)
        if scenario == "seal_wrong_count":
            if data.draw(st.booleans()):
                seal = r(seal, buckets=nb + data.draw(st.sampled_from([-1, 1, 2**40])))
            elif nb > 1 and data.draw(st.booleans()):
                seal = r(seal, checksums=sums[:-1])
            else:
                seal = r(seal, checksums=sums + [sums[-1]])
        else:
            k = data.draw(st.sampled_from(moving))
            sums[k] = 0 if scenario == "seal_no_checksum" else sums[k] ^ 2
            seal = r(seal, checksums=sums)
        events[seal_at] = ("msg", seal)
    elif scenario == "commit_wrong":  # not Commit(1) where it belongs
        commit = events[-1][1]
        events[-1] = ("msg", data.draw(st.sampled_from(
            [r(commit, phase=2)]  # this is not staged (phases past 1..2 never decode)
            + [events[seal_at][1], Go(P, version, nb)])))
        case.told = False  # `_commit` fails without an Error (a non-staged sender awaits none)
    elif scenario == "commit_early":  # Commit where the Seal belongs: nothing stamped unverified
        if data.draw(st.booleans()):
            events[seal_at], events[-1] = events[-1], events[seal_at]
        else:
            del events[seal_at]
    elif scenario == "commit_other_version":
        events[-1] = ("msg", r(events[-1][1], version=version + 1))
    elif scenario == "forged_go":
        events[1] = ("forged", events[1][1])
        del events[2:]
    elif scenario == "truncated":
        del events[data.draw(st.integers(0, len(events) - 1)) :]
        case.opened = bool(events)
    if data.draw(st.integers(0, 3)) == 0 and events:  # a verbatim replay of a frame already sent
        events.insert(data.draw(st.integers(1, len(events))), ("replay", None))
    if case.expect is None:
        case.told = False
    return case


def play(trainer: SenderChannel, events) -> int:
    """Send `events` to rank 1 as a hostile sender would; returns how many were replays."""
    sock = trainer._sock
    sent_raw: list[list[bytes]] = []
    real = sock.send_multipart
    replays = 0
    for kind, obj in events:
        if kind == "replay":
            if sent_raw:
                real(sent_raw[-1])
                replays += 1
            continue
        frames: list[bytes] = []
        sock.send_multipart = lambda f, *a, **kw: (frames.append(list(f)), real(f, *a, **kw))[1]
        try:
            if kind == "msg":
                trainer.send(1, obj)
            elif kind == "authenticated":
                trainer._send_payload(1, obj)
            elif kind == "forged":  # well-formed, for the right session, under another secret
                sid = trainer._by_rank[1]
                meta = _META.pack(FRAMING, sid, trainer.epoch, 2**62, 1)
                payload = encode(obj)
                real([sid, meta + _mac(b"not the secret", _TO_RECEIVER, meta, payload), payload])
        finally:
            sock.send_multipart = real
        sent_raw += frames
    return replays


@pytest.mark.parametrize("scenario", [n for n in SCENARIOS if n not in TIMING_OUT])
def test_receiver_survives_hostile_sender(hostile, scenario):
    """Each scenario its own derandomized run (one shared draw of the scenario left some out)."""

    @fuzz(EXAMPLES_PER_WEIGHT * SCENARIOS[scenario][0])
    @given(st.data())
    def one(data):
        run_hostile(hostile, scenario, data)

    one()


@fuzz(16)
@given(st.sampled_from(TIMING_OUT), st.data())
def test_receiver_times_out_on_forged_or_missing_frames(hostile, scenario, data):
    run_hostile(hostile, scenario, data)


def run_hostile(hostile, scenario, data):
    """Play one hostile sequence against a fresh receiver and check how it ended."""
    trainer, cfg = hostile
    version = data.draw(st.integers(0, 2**40))
    case = hostile_events(data, scenario, version)
    events = case.events
    # What follows the Seal is the sender's side of the commit round: sent once the receiver
    # acknowledged (a Commit before its Ack is refused: `test_receiver_rules`).
    seal = next((i for i, (_, m) in enumerate(events) if isinstance(m, Seal)), len(events))
    later = [events[seal + 1 :]]
    replays = 0

    def commit_round():
        nonlocal replays
        replays += play(trainer, later.pop()) if later else 0

    rx, sent = new_receiver(trainer, cfg, case.require_checksums, commit_round)
    try:
        replays += play(trainer, events[: seal + 1])
        COUNTS["receiver frames"] += len(events)
        COUNTS["receiver sequences"] += 1
        COUNTS[f"scenario {scenario}"] += 1
        results, loaders = [], []
        for _ in range(case.calls):
            loader = RecordingLoader()
            t0 = time.monotonic()
            results.append(rx.receive(loader, timeout_s=T))  # must not raise
            # Every wait is bounded by T, and each ends at once or by a timeout; a failure at the
            # last bucket waits for the Seal (queued already, or at most T).
            assert time.monotonic() - t0 < T * 2 + 1.0, "receive() overran its timeouts"
            loaders.append(loader)
        last = results[-1]
        if case.expect is None:  # harmless: the update completes and is stamped
            assert all(x["ok"] for x in results), (scenario, events, results)
            assert last["version"] == version and loaders[-1].finished, (scenario, last)
        else:
            assert last["ok"] is False, (scenario, events, results)
            assert re.search(case.expect, last["error"], re.S), (scenario, last["error"])
        # The version is stamped only by a Commit of an update that completed.
        assert rx.state.version == (version if any(x["ok"] for x in results) else -1), results
        # Every collective joined was for a header this receiver said Ready to (the answer just
        # before it), and no byte of any other bucket, or of one it joined without agreeing to
        # its bytes (checksum), reached a loader.
        log = rx.transport.log
        accepted = set()
        for i, (what, marker) in enumerate(log):
            if what == "broadcast":
                said = [seq for w, seq in log[:i] if w == "Ready"]
                assert said and max(said) >= case.markers.index(marker), (scenario, log)
                accepted.add(marker)
        for loader in loaders:
            for name, raw in loader.loaded:
                got = set(raw.unique().tolist())
                assert got <= accepted and not got & case.unloaded, (scenario, name, log)
            if loader.began and not loader.finished:
                assert loader.aborted
        # The failure converged: the sender was told (unless it was the one that ended it, or
        # no plan came: nobody asked, and an Error of no update would belong to none).
        if not case.opened:
            assert not any(isinstance(m, Error) for m in sent), (scenario, sent)
        elif case.told:
            assert isinstance(sent[-1], Error), (scenario, sent[-1])
            assert sent[-1].version == version, (scenario, sent[-1])
        # Every verbatim replay was dropped: read up to a fresh sentinel sent after everything.
        trainer.send(1, Abort(P, 0, -1, "sentinel"))  # any update: read directly
        while True:
            try:
                msg = rx.channel.recv(5.0)
            except ProtocolError:
                continue
            if isinstance(msg, Abort) and msg.reason == "sentinel":
                break
        assert rx.channel.rejections["replayed"] == replays
        if scenario == "forged_go":
            assert rx.channel.rejections["bad MAC"] >= 1
    finally:
        rx.close()


def test_receiver_hostile_sender_real_gloo(monkeypatch):
    """A few hostile sequences over a real 2-rank gloo group (the test plays rank 0), against a
    receiver with the engine's default policy (bucket checksums required)."""
    monkeypatch.setattr(receiver_mod, "open_transport", open_transport)  # the stand-in off
    monkeypatch.delenv("VLLM_NCCL_SYNC_REQUIRE_CHECKSUMS", raising=False)
    port = free_port()
    cfg = SyncConfig(control_port=port, group_port=free_port(), world_size=2, bucket_bytes=CAP,
                     timeout_s=5.0, secret=SECRET)
    trainer = SenderChannel("127.0.0.1", port, cfg.secret_bytes)
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("tx", open_transport(cfg, 0)))
    th.start()
    rx = receiver_mod.Receiver(cfg, 1)
    th.join(30)
    tx: Transport = box["tx"]
    trainer.recv(time.monotonic() + 5)
    assert rx.require_checksums
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(100, generator=g)), ("b", torch.randn(127, generator=g)),
             ("c", torch.randint(0, 9, (30,), generator=g))]  # buckets: [a, b], [c]
    buckets = list(plan_buckets(named, CAP))
    assert len(buckets) == 2
    # Each bucket's wire bytes, packed once (padding included: the checksum covers it too).
    wires = [pack(b, torch.zeros(CAP, dtype=torch.uint8)) for b in buckets]
    sums = [checksum(w) for w in wires]

    def run(version, script, wait_s=2.0):
        """Send `script` (messages; ("bcast", k): broadcast bucket k's real bytes; "ack": wait
        for the receiver's Ack, as the commit round goes)."""
        loader = RecordingLoader()
        out = {}
        t = threading.Thread(
            target=lambda: out.setdefault("r", rx.receive(loader, timeout_s=wait_s)))
        t.start()
        items = script(version)
        for item in items:
            if isinstance(item, tuple):
                tx.broadcast(wires[item[1]]).wait()
            elif item == "ack":
                deadline = time.monotonic() + 20
                while not isinstance(trainer.recv(deadline)[1], Ack):
                    pass
            else:
                trainer.send(1, item)
        t.join(20)
        assert not t.is_alive(), "receive() hung"
        COUNTS["receiver sequences"] += 1
        COUNTS["receiver frames"] += len([i for i in items if i != "ack"])
        return out["r"], loader

    def hdr(v, k, **kw):
        return msgspec.structs.replace(buckets[k].header(v, k, k == len(buckets) - 1, P), **kw)

    def plan(v, *headers):
        return Plan(P, v, [], buckets=list(headers) or [hdr(v, 0), hdr(v, 1)])

    def dig(v, k, digest=None):
        return Digest(P, v, k, sums[k] if digest is None else digest)

    def data(v, d0=None, d1=None):
        return [("bcast", 0), dig(v, 0, d0), ("bcast", 1), dig(v, 1, d1)]

    def clean(v):
        return [plan(v), Go(P, v, 1), *data(v), Seal(P, v, 2, sums), "ack", Commit(P, v, 1)]

    def stream(v):  # one header ahead: header 1 comes on its own, with its own Go
        return [plan(v, hdr(v, 0)), Go(P, v, 0), hdr(v, 1), Go(P, v, 1), *data(v),
                Seal(P, v, 2, sums), "ack", Commit(P, v, 1)]

    def bit_exact(loader):
        got = {n: t for n, t in loader.loaded}
        for n, t in named:
            assert torch.equal(got[n], t.reshape(-1).view(torch.uint8))

    try:
        # Baseline: a clean update arrives bit-exactly, planned and streamed.
        res, loader = run(1, clean)
        assert res["ok"] and res["version"] == 1, res
        bit_exact(loader)
        res, loader = run(2, stream)
        assert res["ok"] and res["version"] == 2, res
        bit_exact(loader)
        # A Go beyond the headers the receiver accepted: never joined, nothing loaded.
        res, loader = run(3, lambda v: [plan(v), Go(P, v, 7)])
        assert not res["ok"] and "expected Go for bucket 0, got Go" in res["error"], res
        assert loader.loaded == []
        # Abort after the agreed collectives (what a failing trainer does).
        res, _ = run(4, lambda v: [plan(v), Go(P, v, 1), *data(v),
                                   Abort(P, v, 2, "trainer died")])
        assert not res["ok"] and "trainer died" in res["error"] and not res["consistent"], res
        # Two last buckets: bucket 0 claims to be the last and bucket 1 follows: the plan is
        # refused before any byte moves.
        res, loader = run(5, lambda v: [plan(v, hdr(v, 0, is_last=True), hdr(v, 1)),
                                        Abort(P, v, -1, "refused")])
        assert not res["ok"] and "follows the last bucket 0" in res["error"], res
        assert loader.loaded == []
        # Headers without a plan open no update: ignored, unjoined.
        res, loader = run(5, lambda v: [hdr(v, 1, is_last=True), Go(P, v, 1)], wait_s=0.5)
        assert not res["ok"] and re.search(TIMEOUT, res["error"]) and loader.loaded == [], res
        # A Digest without a checksum (of the last bucket): the bucket is joined (the group stays
        # in step), none of it is loaded, the Seal is answered with Error, the sender aborts.
        res, loader = run(6, lambda v: [plan(v), Go(P, v, 1), *data(v, d1=0),
                                        Seal(P, v, 2, sums), Abort(P, v, 2, "rank 1 failed")])
        assert not res["ok"] and "carries no checksum" in res["error"], res
        assert [n for n, _ in loader.loaded] == ["a", "b"] and res["version"] == 2, res
        # A Digest that does not match the bytes: corrupted, nothing loaded (bucket 0: its bytes
        # are checked before they would be loaded).
        res, loader = run(7, lambda v: [plan(v), Go(P, v, 1), *data(v, d0=sums[0] ^ 2),
                                        Seal(P, v, 2, sums), Abort(P, v, 2, "rank 1 failed")])
        assert not res["ok"] and "arrived corrupted" in res["error"], res
        assert loader.loaded == [] and res["version"] == 2, res
        # The group still works after all of that.
        assert not rx.broken
        res, loader = run(8, clean)
        assert res["ok"] and res["version"] == 8 and res["consistent"], res
        bit_exact(loader)
        # Header length != end of its last tensor, then Go anyway: refused, never joined. The
        # sender may have posted a collective this receiver will never join: the group is given
        # up (the next update needs a new join).
        res, loader = run(9, lambda v: [plan(v, hdr(v, 0), hdr(v, 1, length=CAP)), Go(P, v, 1)])
        assert not res["ok"] and re.search("refused: .*!= end of its last tensor", res["error"])
        assert loader.loaded == []
        assert rx.broken and res["version"] == 8, res
        res = rx.receive(RecordingLoader(), timeout_s=0.5)
        assert not res["ok"] and "transfer group is broken" in res["error"], res
    finally:
        rx.close()
        tx.close()
        trainer.close()


# ---------------------------------------------------------------- totals

def test_fuzz_totals(record_property, capsys):
    expected = {"decode", "header", "receiver frames"}
    if not expected <= set(COUNTS):
        pytest.skip("run the whole module to count its cases")
    total = COUNTS["decode"] + COUNTS["header"] + COUNTS["receiver frames"]
    for k, v in COUNTS.items():
        record_property(f"fuzz_{k.replace(' ', '_')}", v)
    record_property("fuzz_total", total)
    line = (f"fuzz cases: {total} frames/headers in all -- decoder {COUNTS['decode']}, "
            f"header validator {COUNTS['header']}, receiver {COUNTS['receiver frames']} frames "
            f"in {COUNTS['receiver sequences']} hostile sequences")
    scenarios = {k.split()[1]: v for k, v in COUNTS.items() if k.startswith("scenario ")}
    with capsys.disabled():  # shown with or without -s
        print(f"\n{line}\n  hostile scenarios: {scenarios}")
    assert total >= MIN_TOTAL, line
