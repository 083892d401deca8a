"""Checks on a target's safetensors files shared by the producer and the consumers: a truncated download or a
corrupt header is reported with the file's name and the fault, before any loader trips over it."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open


class WeightFileError(ValueError):
    """A weight file is missing, truncated or corrupt; the message starts with the file's path."""


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of the model directory `path`: those its index lists, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(path.glob("*.safetensors"))
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
        raise WeightFileError(f"{index}: not a safetensors index (a JSON object with weight_map): {err}") from None
    return [path / n for n in names]


def check_safetensors_file(file: Path) -> None:
    """Read `file`'s header and compare the bytes it declares with the file's size."""
    if not file.is_file():
        raise WeightFileError(f"{file}: listed in the safetensors index but missing")
    size = file.stat().st_size
    with file.open("rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        if size < 8 or header_len > size - 8:
            raise WeightFileError(
                f"{file}: truncated or not a safetensors file ({size} bytes; its first 8 bytes announce a"
                f" {header_len}-byte header)"
            )
        try:
            header = json.loads(fh.read(header_len))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
            raise WeightFileError(f"{file}: corrupt safetensors header (not a JSON tensor table: {err})") from None
    if 8 + header_len + end != size:
        raise WeightFileError(
            f"{file}: truncated or corrupt: its header declares {8 + header_len + end} bytes, the file has {size}"
        )
    try:
        with safe_open(str(file), framework="pt"):
            pass
    except (SafetensorError, OSError) as err:
        raise WeightFileError(f"{file}: not a readable safetensors file: {err}") from None


def check_weight_files(path: Path) -> None:
    """Every safetensors file of the model directory `path` is whole (WeightFileError names the first bad one)."""
    for file in safetensors_files(path):
        check_safetensors_file(file)
