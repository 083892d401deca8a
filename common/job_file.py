"""Job files written from the config's own values, never from f-strings: `dumps` turns a dict of the config's
value types (str, int, float, bool, lists, nested tables, arrays of tables) into TOML; `write_job_file`
validates the dict (or takes a validated `JobConfig`) first, so a job file written here always loads.

tomllib only reads TOML and no writer is installed; this one covers what a job file holds, and
tests/common/test_job_file.py reads everything it writes back through tomllib."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

from common.config import JobConfig, parse_job

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(key: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"TOML keys are strings, got {key!r}")
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def _value(value: object, where: str) -> str:
    if isinstance(value, bool):  # before int: bool is an int
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str | os.PathLike):
        return json.dumps(os.fspath(value), ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v, f"{where}[{i}]") for i, v in enumerate(value)) + "]"
    if isinstance(value, Mapping):
        return (
            "{" + ", ".join(f"{_key(k)} = {_value(v, f'{where}.{k}')}" for k, v in value.items() if v is not None) + "}"
        )
    raise TypeError(f"{where}: TOML has no value for {type(value).__name__} {value!r}")


def _is_table_array(value: object) -> bool:
    return isinstance(value, list | tuple) and bool(value) and all(isinstance(v, Mapping) for v in value)


def _table(doc: Mapping, path: list[str], out: list[str]) -> None:
    """Scalars first, then sub-tables and arrays of tables (a header ends the table it follows)."""
    prefix = "".join(f"{p}." for p in path)
    for k, v in doc.items():
        if v is not None and not isinstance(v, Mapping) and not _is_table_array(v):
            out.append(f"{_key(k)} = {_value(v, prefix + k)}")
    for k, v in doc.items():
        name = [*path, _key(k)]
        if isinstance(v, Mapping):
            out.append(f"\n[{'.'.join(name)}]")
            _table(v, name, out)
        elif _is_table_array(v):
            for item in v:
                out.append(f"\n[[{'.'.join(name)}]]")
                _table(item, name, out)


def dumps(doc: Mapping) -> str:
    """`doc` as TOML; None values are left out (TOML has no null: a missing key takes its default)."""
    out: list[str] = []
    _table(doc, [], out)
    return "\n".join(out).lstrip("\n") + "\n"


def job_doc(job: JobConfig) -> dict:
    """A validated job as the dict its file holds (every key, defaults included)."""
    return job.model_dump(mode="json", exclude_none=True)


def job_text(job: JobConfig | Mapping, *, header: str = "", source: str = "<job>") -> str:
    """`job` (a `JobConfig`, or a dict validated through one here: a bad key raises ConfigError naming it and
    `source`) as the TOML text of its file; `header` is a comment put above it."""
    doc = job_doc(job) if isinstance(job, JobConfig) else dict(job)
    if not isinstance(job, JobConfig):
        parse_job(doc, source)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comment + dumps(doc)


def write_job_file(path: str | os.PathLike, job: JobConfig | Mapping, *, header: str = "") -> Path:
    """`job_text` written to `path`."""
    path = Path(path)
    path.write_text(job_text(job, header=header, source=str(path)))
    return path
