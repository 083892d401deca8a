"""`checkpoints/<drafter>/best`: the checkpoint with the highest held-out τ, next to `latest`.

    <ckpt_root>/best -> step_<N>    a relative symlink, loadable as `latest` is (common/checkpoint_pointer.py)
    <ckpt_root>/best.json           {"checkpoint": "step_<N>", "step", "tau", "loss", "pass"}, replaced atomically

Rule: a pass replaces the best only when its τ (tau_est on the held-out records) is strictly greater; a tie
keeps the earlier checkpoint (fewer steps, same quality), a NaN never counts. best.json is written first
and is the record: the pointer follows it, and a pointer a crash left behind is repointed at start. Resume
reads best.json, so a worse pass after a restart does not replace the best. Pruning (consumer/checkpoint.py)
never deletes the directory `best` points at.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from common.checkpoint_pointer import BEST, read_pointer, write_pointer

log = logging.getLogger(__name__)

RECORD = "best.json"


@dataclass(frozen=True)
class Best:
    checkpoint: str  # "step_<N>", a sibling of best.json
    step: int
    tau: float
    loss: float
    pass_: int


def improves(tau: float, best: Best | None) -> bool:
    """Whether a pass of held-out `tau` replaces `best` (strictly greater; NaN never)."""
    if not isinstance(tau, (int, float)) or math.isnan(tau):
        return False
    return best is None or tau > best.tau


class BestCheckpoint:
    """The best-so-far record of one drafter's checkpoint folder (read at start, so a resume keeps it)."""

    def __init__(self, ckpt_root: str | Path):
        self.root = Path(ckpt_root)
        self.best = self._read()
        if self.best is not None and read_pointer(self.root, BEST) != self.best.checkpoint:
            if (self.root / self.best.checkpoint).is_dir():  # a crash between the record and the pointer
                write_pointer(self.root, self.best.checkpoint, BEST)
            else:
                log.warning(
                    "%s names %s, which is gone; the best τ %.3f stays the value to beat",
                    self.root / RECORD,
                    self.best.checkpoint,
                    self.best.tau,
                )

    def _read(self) -> Best | None:
        path = self.root / RECORD
        if not path.is_file():
            return None
        try:
            doc = json.loads(path.read_text())
            return Best(
                str(doc["checkpoint"]), int(doc["step"]), float(doc["tau"]), float(doc["loss"]), int(doc["pass"])
            )
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("%s is unreadable (%s): starting without a best checkpoint", path, err)
            return None

    def improves(self, tau: float) -> bool:
        return improves(tau, self.best)

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
