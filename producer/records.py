"""Record files: JSON lines, Parquet and Arrow (as the `datasets` library writes them), read as plain dicts.

Every kind is read the same two ways: `scan()` streams every record once, in order, with its number (the
1-based line of a JSONL file or row of a table: what messages and regenerated records name) and its
position (what `RecordReader.get` needs to fetch it again: a byte offset or a row index). Neither loads the
file: JSONL is read line by line, Parquet in record batches and by row group, and an Arrow file is
memory-mapped (the OS pages in what is touched), so a 10 GB file costs what the current batch costs.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

SCAN_BATCH_ROWS = 1024  # rows per record batch when streaming a table
ROW_GROUPS_CACHED = 4  # Parquet row groups a reader keeps decoded for random access
TABLE_SUFFIXES = (".parquet", ".arrow")  # every other suffix is read as JSON lines


class DataError(ValueError):
    """A dataset or tokenizer that cannot be used at all; the message names the file and the reason."""


class RecordError(ValueError):
    """One record that is skipped; `reason` is its counter key."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class RecordReader(Protocol):
    def get(self, position: int) -> dict:
        """The record at `position`; raises RecordError when it is not a usable record."""
        ...

    def close(self) -> None: ...


class RecordFile(Protocol):
    path: Path

    def scan(self) -> Iterator[tuple[int, int, dict | RecordError]]:
        """(number, position, record or the reason it is unreadable) of every record, in file order."""
        ...

    def reader(self) -> RecordReader: ...

    def count(self) -> int:
        """Records in the file (usable or not), without parsing them."""
        ...


def open_records(path: str | Path, columns: tuple[str, ...], max_record_bytes: int | None = None) -> RecordFile:
    """The reader for `path` by its suffix (.parquet, .arrow; anything else is JSON lines).

    `columns` are the fields a table record needs (others are not read); a table with none of them is an
    error. A JSONL line longer than `max_record_bytes` is never read whole: `scan()` yields RecordError
    "too_large" for it (table rows are bounded by their record batch; the caller checks their text).
    Raises DataError for a missing path, a directory, an empty file or an unreadable table.
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a directory, not a data file; name a .jsonl, .parquet or .arrow file inside it")
    if not path.is_file():
        raise DataError(f"{path}: data file does not exist")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: data file is empty")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return ParquetRecords(path, columns)
    if suffix == ".arrow":
        return ArrowRecords(path, columns)
    return JsonlRecords(path, max_record_bytes)


def json_record(raw: bytes) -> dict:
    """One JSONL line → its object; RecordError for an empty, non-UTF-8 or malformed line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RecordError("malformed", "not valid UTF-8") from None
    if not line.strip():
        raise RecordError("empty", "empty line")
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as err:
        raise RecordError("malformed", f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(rec, dict):
        raise RecordError("malformed", f"expected a JSON object, got {type(rec).__name__}")
    return rec


class JsonlRecords:
    def __init__(self, path: Path, max_record_bytes: int | None = None):
        self.path = path
        self.max_record_bytes = max_record_bytes

    def scan(self) -> Iterator[tuple[int, int, dict | RecordError]]:
        limit = self.max_record_bytes
        with self.path.open("rb") as f:
            offset = 0
            for line_no in itertools.count(1):
                raw = f.readline() if limit is None else f.readline(limit + 1)
                if not raw:
                    return
                size = len(raw)
                if limit is not None and size > limit and not raw.endswith(b"\n"):
                    del raw  # the rest of the line is skipped in chunks: memory stays at the limit
                    size += _skip_line(f)
                    yield (
                        line_no,
                        offset,
                        RecordError("too_large", f"the line has {size} bytes, over data.max_record_bytes = {limit}"),
                    )
                else:
                    try:
                        yield line_no, offset, json_record(raw)
                    except RecordError as err:
                        yield line_no, offset, err
                offset += size

    def reader(self) -> JsonlReader:
        return JsonlReader(self.path)

    def count(self) -> int:
        lines, last = 0, b"\n"
        with self.path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                lines, last = lines + chunk.count(b"\n"), chunk[-1:]
        return lines + (last != b"\n")


def _skip_line(f, chunk: int = 1 << 20) -> int:
    """Read on to the end of the current line; → the bytes read."""
    skipped = 0
    while True:
        part = f.readline(chunk)
        skipped += len(part)
        if not part or part.endswith(b"\n"):
            return skipped


class ShardedRecords:
    """Several record files read as one (the shards of a hub dataset's split), in order.

    Numbers run on across the files (1-based, as one file's would); a position packs the file's index above
    its own position (POSITION_BITS), so `RecordReader.get` finds the file again from the int alone.
    """

    POSITION_BITS = 44  # 16 TiB of one JSONL file, or 2^44 rows of one table

    def __init__(self, path: Path, files: list[RecordFile]):
        self.path = path  # what messages name: the dataset, not one shard
        self.files = files

    def scan(self) -> Iterator[tuple[int, int, dict | RecordError]]:
        base = 0
        for index, records in enumerate(self.files):
            number = 0
            for number, position, rec in records.scan():
                yield base + number, (index << self.POSITION_BITS) | position, rec
            base += number

    def reader(self) -> ShardedReader:
        return ShardedReader([f.reader() for f in self.files], self.POSITION_BITS)

    def count(self) -> int:
        return sum(f.count() for f in self.files)


class ShardedReader:
    def __init__(self, readers: list[RecordReader], bits: int):
        self.readers, self.bits = readers, bits

    def get(self, position: int) -> dict:
        return self.readers[position >> self.bits].get(position & ((1 << self.bits) - 1))

    def close(self) -> None:
        for r in self.readers:
            r.close()


class JsonlReader:
    def __init__(self, path: Path):
        self.file = path.open("rb")

    def get(self, position: int) -> dict:
        self.file.seek(position)
        return json_record(self.file.readline())

    def close(self) -> None:
        self.file.close()


def _present_columns(path: Path, names: list[str], wanted: tuple[str, ...]) -> list[str]:
    present = [c for c in wanted if c in names]
    if not present:
        raise DataError(f"{path}: the table has none of the columns {list(wanted)} (it has {names})")
    return present


class ParquetRecords:
    """A Parquet file: streamed in record batches; random access decodes (and caches) one row group."""

    def __init__(self, path: Path, columns: tuple[str, ...]):
        import pyarrow.parquet as pq

        self.path = path
        try:
            self.file = pq.ParquetFile(path)
        except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ... for a bad file
            raise DataError(f"{path}: not a readable Parquet file: {err}") from None
        self.columns = _present_columns(path, self.file.schema_arrow.names, columns)
        meta = self.file.metadata
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        self.group_starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def scan(self) -> Iterator[tuple[int, int, dict | RecordError]]:
        row = 0
        for batch in self.file.iter_batches(batch_size=SCAN_BATCH_ROWS, columns=self.columns):
            for rec in batch.to_pylist():
                yield row + 1, row, rec
                row += 1

    def reader(self) -> ParquetReader:
        return ParquetReader(self)

    def count(self) -> int:
        return self.file.metadata.num_rows


class ParquetReader:
    def __init__(self, records: ParquetRecords):
        import pyarrow.parquet as pq

        self.records = records
        self.file = pq.ParquetFile(records.path)  # its own handle: one reader per thread
        self.cache: OrderedDict[int, object] = OrderedDict()

    def get(self, position: int) -> dict:
        group = bisect.bisect_right(self.records.group_starts, position) - 1
        table = self.cache.pop(group, None)
        if table is None:
            table = self.file.read_row_group(group, columns=self.records.columns)
        self.cache[group] = table
        while len(self.cache) > ROW_GROUPS_CACHED:
            self.cache.popitem(last=False)
        return table.slice(position - self.records.group_starts[group], 1).to_pylist()[0]

    def close(self) -> None:
        self.cache.clear()
        self.file.close()


class ArrowRecords:
    """An Arrow IPC file or stream (a `datasets` cache or `save_to_disk` shard), memory-mapped."""

    def __init__(self, path: Path, columns: tuple[str, ...]):
        self.path = path
        self.table = self._map(path)
        self.columns = _present_columns(path, self.table.schema.names, columns)
        self.table = self.table.select(self.columns)

    @staticmethod
    def _map(path: Path):
        import pyarrow as pa

        source = pa.memory_map(str(path), "r")
        try:
            try:
                return pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                return pa.ipc.open_stream(source).read_all()  # zero-copy: buffers point into the map
        except Exception as err:
            raise DataError(f"{path}: not a readable Arrow file or stream: {err}") from None

    def scan(self) -> Iterator[tuple[int, int, dict | RecordError]]:
        row = 0
        for batch in self.table.to_batches(max_chunksize=SCAN_BATCH_ROWS):
            for rec in batch.to_pylist():
                yield row + 1, row, rec
                row += 1

    def reader(self) -> ArrowReader:
        return ArrowReader(self.table)

    def count(self) -> int:
        return self.table.num_rows


class ArrowReader:
    def __init__(self, table):
        self.table = table  # immutable and memory-mapped: shared by every reader

    def get(self, position: int) -> dict:
        return self.table.slice(position, 1).to_pylist()[0]

    def close(self) -> None:
        pass
