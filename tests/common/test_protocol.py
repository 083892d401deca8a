import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Attached,
    Batch,
    Bye,
    End,
    Fail,
    Heartbeat,
    Hello,
    ProtocolError,
    Release,
    Welcome,
    decode,
    encode,
)

SAMPLES = [
    Hello("d0", 1, 4242, "GPU-abc", 17, True),
    Welcome(3, "cpu", 8, 1 << 20, {"path": "/dev/shm/x", "canary": b"\x00\x01", "size": 9, "ok": True}, 1.0, 5.0),
    Attached(3),
    Batch(
        3, 99, 2, 1, [("hidden", "bfloat16", [128, 320], 0), ("input_ids", "int64", [128], 81920)], [5, 9, 11], 128, 77
    ),
    Release(3, [(99, 2), (100, 3)]),
    Heartbeat(1234.5, 98),
    End("data exhausted", 120),
    Fail("fenced", False),
    Bye("sigterm", 98),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert decode(data) == msg
    assert msgpack.unpackb(data)[:2] == [PROTOCOL_VERSION, msg.TYPE]


def test_wrong_version_unknown_type_and_field_count_rejected():
    hello = msgpack.unpackb(encode(SAMPLES[0]))
    with pytest.raises(ProtocolError, match="version"):
        decode(msgpack.packb([PROTOCOL_VERSION + 1, *hello[1:]]))
    with pytest.raises(ProtocolError, match="unknown message type"):
        decode(msgpack.packb([PROTOCOL_VERSION, 77, *hello[2:]]))
    with pytest.raises(ProtocolError, match="fields"):
        decode(msgpack.packb([*hello, 1]))
    with pytest.raises(ProtocolError, match="expected int"):
        decode(msgpack.packb([PROTOCOL_VERSION, 1, "d0", "1", 1, "", 0, False, 0, ""]))
    with pytest.raises(ProtocolError, match="expected int"):
        decode(msgpack.packb([PROTOCOL_VERSION, 1, "d0", True, 1, "", 0, False, 0, ""]))  # bool is not an int here


def test_non_finite_numbers_rejected():
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ProtocolError, match="not a finite number"):
            decode(msgpack.packb([PROTOCOL_VERSION, 6, bad, 3]))  # a Heartbeat's time


def test_oversized_and_nested_values_rejected():
    with pytest.raises(ProtocolError, match="over"):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    with pytest.raises(ProtocolError):
        encode(Fail("x" * (MAX_MESSAGE_BYTES + 10)))
    ring = {"path": {"nested": 1}}
    with pytest.raises(ProtocolError, match="plain value"):
        decode(msgpack.packb([PROTOCOL_VERSION, 2, 1, "cpu", 4, 10, ring, 1.0, 5.0, ""]))
    bad_layout = [PROTOCOL_VERSION, 4, 1, 1, 0, 0, [["h", "float32", "4x4", 0]], [], 1, 1, 0, 0, 0]
    with pytest.raises(ProtocolError, match="expected list"):
        decode(msgpack.packb(bad_layout))


def test_truncated_messages_rejected():
    for msg in SAMPLES:
        data = encode(msg)
        for cut in range(len(data)):
            try:
                out = decode(data[:cut])
            except ProtocolError:
                continue
            raise AssertionError(f"truncated {type(msg).__name__} at {cut} decoded as {out!r}")


VALID_TYPES = tuple(type(m) for m in SAMPLES)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_decode_or_raise_protocol_error(data):
    try:
        msg = decode(data)
    except ProtocolError:
        return
    assert isinstance(msg, VALID_TYPES)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_messages_decode_or_raise_protocol_error(msg, data):
    raw = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    try:
        out = decode(bytes(raw))
    except ProtocolError:
        return
    assert isinstance(out, VALID_TYPES)
    assert decode(encode(out)) == out  # whatever decodes is a well-formed message
