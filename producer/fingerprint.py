"""What defines a node's batch plan, and the check that a rerun trains the plan its run folder started.

The plan (producer/plan.py) is a pure function of the data file's records, the tokenizer and its chat
template (which give every sample's tokens and length), max_length, tokens_per_batch, length_group_window,
the seed, the node's shard and the held-out records it leaves out (data.validation). The producer records this fingerprint in its plan record (common/accounting.py)
and, at every start, compares it with the run's previous plan records of the same node: resuming a changed
plan at the old cursor would train some samples twice and others never, so a difference is refused before
anything trains, naming what changed and how to go on.

`epochs` is not part of it: the plan of epoch e does not depend on the number of epochs, so raising it
appends epochs to a plan whose trained epochs stay as they were (and lowering it ends the plan earlier).

The data file is hashed whole (xxh3-128, streamed): 1.1-1.6 GB/s measured on the test machine, 0.06-0.2 % of
indexing the same file (rendering and tokenizing it, 0.4-0.7 MB/s), and sound where size + mtime + a sample
of byte ranges is not (a shuffle or an edit of equal length keeps the size, and mtime changes on a mere copy).

A data lineage (`data.lineage`) is a named plan of one run folder: a new name starts a new plan from the
drafters' current weights (fresh cursor; the audit checks each lineage on its own); a finished or
abandoned lineage is never resumed again, so the names of a run folder form a sequence.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

from producer.records import DataError

FINGERPRINT_VERSION = 1
# what AutoTokenizer reads from a model folder; the chat template lives in one of the last three
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "special_tokens_map.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
# how each compared key reads in a message
KEY_NAMES = {
    "data_bytes": "the data file's size (data.path)",
    "data_xxh3_128": "the data file's content (data.path)",
    "format": "data.format",
    "tokenizer": "the tokenizer or its chat template (data.tokenizer, or the target's folder)",
    "chat_template_kwargs": "data.chat_template_kwargs",
    "max_length": "data.max_length",
    "tokens_per_batch": "data.tokens_per_batch",
    "length_group_window": "data.length_group_window",
    "seed": "job.seed",
    "shard": "the node's data shard [index, count] (--node-rank, --nnodes, data.shard_by_node)",
    "samples": "the number of usable samples",
    "lengths": "the samples' token lengths",
    "validation": "the held-out records (data.validation)",
}


class PlanChanged(DataError):
    """A rerun whose batch plan is not its run folder's: the message names what changed and how to go on."""


def file_digest(path: str | Path, chunk: int = 8 << 20) -> str:
    """xxh3-128 of a whole file, streamed (constant memory)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tokenizer_digest(folder: str | Path) -> str:
    """xxh3-128 over the tokenizer files present in `folder` (name and content of each)."""
    h = xxhash.xxh3_128()
    for name in TOKENIZER_FILES:
        path = Path(folder) / name
        if path.is_file():
            h.update(f"{name}\0{path.stat().st_size}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def lengths_digest(lengths: Sequence[int]) -> str:
    """A digest of the per-sample token lengths in sample order (what the plan is computed from)."""
    return hashlib.sha256(np.asarray(lengths, dtype=np.int64).tobytes()).hexdigest()


def plan_fingerprint(
    *,
    data_path: str | Path,
    data_format: str,
    tokenizer_dir: str | Path,
    chat_template_kwargs: dict,
    max_length: int,
    tokens_per_batch: int,
    length_group_window: int,
    seed: int,
    shard: tuple[int, int],
    lengths: Sequence[int],
    data_files: Sequence[Path] | None = None,
    validation: dict | None = None,
) -> dict:
    """Every input of the node's plan except `epochs`, as a JSON-able dict of compared keys.

    `data_files` are the files `data_path` reads (a hub dataset's split shards, in order); default: the path.
    `validation`: the held-out records the plan excludes (producer/validation.py `HeldOut.fingerprint`); None
    without data.validation, which is also how a fingerprint written before the key reads."""
    files = [Path(f) for f in data_files] if data_files else [Path(data_path)]
    digests = [file_digest(f) for f in files]
    return {
        "version": FINGERPRINT_VERSION,
        # named in messages; a moved file with equal content is equal
        "data_path": str(Path(data_path).resolve()) if Path(data_path).exists() else str(data_path),  # or a hub id
        "data_bytes": sum(f.stat().st_size for f in files),
        "data_xxh3_128": digests[0] if len(digests) == 1 else xxhash.xxh3_128("".join(digests).encode()).hexdigest(),
        "format": data_format,
        "tokenizer": tokenizer_digest(tokenizer_dir),
        "chat_template_kwargs": dict(sorted(chat_template_kwargs.items())),
        "max_length": max_length,
        "tokens_per_batch": tokens_per_batch,
        "length_group_window": length_group_window,
        "seed": seed,
        "shard": list(shard),
        "samples": len(lengths),
        "lengths": lengths_digest(lengths),
        "validation": validation,
    }


def changes(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints, one phrase per key ("data.max_length: 256 → 128")."""
    out = []
    for key, name in KEY_NAMES.items():
        if old.get(key) != new.get(key):
            was, now = old.get(key), new.get(key)
            if key == "validation":  # a dict: its short form
                was, now = _describe_validation(was), _describe_validation(now)
            elif key in ("data_xxh3_128", "tokenizer", "lengths"):
                was, now = str(was)[:12], str(now)[:12]  # a digest: its head is enough to tell them apart
            out.append(f"{name}: {was} → {now}")
    return out


def _describe_validation(v: dict | None) -> str:
    if not v:
        return "none"
    return f"a {v.get('fraction')} split ({v.get('records')} records, {str(v.get('digest'))[:12]})"


def check_plan(previous: list[dict], lineage: str, fingerprint: dict, epochs: int, run_dir: str | Path) -> str:
    """Whether a producer may start lineage `lineage` with `fingerprint` in a run folder whose producers of this
    node logged the plan records `previous` (oldest first). Returns what the start is (a log line); raises
    PlanChanged with one line naming the change and the ways on."""
    if not previous:
        return f"data lineage {lineage!r}: a new plan of {epochs} epoch(s)"
    order = list(dict.fromkeys(r.get("lineage", "main") for r in previous))
    last = previous[-1]
    if lineage != order[-1]:
        if lineage in order:
            raise PlanChanged(
                f'data.lineage = "{lineage}" was followed by "{order[order.index(lineage) + 1]}" in {run_dir}: a'
                f" lineage is never resumed once another started (its cursor is gone); set data.lineage ="
                f' "{order[-1]}" to go on with the current one, or a new name to start another'
            )
        return (
            f"data lineage {lineage!r} starts a new plan of {epochs} epoch(s) from the drafters' current weights"
            f" (after {', '.join(repr(n) for n in order)})"
        )
    old = last.get("fingerprint")
    if old is None:  # written before plans had fingerprints: nothing to compare, the first one is recorded now
        return f"data lineage {lineage!r}: the run's earlier plan records carry no fingerprint; recording one now"
    if old.get("version") != fingerprint["version"]:
        return f"data lineage {lineage!r}: fingerprint version {old.get('version')} → {fingerprint['version']}"
    diff = changes(old, fingerprint)
    if diff:
        nxt = next_lineage_name(order)
        raise PlanChanged(
            f"the batch plan of {run_dir} changed since its last start ({'; '.join(diff)};"
            f" data file {fingerprint['data_path']}): resuming would train the new plan from the old cursor,"
            f" some samples twice and others never. Refused; nothing was trained. To go on: restore what changed,"
            f" or start a new run folder (job.run_dir), or keep the drafters' weights and start a new data lineage"
            f' with data.lineage = "{nxt}" in the job file'
        )
    was = len(last.get("epochs", ()))
    if epochs > was:
        return f"data lineage {lineage!r}: epochs raised {was} → {epochs}; the trained epochs stay, {epochs - was} appended"
    if epochs < was:
        return (
            f"data lineage {lineage!r}: epochs lowered {was} → {epochs}; the plan now ends after epoch"
            f" {epochs - 1}, and a drafter already past it has nothing left to train"
        )
    return f"data lineage {lineage!r}: the plan matches the run's ({epochs} epoch(s))"


def next_lineage_name(used: Sequence[str]) -> str:
    """A lineage name not in `used`: "2", "3", ... (the first lineage is "main" by default)."""
    n = 2
    while str(n) in used:
        n += 1
    return str(n)
