"""`checkpoints/<drafter>/best`: the checkpoint with the highest held-out τ, next to `latest`.

    <ckpt_root>/best -> step_<N>    a relative symlink, loadable as `latest` is (common/checkpoint_pointer.py)
    <ckpt_root>/best.json           {"checkpoint": "step_<N>", "step", "tau", "loss", "pass"}, replaced atomically

Rule: a pass replaces the best only when its τ (tau_est on the held-out records) is strictly greater; a tie
keeps the earlier checkpoint (fewer steps, same quality), a NaN never counts. In a group of replicas one
replica evaluates the pass and global rank 0 alone holds this record and writes, so the decision is taken
from one all-gather of small rows (`vote_row`, `decide`): every replica sees the same rows and decides
alike, and the save it may need is the group's collective checkpoint. best.json is written first
and is the record: the pointer follows it, and a pointer a crash left behind is repointed at start. Resume
reads best.json, so a worse pass after a restart does not replace the best. Pruning (consumer/checkpoint.py)
never deletes the directory `best` points at.

At resume `settle_best` checks the best checkpoint as `latest` is checked. One that is gone (set aside as
corrupt by resume's fallback, or removed by hand) or broken (then set aside as corrupt-step_<N>) is no best:
best.json and the pointer are removed, with a line naming it, its τ and why, and the next whole pass sets a
new best. (No other checkpoint's held-out τ is known, so none can be named best in its place.)
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from common.checkpoint_pointer import BEST, read_pointer, write_pointer
from consumer.checkpoint import CORRUPT_PREFIX, CheckpointCorrupt, check_checkpoint, set_aside

log = logging.getLogger(__name__)

RECORD = "best.json"


@dataclass(frozen=True)
class Best:
    checkpoint: str  # "step_<N>", a sibling of best.json
    step: int
    tau: float
    loss: float
    pass_: int


def beats(tau: float, best_tau: float) -> bool:
    """Whether held-out `tau` replaces a best of `best_tau` (NaN: none yet): strictly greater; a NaN τ never."""
    if not isinstance(tau, (int, float)) or math.isnan(tau):
        return False
    return math.isnan(best_tau) or tau > best_tau


@dataclass(frozen=True)
class Candidate:
    """A whole pass's figures, as the replica that evaluated it shares them with the group."""

    pass_: int
    step: int  # the optimizer step whose weights were evaluated
    tau: float
    loss: float


# one replica's row of the all-gather: its pass (if it just completed one) and, from the writer, the record
ROW = ("has_pass", "pass", "step", "tau", "loss", "best_tau", "step_saved")


def vote_row(candidate: Candidate | None, best: Best | None, step_saved: bool) -> list[float]:
    """This replica's row: `candidate` (None: it evaluated no whole pass this round); `best` and `step_saved`
    (the current step's checkpoint is on disk) count from the writer only, the one that holds the record."""
    pass_ = [1.0, candidate.pass_, candidate.step, candidate.tau, candidate.loss] if candidate else [0.0] * 5
    return [*pass_, best.tau if best is not None else math.nan, float(step_saved)]


def decide(rows: list[list[float]]) -> tuple[Candidate, bool] | None:
    """From the all-gather's rows (rank order, row 0 the writer's): the pass that becomes the best and
    whether its step must be saved first, or None. The latest pass if several replicas hold one; step 0
    (untrained weights) never counts."""
    held = [r for r in rows if r[0] == 1.0]
    if not held:
        return None
    r = max(held, key=lambda r: r[1])  # the first of the latest pass: max keeps the first maximum
    candidate = Candidate(int(r[1]), int(r[2]), float(r[3]), float(r[4]))
    writer = rows[0]
    if candidate.step == 0 or not beats(candidate.tau, writer[5]):
        return None
    return candidate, writer[6] != 1.0


def settle_best(ckpt_root: str | Path, resumed: Path | None) -> None:
    """On the writer at resume, after `latest` was settled (`resumed`: the checkpoint resumed from, checked
    already): `best` names an intact checkpoint afterwards, or there is no `best` and a line says why."""
    root = Path(ckpt_root)
    best = _read_record(root)
    name = best.checkpoint if best is not None else read_pointer(root, BEST)
    if name is None or (resumed is not None and name == resumed.name):
        return
    path = root / name
    if not path.is_dir():
        fault = "it is gone" + (
            f" (set aside as {CORRUPT_PREFIX}{name})" if (root / f"{CORRUPT_PREFIX}{name}").is_dir() else ""
        )
    else:
        try:
            check_checkpoint(path)
            return
        except CheckpointCorrupt as err:
            fault = f"{err}; set aside as {set_aside(path).name}"
    for stale in (root / BEST, root / RECORD):
        if stale.is_symlink() or stale.exists():
            stale.unlink()
    figures = f", held-out τ {best.tau:.3f} at step {best.step}" if best is not None else ""
    log.warning(
        "the best checkpoint %s%s is not usable: %s. `best` and %s removed: the next whole held-out pass sets a new best",
        path,
        figures,
        fault,
        RECORD,
    )


def _read_record(root: Path) -> Best | None:
    """best.json's record; None when there is none, or (said in a line) it is unreadable."""
    path = root / RECORD
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        return Best(str(doc["checkpoint"]), int(doc["step"]), float(doc["tau"]), float(doc["loss"]), int(doc["pass"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("%s is unreadable (%s): starting without a best checkpoint", path, err)
        return None


class BestCheckpoint:
    """The best-so-far record of one drafter's checkpoint folder (read at start, so a resume keeps it)."""

    def __init__(self, ckpt_root: str | Path):
        self.root = Path(ckpt_root)
        self.best = _read_record(self.root)
        if self.best is None or read_pointer(self.root, BEST) == self.best.checkpoint:
            return
        if (self.root / self.best.checkpoint).is_dir():  # a crash between the record and the pointer
            write_pointer(self.root, self.best.checkpoint, BEST)
        else:  # settle_best removes such a record at resume; without it, none of it is trusted
            log.warning(
                "%s names %s, which is gone: starting without a best checkpoint",
                self.root / RECORD,
                self.best.checkpoint,
            )
            self.best = None

    def record(self, checkpoint: str, step: int, tau: float, loss: float, pass_: int) -> Best:
        """Make `checkpoint` (a saved step_<N> directory) the best: best.json, then the pointer."""
        best = Best(checkpoint, step, float(tau), float(loss), pass_)
        doc = {**asdict(best), "pass": best.pass_}
        del doc["pass_"]
        tmp = self.root / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(doc) + "\n")
        os.replace(tmp, self.root / RECORD)
        write_pointer(self.root, checkpoint, BEST)  # fsyncs the folder: the record's rename too
        self.best = best
        return best
