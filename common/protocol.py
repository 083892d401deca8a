"""Control-plane messages between producer and consumers, and the one place that encodes and decodes them.

Wire format: a msgpack array `[version, type, *fields]`, fields in dataclass order. Decoding is strict:
the version, the type, the field count and every field's type and size are checked, so whatever a socket
delivers either becomes a valid message or raises `ProtocolError`. Nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 3  # 2: HELLO carries node and launch, WELCOME the launch; 3: BATCH the validation pass
MAX_MESSAGE_BYTES = 1 << 20  # also the sockets' MAXMSGSIZE
MAX_STR = 4096
MAX_BYTES = 4096
MAX_LIST = 65536
MAX_DICT = 64

Scalar = int | float | str | bytes | bool | None


class ProtocolError(ValueError):
    """A message that is not one of ours: counted and logged by the receiver, never fatal."""


@dataclass(frozen=True)
class Hello:
    """consumer → producer: who I am and where I resume (the next seq my drafter has not trained)."""

    TYPE: ClassVar[int] = 1
    drafter: str
    replica: int
    pid: int
    gpu_uuid: str  # "" on CPU
    resume_seq: int
    ring_attached: bool = False  # this process holds the ring already: WELCOME need not export it again
    node: int = 0  # the node rank this consumer belongs to (the producer serves its own node only)
    launch: str = ""  # the launch's id (common/joblock.py; "" without launch.sh): must equal the producer's


@dataclass(frozen=True)
class Welcome:
    """producer → consumer: the ring to attach (once) and the session's epoch (stale messages carry old ones)."""

    TYPE: ClassVar[int] = 2
    epoch: int
    transport: str  # "cpu" | "cuda"
    num_slots: int
    slot_bytes: int
    ring: dict[str, Scalar]  # plain values: shm path, or CUDA IPC fields; {} when HELLO said ring_attached
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    launch: str = ""  # the producer's launch id, which the consumer's HELLO matched


@dataclass(frozen=True)
class Attached:
    """consumer → producer: the ring is open and its canary checked; only now are batches sent."""

    TYPE: ClassVar[int] = 3
    epoch: int


@dataclass(frozen=True)
class Batch:
    """producer → consumer: a batch in `slot`. A validation batch (`val_pass` ≥ 1, producer/validation.py) is
    evaluated, never trained: its `seq` is negative (-2, -3, ...: a slot tag, no place in the plan) and it is
    batch `val_index` of the `val_count` that make evaluation pass `val_pass`."""

    TYPE: ClassVar[int] = 4
    epoch: int
    seq: int
    slot: int
    data_epoch: int  # pass over the dataset this batch belongs to
    layout: list[tuple[str, str, list[int], int]]  # (name, dtype, shape, offset): common.ring.TensorSpec
    sample_ids: list[int]
    num_tokens: int
    num_loss_tokens: int
    val_pass: int = 0  # 0: a training batch
    val_index: int = 0
    val_count: int = 0


@dataclass(frozen=True)
class Release:
    """consumer → producer: these (seq, slot) pairs are read; the slots may be reused."""

    TYPE: ClassVar[int] = 5
    epoch: int
    pairs: list[tuple[int, int]]


@dataclass(frozen=True)
class Heartbeat:
    TYPE: ClassVar[int] = 6
    time: float
    last_seq: int


DATA_EXHAUSTED = "data exhausted"  # End's reason when every batch of the plan was delivered


@dataclass(frozen=True)
class End:
    """producer → consumer: the stream ended (DATA_EXHAUSTED: the whole plan was delivered; else the producer
    stopped and says why); checkpoint and say BYE."""

    TYPE: ClassVar[int] = 7
    reason: str
    last_seq: int


@dataclass(frozen=True)
class Fail:
    """either way: a failure (not the end of data); the receiver decides whether it is fatal."""

    TYPE: ClassVar[int] = 8
    reason: str
    fatal: bool = True


@dataclass(frozen=True)
class Bye:
    TYPE: ClassVar[int] = 9
    reason: str
    trained_seq: int = -1


Message = Hello | Welcome | Attached | Batch | Release | Heartbeat | End | Fail | Bye
MESSAGE_TYPES: dict[int, type] = {cls.TYPE: cls for cls in typing.get_args(Message)}
_FIELDS: dict[type, list[tuple[str, Any]]] = {
    cls: [(f.name, typing.get_type_hints(cls)[f.name]) for f in dataclasses.fields(cls)]
    for cls in MESSAGE_TYPES.values()
}


# ---------------------------------------------------------------------------------------------- encode


def _to_wire(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [_to_wire(v) for v in value]
    return value


def encode(msg: Message) -> bytes:
    fields = [_to_wire(getattr(msg, name)) for name, _ in _FIELDS[type(msg)]]
    data = msgpack.packb([PROTOCOL_VERSION, msg.TYPE, *fields], use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{type(msg).__name__} is {len(data)} bytes, over the {MAX_MESSAGE_BYTES} limit")
    return data


# ---------------------------------------------------------------------------------------------- decode


def _check(value: Any, ann: Any, where: str) -> Any:
    """Validate `value` against annotation `ann`; return it in its Python form."""
    origin = typing.get_origin(ann)
    if ann is int:
        if type(value) is not int:
            raise ProtocolError(f"{where}: expected int, got {type(value).__name__}")
        if not -(1 << 63) <= value < (1 << 64):
            raise ProtocolError(f"{where}: int out of range")
        return value
    if ann is float:
        if type(value) not in (float, int):
            raise ProtocolError(f"{where}: expected float, got {type(value).__name__}")
        if not math.isfinite(value):
            raise ProtocolError(f"{where}: {value} is not a finite number")
        return float(value)
    if ann is bool:
        if type(value) is not bool:
            raise ProtocolError(f"{where}: expected bool, got {type(value).__name__}")
        return value
    if ann is str:
        if type(value) is not str:
            raise ProtocolError(f"{where}: expected str, got {type(value).__name__}")
        if len(value) > MAX_STR:
            raise ProtocolError(f"{where}: string of {len(value)} characters, over {MAX_STR}")
        return value
    if ann is bytes:
        if type(value) is not bytes:
            raise ProtocolError(f"{where}: expected bytes, got {type(value).__name__}")
        if len(value) > MAX_BYTES:
            raise ProtocolError(f"{where}: {len(value)} bytes, over {MAX_BYTES}")
        return value
    if origin is list:
        (item,) = typing.get_args(ann)
        if type(value) is not list:
            raise ProtocolError(f"{where}: expected list, got {type(value).__name__}")
        if len(value) > MAX_LIST:
            raise ProtocolError(f"{where}: list of {len(value)} items, over {MAX_LIST}")
        return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        items = typing.get_args(ann)
        if type(value) is not list or len(value) != len(items):
            raise ProtocolError(f"{where}: expected an array of {len(items)} values")
        return tuple(_check(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, items, strict=True)))
    if origin is dict:
        if type(value) is not dict or len(value) > MAX_DICT:
            raise ProtocolError(f"{where}: expected a map of at most {MAX_DICT} entries")
        return {_check(k, str, f"{where} key"): _check_scalar(v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"protocol schema: unsupported annotation {ann!r} at {where}")  # a bug in this file


def _check_scalar(value: Any, where: str) -> Scalar:
    if value is None or type(value) is bool:
        return value
    for ann in (int, float, str, bytes):
        if type(value) is ann:
            return _check(value, ann, where)
    raise ProtocolError(f"{where}: expected a plain value, got {type(value).__name__}")


def decode(data: bytes) -> Message:
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes, over the {MAX_MESSAGE_BYTES} limit")
    try:
        frame = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True,
            max_array_len=MAX_LIST + 16, max_map_len=MAX_DICT,
        )  # fmt: skip
    except Exception as err:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"not a msgpack message: {type(err).__name__}: {err}") from None
    if type(frame) is not list or len(frame) < 2:
        raise ProtocolError("a message is an array [version, type, ...]")
    version, kind, *fields = frame
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r}, this side speaks {PROTOCOL_VERSION}")
    cls = MESSAGE_TYPES.get(kind) if type(kind) is int else None
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    schema = _FIELDS[cls]
    if len(fields) != len(schema):
        raise ProtocolError(f"{cls.__name__}: {len(fields)} fields, expected {len(schema)}")
    values = {name: _check(v, ann, f"{cls.__name__}.{name}") for v, (name, ann) in zip(fields, schema, strict=True)}
    return cls(**values)


def describe(msg: Message) -> str:
    """A short log form (no big lists)."""
    parts = []
    for f in dataclasses.fields(msg):
        v = getattr(msg, f.name)
        parts.append(f"{f.name}=<{len(v)}>" if isinstance(v, list | dict) else f"{f.name}={v!r}")
    return f"{type(msg).__name__}({', '.join(parts)})"


__all__ = [
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "Attached",
    "Batch",
    "Bye",
    "End",
    "Fail",
    "Heartbeat",
    "Hello",
    "Message",
    "ProtocolError",
    "Release",
    "Welcome",
    "decode",
    "describe",
    "encode",
]
