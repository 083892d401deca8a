"""Read back an offline W&B run file (`run-<id>.wandb`) with no network: tests check what was logged.

Format (wandb 0.31): a 7-byte header (b":W&B", uint16 LE 0xBEE1, uint8 version 0), then
LevelDB-log-style 32 KiB blocks. Each record: uint32 LE CRC32 (zlib.crc32 over the type byte, then the
data), uint16 LE length, uint8 type (1 full, 2 first, 3 middle, 4 last); a block's tail shorter than a
record header is zero padding. Reassembled payloads are `wandb_internal_pb2.Record` protobufs.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

MAGIC = b":W&B"
HEADER = struct.Struct("<4sHB")  # magic, 0xBEE1, version
RECORD_HEADER = struct.Struct("<IHB")  # crc32, length, type
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class WandbFileError(ValueError):
    """A .wandb file that does not follow the format; the message names the file and offset."""


def iter_payloads(path: str | Path) -> Iterator[bytes]:
    """Yield each reassembled record payload, checking CRCs."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < HEADER.size:
        raise WandbFileError(f"{path}: {len(data)} bytes, shorter than the {HEADER.size}-byte header")
    magic, ident, version = HEADER.unpack_from(data)
    if magic != MAGIC or ident != 0xBEE1 or version != 0:
        raise WandbFileError(f"{path}: bad header {data[: HEADER.size]!r}")
    pos, pending = HEADER.size, b""
    while pos < len(data):
        room = BLOCK - pos % BLOCK
        if room < RECORD_HEADER.size:  # block trailer: padding
            pos += room
            continue
        if pos + RECORD_HEADER.size > len(data):
            break
        crc, length, kind = RECORD_HEADER.unpack_from(data, pos)
        if crc == 0 and length == 0 and kind == 0:  # zero padding at the end of a block or file
            pos += room
            continue
        start = pos + RECORD_HEADER.size
        chunk = data[start : start + length]
        if len(chunk) < length:
            break  # a record cut short by a writer that is still running
        if zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF != crc:
            raise WandbFileError(f"{path}: CRC mismatch in record at offset {pos}")
        pos = start + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""
        else:
            raise WandbFileError(f"{path}: unknown record type {kind} at offset {pos}")


def iter_records(path: str | Path) -> Iterator[wandb_internal_pb2.Record]:
    for payload in iter_payloads(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        yield record


def read_history(path: str | Path) -> list[dict[str, Any]]:
    """Every `log` row as {metric name: decoded value}, in order."""
    rows = []
    for record in iter_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows


def read_metric_definitions(path: str | Path) -> dict[str, str]:
    """{metric name or glob: its step metric ('' when none)} from define_metric records."""
    out = {}
    for record in iter_records(path):
        if record.WhichOneof("record_type") == "metric":
            m = record.metric
            out[m.name or m.glob_name] = m.step_metric
    return out


def find_run_file(wandb_dir: str | Path) -> Path:
    """The newest `run-<id>.wandb` under a W&B directory (an online attempt that fell back to offline
    leaves two)."""
    found = sorted(Path(wandb_dir).glob("*run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise WandbFileError(f"{wandb_dir}: no run-*.wandb file")
    return found[-1]
