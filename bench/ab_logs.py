"""What a drafter's consumer log says about its training cost: compute time per step, anchors and candidates
per batch (bench/recipe_ab.py adds them to its table, so an A/B that changes the anchor count shows its price).

Each periodic log line carries the window's timers (`forward 2×541.03ms`) and counter rates
(`anchors=58.82/s batches=0.5252/s`) over the window (`prof 2.2s`); summing count × mean time and rate × window
over every line gives the run's totals. Step time counts the drafter's own work (anchors, forward, backward,
optimizer), not its waits for batches, which depend on the producer and the other drafters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

WORK = ("anchors", "forward", "backward", "optimizer")
_WINDOW = re.compile(r"\| prof ([\d.]+)s \|")
_TIMER = re.compile(r"\| (\w+) (\d+)×([\d.]+)ms")
_RATE = re.compile(r" (\w+)=([\d.eE+-]+)/s")


@dataclass(frozen=True)
class DrafterCost:
    steps: int  # optimizer steps timed
    ms_per_step: float  # anchors + forward + backward + optimizer, mean per step
    anchors_per_batch: float
    candidates_per_batch: float  # candidate anchor positions (NaN: a log written before the counter)


def drafter_cost(log: Path) -> DrafterCost:
    """Totals over every periodic line of one consumer log (ValueError when it holds none)."""
    work_ms, steps, counts = 0.0, 0, {"anchors": 0.0, "candidates": 0.0, "batches": 0.0}
    for line in log.read_text(errors="replace").splitlines():
        window = _WINDOW.search(line)
        if window is None:
            continue
        for name, n, mean in _TIMER.findall(line):
            if name in WORK:
                work_ms += int(n) * float(mean)
            if name == "optimizer":
                steps += int(n)
        for name, rate in _RATE.findall(line):
            if name in counts:
                counts[name] += float(rate) * float(window.group(1))
    if steps == 0 or counts["batches"] == 0:
        raise ValueError(f"{log}: no timed optimizer step in its periodic lines")
    return DrafterCost(
        steps=steps,
        ms_per_step=work_ms / steps,
        anchors_per_batch=counts["anchors"] / counts["batches"],
        candidates_per_batch=counts["candidates"] / counts["batches"] if counts["candidates"] else float("nan"),
    )
