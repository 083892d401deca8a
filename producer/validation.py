"""The held-out records (data.validation) and their evaluation passes (data.eval_every): which records are
never trained on, what one pass holds, and when a pass is due.

A fraction f of the data is a seeded split by record: round(f · usable records) sample ids (at least one,
never all) drawn from (job.seed, a stream of their own), so the same data and seed always hold out the same
records; the training plan (producer/plan.py) excludes them and the plan fingerprint records them, so a
resume under another split is refused like any data change. A path is a record file in the training data's
format, tokenized with the same chat template. One pass evaluates at most data.validation_max_records of
them (a seeded subset, the same every pass, so the curve compares like with like), packed under
data.tokens_per_batch longest first: the same batches every pass.

The schedule counts training batches, not optimizer steps, because the producer knows the one and not the
other: pass k (k = 1, 2, ...) is due for a drafter once its cursor at this producer reaches
min(k · eval_every, the plan's batches) (it was sent every training seq below), so the end of the data has
a pass too; a group that (re)forms counts the passes due below its resume point as had, and has the one due
at it again (it may not have been evaluated: a consumer that stalled or restarted right after it). With tokens_per_step
= 0 (one batch a step) pass k follows step k · eval_every exactly. Only producer 0 of node 0 runs passes (its node's
drafters see all of them; other producers send none).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from common.accounting import sample_digest
from common.packed_batch import PackedBatch
from producer.data import ChatDataset, ChatEncoder, DataError, RecordLimits
from producer.fingerprint import file_digest
from producer.plan import PlannedBatch
from producer.prefetch import pack_batch

log = logging.getLogger("producer")

VALIDATION_STREAM = 0x7A1D  # the split's random stream, apart from the shard's and the epochs'


def split_held_out(num_samples: int, fraction: float, seed: int) -> np.ndarray:
    """The held-out sample ids (sorted) of a split by record: round(fraction · num_samples), at least 1."""
    count = max(1, round(fraction * num_samples))
    if count >= num_samples:
        raise DataError(
            f"data.validation = {fraction} of {num_samples} usable record(s) holds out {count}:"
            " nothing is left to train on; lower the fraction or add data"
        )
    perm = np.random.default_rng([seed, VALIDATION_STREAM]).permutation(num_samples)
    return np.sort(perm[:count])


def excluded_ids(validation: str | float | None, num_samples: int, seed: int) -> np.ndarray:
    """The training data's sample ids the plan leaves out: a split's held-out ids (none for a file or none)."""
    if isinstance(validation, float):
        return split_held_out(num_samples, validation, seed)
    return np.zeros(0, dtype=np.int64)


def split_fingerprint(validation: str | float | None, num_samples: int, seed: int) -> dict | None:
    """The split's part of the plan fingerprint (producer/fingerprint.py); None for a file or none: the plan
    does not depend on a validation file, which may change between starts (the job log records each)."""
    if not isinstance(validation, float):
        return None
    held = split_held_out(num_samples, validation, seed)
    return {"fraction": validation, "records": len(held), "digest": sample_digest(held)}


def pass_ids(held_out: Sequence[int], max_records: int, seed: int) -> np.ndarray:
    """The records one pass evaluates: all held-out ones, or a seeded subset of `max_records` (sorted)."""
    ids = np.asarray(held_out, dtype=np.int64)
    if len(ids) <= max_records:
        return np.sort(ids)
    pick = np.random.default_rng([seed, VALIDATION_STREAM, 1]).permutation(len(ids))[:max_records]
    return np.sort(ids[pick])


def pack_pass(lengths: Sequence[int], ids: Sequence[int], tokens_per_batch: int) -> list[tuple[int, ...]]:
    """`ids` packed longest first (ties by id) into batches of at most `tokens_per_batch` tokens."""
    order = sorted((int(i) for i in ids), key=lambda i: (-int(lengths[i]), i))
    batches: list[tuple[int, ...]] = []
    current: list[int] = []
    used = 0
    for i in order:
        n = int(lengths[i])
        if current and used + n > tokens_per_batch:
            batches.append(tuple(current))
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        batches.append(tuple(current))
    return batches


@dataclass(frozen=True)
class HeldOut:
    """The validation records of a job and one pass over them."""

    source: Literal["split", "file"]
    dataset: ChatDataset  # what the ids index: the training data (split) or the validation file
    held_out: np.ndarray  # every held-out id (split: what the training plan excludes)
    batches: tuple[tuple[int, ...], ...]  # one pass, in order
    eval_every: int

    @property
    def pass_samples(self) -> list[int]:
        return [i for b in self.batches for i in b]

    def plan_record(self) -> dict:
        """The job log's account of the validation set (common/accounting.py, checked by accounting_check)."""
        ids = self.pass_samples
        file = None
        if self.source == "file":
            path = self.dataset.path
            file = {"path": str(path.resolve()), "bytes": path.stat().st_size, "xxh3_128": file_digest(path)}
        return {
            "source": self.source,
            "file": file,
            "held_out": len(self.held_out),
            "held_out_digest": sample_digest(self.held_out),
            "held_out_ids": [int(i) for i in self.held_out] if self.source == "split" else None,
            "samples": len(ids),
            "digest": sample_digest(ids),
            "batches": len(self.batches),
            "eval_every": self.eval_every,
        }

    def passes_at(self, cursor: int, total_batches: int) -> int:
        """How many passes are due once a drafter's cursor reached `cursor`: pass k at min(k · eval_every,
        total_batches), so the end of the data always has one (0 when eval_every is 0)."""
        if not self.eval_every:
            return 0
        if cursor >= total_batches:
            return -(-total_batches // self.eval_every)
        return cursor // self.eval_every

    def packed(self) -> list[PackedBatch]:
        """The pass's batches, tokenized (seq and epoch are set when one is sent)."""
        reader = self.dataset.reader()
        try:
            return [pack_batch(reader, PlannedBatch(-1, 0, ids, 0)) for ids in self.batches]
        finally:
            reader.close()


def held_out_set(
    *,
    validation: str | float | None,
    eval_every: int,
    max_records: int,
    seed: int,
    tokens_per_batch: int,
    dataset: ChatDataset,
    encoder: ChatEncoder,
    limits: RecordLimits | None = None,
) -> HeldOut | None:
    """The job's held-out records (None without data.validation); a DataError names a bad file."""
    if validation is None:
        return None
    if isinstance(validation, float):
        source: Literal["split", "file"] = "split"
        held = split_held_out(len(dataset), validation, seed)
        data = dataset
    else:
        if not Path(validation).is_file():
            raise DataError(
                f"data.validation: {validation} is not a file (a record file in the training data's"
                " format, or a fraction in (0, 0.5])"
            )
        if dataset.path.exists() and Path(validation).resolve() == dataset.path.resolve():
            raise DataError(
                f"data.validation: {validation} is the training data itself; hold out part of it with a"
                " fraction (data.validation = 0.02) or name another file"
            )
        source, data = "file", ChatDataset(validation, dataset.format, encoder, limits)
        held = np.arange(len(data), dtype=np.int64)
    ids = pass_ids(held, max_records, seed)
    batches = tuple(pack_pass(data.lengths, ids, tokens_per_batch))
    return HeldOut(source, data, held, batches, eval_every)


def job_held_out(job, dataset: ChatDataset) -> HeldOut | None:
    """`held_out_set` for a job (common.config.JobConfig) whose training data is `dataset`."""
    d = job.data
    held = held_out_set(
        validation=d.validation,
        eval_every=d.eval_every,
        max_records=d.validation_max_records,
        seed=job.job.seed,
        tokens_per_batch=d.tokens_per_batch,
        dataset=dataset,
        encoder=dataset.encoder,
        limits=dataset.limits,
    )
    if held is not None:
        log.info(
            "validation: %d records held out (%s), a pass evaluates %d of them in %d batches %s",
            len(held.held_out),
            f"{d.validation} of {dataset.path}" if held.source == "split" else str(held.dataset.path),
            len(held.pass_samples),
            len(held.batches),
            f"after every {d.eval_every} training batches and at the end" if d.eval_every else "(eval_every = 0: none)",
        )
    return held
