"""Unit: the wire protocol round-trips and rejects what it must."""

import msgspec
import pytest

from vllm_nccl_sync.wire.packing import validate_header
from vllm_nccl_sync.wire.protocol import (
    MAX_FRAME_BYTES,
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
    Slot,
    TensorSpec,
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
        (header([Slot("a", "float32", [-4], 0, 0)], 0), 0, "negative dimension"),
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
