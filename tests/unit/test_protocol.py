"""Unit: the wire protocol round-trips and rejects what it must, naming where."""

import msgspec
import pytest

from vllm_nccl_sync.wire.packing import validate_header
from vllm_nccl_sync.wire.protocol import (
    MAX_BUCKETS,
    MAX_DIMS,
    MAX_FRAME_BYTES,
    MAX_NAME_CHARS,
    MAX_PLAN_BUCKETS,
    MAX_TENSORS,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    BucketHeader,
    Digest,
    Error,
    Go,
    Hello,
    Plan,
    ProtocolError,
    Ready,
    Seal,
    Sent,
    Slot,
    Source,
    TensorSpec,
    UnreadablePlan,
    belongs,
    decode,
    encode,
)

P = PROTOCOL_VERSION


def header(slots, length, seq=0, is_last=True):
    return BucketHeader(P, 7, seq, length, is_last, slots)


MESSAGES = [
    Hello(P, 1, 0, 0, 1, 1 << 20, "gloo"),
    header([Slot("w", "bfloat16", [2, 3], 0, 12), Slot("b", "float32", [5], 64, 20, 0)], 84),
    Ready(P, 3, 4),
    Go(P, 7, 4),
    Digest(P, 7, 4, 0x1234567),
    Plan(P, 7, [TensorSpec("w", "bfloat16", [2, 3])], full=True, staged=True,
         buckets=[header([Slot("w", "bfloat16", [2, 3], 0, 12)], 12)]),
    Abort(P, 7, 4, "rank 2 refused"),
    Ack(P, 1, 7, 3, 1234, 10, 0.5),
    Error(P, 2, 1, "bad", "Traceback..."),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_rejects_other_protocol_version():
    with pytest.raises(ProtocolError, match="protocol version 99"):
        decode(encode(Go(99, 1, 0)))


@pytest.mark.parametrize(
    "frame, match",
    [
        (b"\xc1", "undecodable"),
        (msgspec.msgpack.encode({"type": "bucket", "protocol": P}), "invalid message"),
        (msgspec.msgpack.encode({"type": "pickle", "protocol": P}), "invalid message"),
        (msgspec.msgpack.encode({"type": "go", "protocol": P, "version": "1", "seq": 0}), "int"),
        (msgspec.msgpack.encode({"type": "go", "protocol": P, "version": 1, "seq": 0, "x": 1}),
         "unknown field"),
        (encode(Go(P, 1, 0))[:-1], "undecodable"),
        (b"\x00" * (MAX_FRAME_BYTES + 1), "exceeds"),
    ],
)
def test_rejects_malformed_frames(frame, match):
    with pytest.raises(ProtocolError, match=match):
        decode(frame)


def test_no_pickle_accepted():
    import pickle

    with pytest.raises(ProtocolError):
        decode(pickle.dumps(Go(P, 1, 0)))


CAP = 4096


@pytest.mark.parametrize(
    "hdr, seq, match",
    [
        (header([Slot("a", "float32", [4], 0, 16)], 16, seq=1), 0, "gap"),
        (header([Slot("a", "float32", [4], 0, 16)], 16, seq=0), 1, "repeat"),
        (header([Slot("a", "float32", [4], 0, 16)], 8), 0, "past the bucket length"),
        (header([Slot("a", "float32", [4], 0, 16)], 32), 0, "!= end of its last tensor"),
        (header([Slot("a", "float32", [2000], 0, 8000)], 8000), 0, "outside"),
        (header([Slot("a", "complex32", [4], 0, 16)], 16), 0, "unknown dtype"),
        (header([Slot("a", "float32", [4], 0, 16), Slot("b", "float32", [4], 0, 16)], 16), 0,
         "overlaps"),
        (header([Slot("a", "float32", [4], 8, 16)], 24), 0, "not aligned"),
        (header([Slot("a", "float32", [4], 0, 32)], 32), 0, "exceed its size"),
        (header([Slot("a", "float32", [4], 0, 6)], 6), 0, "whole float32 elements"),
        (header([Slot("a", "float32", [4], 0, 8, 12)], 8), 0, "exceed its size"),
    ],
)
def test_header_rejections(hdr, seq, match):
    with pytest.raises(ValueError, match=match):
        validate_header(hdr, seq, CAP)


def test_valid_header_passes():
    validate_header(
        header([Slot("a", "bfloat16", [3], 0, 6), Slot("z", "int64", [0], 64, 0)], 64), 0, CAP
    )


# ---------------------------------------------------------------- bounds in the types

def _h(slots, length, seq=0, protocol=P):
    return BucketHeader(protocol, 7, seq, length, True, slots)


@pytest.mark.parametrize(
    "msg, where",
    [
        (_h([Slot("a", "float32", [-4], 0, 0)], 0), r">= 0 - at `\$\.slots\[0\]\.shape\[0\]`"),
        (_h([Slot("a", "float32", [2**63], 0, 0)], 0), r"<= \d+ - at `\$\.slots\[0\]\.shape\[0\]`"),
        (_h([Slot("a", "float32", [1] * (MAX_DIMS + 1), 0, 4)], 4),
         rf"length <= {MAX_DIMS} - at `\$\.slots\[0\]\.shape`"),
        (_h([Slot("x" * (MAX_NAME_CHARS + 1), "float32", [1], 0, 4)], 4),
         rf"length <= {MAX_NAME_CHARS} - at `\$\.slots\[0\]\.name`"),
        (_h([Slot("a", "float32", [4], -64, 16)], 16), r"at `\$\.slots\[0\]\.offset`"),
        (_h([Slot("a", "float32", [4], 0, -16)], 0), r"at `\$\.slots\[0\]\.nbytes`"),
        (_h([Slot("a", "float32", [4], 0, 8, -4)], 8), r"at `\$\.slots\[0\]\.start`"),
        (_h([], -1), r"at `\$\.length`"),
        (Plan(P, 7, [], buckets=[_h([], 0), _h([], 0, seq=1), _h([], -8, seq=2)]),
         r">= 0 - at `\$\.buckets\[2\]\.length`"),
        (Plan(P, 7, [TensorSpec("w", "bfloat16", [2, -3])]), r"at `\$\.tensors\[0\]\.shape\[1\]`"),
        (Go(P, 7, -1), r"at `\$\.seq`"),
        (Go(P, -1, 0), r"at `\$\.version`"),
        (Ready(P, 1, 0, version=-2), r">= -1 - at `\$\.version`"),
        (Error(P, 1, -2, "x"), r">= -1 - at `\$\.seq`"),
        (Abort(P, 7, -2, "x"), r">= -1 - at `\$\.seq`"),
        (Seal(P, 7, 1, [-1]), r"at `\$\.checksums\[0\]`"),
        (Seal(P, 7, 1, [2**63]), r"at `\$\.checksums\[0\]`"),
        (Sent(P, 1, 7, {0: -5}), r"at `\$\.checksums\[\.\.\.\]`"),
        (Ack(P, 1, 7, 1, 0, 0, 0.0, phase=3), r"<= 2 - at `\$\.phase`"),
        (Hello(P, 1, 0, 0, 0, 1 << 20, "gloo"), r">= 1 - at `\$\.tp_size`"),
    ],
    ids=lambda v: None if isinstance(v, str) else type(v).__name__,
)
def test_decoding_enforces_the_bounds_and_names_the_path(msg, where):
    with pytest.raises(ProtocolError, match="invalid message: Expected .*" + where):
        decode(encode(msg))


@pytest.mark.parametrize("msg", [Abort(P, 7, -1, "the plan"), Error(P, 1, -1, "early"),
                                 Ready(P, 1, 0), Error(P, 0, 3, "x", version=-1)],
                         ids=lambda m: type(m).__name__)
def test_minus_one_where_it_means_none(msg):
    assert decode(encode(msg)) == msg


def test_the_version_rule_an_error_belongs_only_to_the_update_it_names():
    """A failure is its update's: an `Error` of version -1 (its sender knew of no update) belongs
    to none, so it cannot fail whichever update opens next."""
    assert belongs(Error(P, 1, 0, "x", version=5), 5)
    assert not belongs(Error(P, 1, 0, "x", version=4), 5)
    assert not belongs(Error(P, 1, -1, "before any plan", version=-1), 5)
    assert not belongs(Error(P, 1, -1, "before any plan", version=-1), -1)
    assert not belongs(Ready(P, 1, 0), 5) and not belongs(Hello(P, 1, 0, 0, 1, 64, "gloo"), 5)


@pytest.mark.parametrize("case", ["past a bound", "nested protocol", "message protocol"])
def test_a_plan_that_does_not_decode_still_names_its_update(case):
    """The update a frame that claims to be a Plan opens is read where it can be (a receiver
    refuses that update at once instead of leaving the sender to its timeout)."""
    raw = msgspec.to_builtins(Plan(P, 7, [], buckets=[_h([], 0)]))
    if case == "past a bound":
        raw["buckets"][0]["length"] = -1
    elif case == "nested protocol":
        raw["buckets"][0]["protocol"] = P - 1
    else:
        raw["protocol"] = P - 1
    with pytest.raises(UnreadablePlan) as e:
        decode(msgspec.msgpack.encode(raw))
    assert e.value.version == 7 and isinstance(e.value, ProtocolError)


@pytest.mark.parametrize("frame", [
    encode(Go(P - 1, 7, 0)),  # not a Plan
    msgspec.msgpack.encode({"type": "plan", "protocol": P, "version": -1, "tensors": []}),
    msgspec.msgpack.encode({"type": "plan", "protocol": P, "tensors": []}),  # no version
    encode(Plan(P, 7, []))[:-3],  # cut short
    b"\x00 not msgpack at all",
], ids=["go", "bad version", "no version", "truncated", "junk"])
def test_a_frame_naming_no_readable_plan_names_no_update(frame):
    with pytest.raises(ProtocolError) as e:
        decode(frame)
    assert not isinstance(e.value, UnreadablePlan), e.value


def test_a_message_at_each_count_bound_fits_a_frame_and_one_more_is_refused():
    """The documented claim of protocol.py: each bound, with one-character names, fits in
    MAX_FRAME_BYTES (so a frame that fits is never refused for a count alone at these sizes),
    and one element more is refused naming the list."""
    spec, slot = TensorSpec("a", "int8", []), Slot("a", "int8", [], 0, 0)
    at_bound = [
        (Plan(P, 7, [spec] * MAX_TENSORS), "tensors"),
        (_h([slot] * MAX_TENSORS, 0), "slots"),
        (Plan(P, 7, [], buckets=[_h([], 0)] * MAX_PLAN_BUCKETS), "buckets"),
        (Seal(P, 7, MAX_BUCKETS, [2**63 - 1] * MAX_BUCKETS), "checksums"),
    ]
    for msg, field in at_bound:
        frame = encode(msg)
        assert len(frame) <= MAX_FRAME_BYTES, (field, len(frame))
        assert decode(frame) == msg
        more = msgspec.structs.replace(msg, **{field: [*getattr(msg, field), getattr(msg, field)[0]]})
        with pytest.raises(ProtocolError, match=rf"length <= \d+ - at `\$\.{field}`"):
            decode(encode(more))


def test_a_nested_header_of_another_protocol_is_refused():
    plan = Plan(P, 7, [], buckets=[_h([], 0), _h([], 0, seq=1), _h([], 0, seq=2, protocol=1)])
    with pytest.raises(ProtocolError, match=f"bucket 2 of the plan speaks protocol 1, this side {P}"):
        decode(encode(plan))
    assert decode(encode(msgspec.structs.replace(plan, buckets=plan.buckets[:2]))).buckets[1].seq == 1


def test_a_bucket_read_where_it_lies_names_a_place_per_slot_and_round_trips():
    slots = [Slot("a", "bfloat16", [32], 0, 64), Slot("b", "bfloat16", [32], 64, 64)]
    two = msgspec.structs.replace(header(slots, 128), at=[Source(3, 128), Source(5, 0)])
    assert decode(encode(two)) == two
    validate_header(two, 0, CAP)
    short = msgspec.structs.replace(two, at=[Source(3, 128)])
    with pytest.raises(ValueError, match="names 1 places for 2 slots"):
        validate_header(short, 0, CAP)
    empty = msgspec.structs.replace(header([Slot("e", "bfloat16", [0], 0, 0)], 0), at=[Source(1, 0)])
    with pytest.raises(ValueError, match="no empty slot"):
        validate_header(empty, 0, CAP)
