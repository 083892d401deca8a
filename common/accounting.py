"""The job log that proves exactly-once training: what the producer delivered, what each drafter's
checkpoints hold. `common/accounting_check.py` reads it back and checks it.

    <run_dir>/accounting/<role>-<name>-<pid>-<token>.jsonl     one file per process incarnation

Records (JSON objects, one a line, every one with "kind" and "t" = time.time()):
    producer  plan        node, lineage, total_batches, epochs [{epoch, first_seq, batches}], samples, digest,
                          fingerprint (producer/fingerprint.py: every input of the plan but epochs)
              batch       node, lineage, seq, epoch, samples [ids], to [[drafter, replica, session], ...]
              validation  node, lineage, pass, index, samples [ids], to (one batch of an evaluation pass)
    consumer  start       drafter, rank, world, base (id of the checkpoint resumed from, or null), base_step,
                          lineage
              step        drafter, rank, step, seqs (this replica's batches in that optimizer step)
              checkpoint  drafter, id, parent, step, lineage, trained {node: [seqs]}, producers, cursors,
                          trained_above
              saved       drafter, id (or null on a replica that does not write), step
              evaluation  drafter, rank, lineage, pass, step, samples [ids evaluated], tau (one whole pass)
              end         drafter, rank, reason, status, step, finished (the process ends; finished: every
                          replica's stream ended on "data exhausted", the whole plan delivered to the group)
The plan record's "validation" (null without data.validation) describes the held-out records
(producer/validation.py `HeldOut.plan_record`): source, the held-out ids of a split, one pass's sample count
and digest. They are never in a batch record; the checker audits the passes on their own.
A record without "lineage" (written before data lineages) belongs to lineage "main".

Data lineages (`data.lineage`): a lineage is one batch plan of the run folder, its seqs counted from 0. A
new lineage starts from the drafters' current weights with a fresh cursor; a checkpoint record names its
lineage, the checkpoint carries the lineages its chain went through, and the checker audits each lineage of
the chain against its own plan and deliveries. A lineage is never resumed after another started.

The chain: every checkpoint record names its parent (the previous successful save of this process, or the
checkpoint it resumed from) and carries the seqs the replica group trained since that parent, repeats
included, and the group cursor: one entry per node and producer (target replica p of R makes the node's
seqs ≡ p mod R), flat at index node × producers + producer; a record without "producers" is per node (R = 1).
The checkpoint itself carries its record's id in trainer_state.pt ("ledger": {"id": ...}), written
atomically with it, so the checker starts from what `latest` really points at. The record is written before
the checkpoint is written: a process killed between the two leaves a record that no checkpoint names.

What this proves, and what it does not claim: batches a consumer trained after its last checkpoint are lost
with it when it crashes (its weights die with the process) and are trained again by the incarnation that
resumes from that checkpoint. So "exactly once" holds *in the lineage of the final checkpoint*: walking the
chain from it back to a fresh start, every seq appears once, and the seqs of each epoch hold every sample of
that epoch once. The step records show the work lost in crashes; the checker reports it and shows that each
such seq was trained again, once, in the lineage.

When a record is durable: every record is one os.write (O_APPEND) as it is made, so a process killed at
any moment (SIGKILL included) leaves every record it made in the page cache; a torn last line is the only
loss. A full disk can tear a record too: the log then closes, so the torn record stays its file's last.
Readers (`read_job_log`: the checker; `plan_records`: a producer's start) skip a torn last record and say
so; a line that is no record anywhere else is damage, an error. The producer writes a batch's record
*before* it sends the BATCH: no consumer can train a batch the log does not show as delivered. (An earlier version buffered a second of
records in memory; a SIGKILLed producer took the deliveries of its last second with it, and the checker
then found their samples missing from the epoch. A machine crash can still lose what the page cache held:
the consumers' checkpoints are lost with it too, so the lineage stays consistent.)

Cost on the hot path: one dict and one os.write per batch (producer) or per step (consumer): a few µs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ACCOUNTING_DIR = "accounting"
DEFAULT_LINEAGE = "main"  # the lineage of records and checkpoints that name none


class LineageError(ValueError):
    """A job whose data.lineage its checkpoint cannot resume under (the message says why and what to set)."""


def sample_digest(sample_ids: Iterable[int]) -> str:
    """A digest of a set of sample ids (order-free): equal digests and counts mean equal sets."""
    ids = sorted(int(s) for s in sample_ids)
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


class JobLog:
    """Append-only JSON lines of one process incarnation; each record is one os.write as it is made."""

    def __init__(self, run_dir: str | Path, role: str, name: str):
        folder = Path(run_dir) / ACCOUNTING_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.incarnation = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.path = folder / f"{role}-{name}-{self.incarnation}.jsonl"
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._closed_why = ""

    def write(self, kind: str, fields: dict[str, Any]) -> None:
        """Append one record; it survives a kill of this process the moment this returns.

        A write that fails (a full disk) may leave its record torn mid-line; the log is closed then, so the
        torn record stays the file's last, which readers accept (`read_job_log`), and every later write raises
        OSError rather than append after it."""
        if self._fd is None:
            raise OSError(f"{self.path}: the job log is closed ({self._closed_why})")
        data = (json.dumps({"kind": kind, "t": time.time(), **fields}, separators=(",", ":")) + "\n").encode()
        try:
            written = os.write(self._fd, data)
            if written != len(data):  # a short append (disk full mid-write): finish it or raise
                os.write(self._fd, data[written:])
        except OSError as err:
            self.close(f"a write failed: {err.strerror or err}")
            raise

    def close(self, why: str = "closed by its process") -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._closed_why = why


def read_job_log(path: Path) -> tuple[list[dict], bool]:
    """(the records of one job-log file, whether its last record is torn). A torn record is a last line without
    its newline that is no JSON object (a kill or a full disk cut its one write short): it is skipped and every
    complete record before it is kept. Any other line that is no JSON object is damage: ValueError naming it."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with its last record's newline
    records = []
    for i, line in enumerate(lines, 1):
        rec = _record(line)
        if rec is None:
            raise ValueError(f"{path}:{i}: not a JSON record: {line[:120]!r}")
        records.append(rec)
    if not tail:
        return records, False
    rec = _record(tail)
    if rec is None:
        return records, True
    records.append(rec)  # a whole record whose newline alone is missing
    return records, False


def _record(line: bytes) -> dict | None:
    try:
        rec = json.loads(line)
    except ValueError:  # UnicodeDecodeError included
        return None
    return rec if isinstance(rec, dict) else None


class DeliveryLedger:
    """The producer's log: its plan once, then every batch with the sessions it went to."""

    def __init__(
        self,
        run_dir: str | Path,
        node: int,
        total_batches: int,
        epoch_batches: Sequence[int],
        sample_ids: Iterable[int],
        *,
        lineage: str = DEFAULT_LINEAGE,
        fingerprint: dict | None = None,
        validation: dict | None = None,
    ):
        """`epoch_batches[e]`: batches in epoch e; `sample_ids`: this node's shard (the same every epoch);
        `lineage`, `fingerprint`: the data lineage and what defines its plan (producer/fingerprint.py);
        `validation`: the held-out records (None: no data.validation)."""
        self.node = node
        self.lineage = lineage
        ids = list(sample_ids)
        epochs, first = [], 0
        for e, n in enumerate(epoch_batches):
            epochs.append({"epoch": e, "first_seq": first, "batches": int(n)})
            first += int(n)
        if first != total_batches:
            raise ValueError(f"the epochs hold {first} batches, the plan says {total_batches}")
        self.log = JobLog(run_dir, "producer", f"n{node}")
        self.log.write(
            "plan",
            {
                "node": node,
                "lineage": lineage,
                "total_batches": total_batches,
                "epochs": epochs,
                "samples": len(ids),
                "digest": sample_digest(ids),
                "fingerprint": fingerprint,
                "validation": validation,
            },
        )

    def delivered(self, seq: int, epoch: int, sample_ids: Iterable[int], to: Iterable[tuple[str, int, int]]) -> None:
        self.log.write(
            "batch",
            {
                "node": self.node,
                "lineage": self.lineage,
                "seq": seq,
                "epoch": epoch,
                "samples": [int(s) for s in sample_ids],
                "to": [list(m) for m in to],
            },
        )

    def validated(self, pass_: int, index: int, sample_ids: Iterable[int], to: Iterable[tuple[str, int, int]]) -> None:
        """Batch `index` of evaluation pass `pass_`, before it is sent (as `delivered`)."""
        self.log.write(
            "validation",
            {
                "node": self.node,
                "lineage": self.lineage,
                "pass": pass_,
                "index": index,
                "samples": [int(s) for s in sample_ids],
                "to": [list(m) for m in to],
            },
        )

    def close(self) -> None:
        self.log.close()


def plan_records(run_dir: str | Path, node: int) -> list[dict]:
    """The plan records this node's producer incarnations logged in `run_dir` (each file's first line), oldest
    first. A file whose last record is torn (a kill or a full disk) is said in one line; one without a whole
    first line (its plan record torn) holds nothing else and is skipped."""
    found = []
    for path in (Path(run_dir) / ACCOUNTING_DIR).glob(f"producer-n{node}-*.jsonl"):
        with open(path, "rb") as f:
            first = f.readline()
            f.seek(0, os.SEEK_END)
            torn = f.tell() > 0 and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n"
        rec = _record(first) if first.endswith(b"\n") else None
        if torn:
            log.warning(
                "%s: its last record is torn (cut mid-line by a kill or a full disk); %s",
                path,
                "the complete records before it stand" if rec is not None else "it held no whole record: skipped",
            )
        if rec is not None and rec.get("kind") == "plan" and rec.get("node") == node:
            found.append(rec)
    return sorted(found, key=lambda r: r["t"])


def per_node(flat: Sequence[Any], producers: int) -> list[tuple[Any, ...]]:
    """A flat per-(node, producer) list (entry node × producers + producer: a checkpoint record's cursors and
    trained_above, and a checkpoint's "group") split into one tuple per node."""
    return [tuple(flat[n * producers : (n + 1) * producers]) for n in range(len(flat) // producers)]


def ledger_id_of(state: dict | None) -> str | None:
    """The ledger record id a checkpoint's trainer state carries (None: fresh start or an older checkpoint)."""
    entry = (state or {}).get("ledger")
    return entry.get("id") if isinstance(entry, dict) else None


def resume_lineage(state: dict | None, lineage: str, source: str = "the checkpoint") -> tuple[list[str], bool]:
    """(the lineages of a run resumed from `state` under data.lineage = `lineage`, whether it continues the
    checkpoint's cursor). False: a new lineage, trained from the checkpoint's weights with a fresh cursor.
    A lineage the checkpoint's chain left for another: LineageError."""
    if state is None:
        return [lineage], True
    entry = state.get("ledger")
    history = list(entry.get("lineages") or [DEFAULT_LINEAGE]) if isinstance(entry, dict) else [DEFAULT_LINEAGE]
    if history[-1] == lineage:
        return history, True
    if lineage in history:
        raise LineageError(
            f"{source} trained data lineage {lineage!r} and then {history[history.index(lineage) + 1]!r}:"
            f' a lineage is never resumed once another started; set data.lineage = "{history[-1]}"'
            " to go on, or a new name to start another"
        )
    return [*history, lineage], False


class TrainLedger:
    """A consumer's log: its steps, and for the writing replica the chain of checkpoints.

    The service calls `stepped` after each optimizer step, `checkpoint` for the entry the checkpoint carries
    (writer only) and `saved` once the save returned (every replica). A save that raised is not `saved`: its seqs
    stay pending and go into the next checkpoint record, whose parent stays the last successful one.
    """

    def __init__(
        self,
        run_dir: str | Path,
        drafter: str,
        rank: int,
        world_size: int,
        *,
        base: str | None,
        base_step: int,
        resumed_from: str | None = None,
        lineages: Sequence[str] = (DEFAULT_LINEAGE,),
    ):
        """`base`: ledger id of the checkpoint resumed from (None for a fresh start); `resumed_from`: its path
        (named in the log when a checkpoint older than the ledger carries no id); `lineages`: the data lineages
        of the chain, the last one this run's (resume_lineage)."""
        self.drafter = drafter
        self.rank = rank
        self.lineages = list(lineages)
        self.lineage = self.lineages[-1]
        self.log = JobLog(run_dir, "consumer", f"{drafter}-r{rank}")
        if base is None and resumed_from is not None:
            base = f"unaccounted:{resumed_from}"
        self.parent = base
        self._pending: dict[int, list[int]] = {}
        self._count = 0
        self._attempt: str | None = None
        self.log.write(
            "start",
            {
                "drafter": drafter,
                "rank": rank,
                "world": world_size,
                "base": base,
                "base_step": base_step,
                "pid": os.getpid(),
                "lineage": self.lineage,
            },
        )

    def stepped(self, step: int, seqs: Sequence[int]) -> None:
        self.log.write("step", {"drafter": self.drafter, "rank": self.rank, "step": step, "seqs": list(seqs)})

    def checkpoint(
        self,
        step: int,
        trained: dict[int, list[int]],
        cursors: Sequence[int],
        trained_above: Sequence[Sequence[int]],
        *,
        producers: int = 1,
    ) -> dict:
        """Log the checkpoint of `step` about to be written; returns its "ledger" entry ({id, lineages}), which
        the checkpoint carries in trainer_state.pt (atomic with it).

        `trained`: every seq the group trained since the previous checkpoint, per node, repeats included.
        `cursors`, `trained_above`: the group cursor after it, per node and producer (flat, see above)."""
        for node, seqs in trained.items():
            self._pending.setdefault(int(node), []).extend(int(s) for s in seqs)
        self._count += 1
        record_id = f"{self.drafter}:{self.log.incarnation}:{step}:{self._count}"
        self.log.write(
            "checkpoint",
            {
                "drafter": self.drafter,
                "id": record_id,
                "parent": self.parent,
                "step": int(step),
                "lineage": self.lineage,
                "trained": {str(n): s for n, s in sorted(self._pending.items())},
                "producers": producers,
                "cursors": [int(c) for c in cursors],
                "trained_above": [[int(s) for s in a] for a in trained_above],
            },
        )
        self._attempt = record_id
        return {"id": record_id, "lineages": list(self.lineages)}

    def evaluated(self, pass_: int, step: int, sample_ids: Iterable[int], tau: float) -> None:
        """One whole evaluation pass at optimizer step `step`: the samples it evaluated and its held-out τ."""
        self.log.write(
            "evaluation",
            {
                "drafter": self.drafter,
                "rank": self.rank,
                "lineage": self.lineage,
                "pass": pass_,
                "step": step,
                "samples": [int(s) for s in sample_ids],
                "tau": tau,
            },
        )

    def saved(self, step: int) -> None:
        """The save returned: its record becomes the parent of the next one."""
        if self._attempt is not None:
            self.parent, self._attempt, self._pending = self._attempt, None, {}
        self.log.write("saved", {"drafter": self.drafter, "rank": self.rank, "id": self.parent, "step": step})

    def ended(self, reason: str, status: int, step: int, *, finished: bool) -> None:
        """The process ends with exit `status` for `reason`; `finished`: the whole plan was delivered to the
        group (the checker then wants every batch of it trained)."""
        self.log.write(
            "end",
            {
                "drafter": self.drafter,
                "rank": self.rank,
                "reason": reason,
                "status": status,
                "step": step,
                "finished": finished,
            },
        )

    def close(self) -> None:
        self.log.close()
