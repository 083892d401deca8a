"""Start-up progress: a process that is loading, compiling or on its first batch says so, and stays live.

A job's first minutes can pass without a single training step (a large target loading, kernels compiling,
a first batch with many anchors on a CPU). During such a phase a `StartupBeat` thread publishes a stats
snapshot every interval with the gauge `phase` = PHASES[name], and logs the phase when it starts, every
`log_every_s` while it lasts, and when it ends: telemetry sees a live process in that phase (`dflash-stats`
shows the phase in its state column), never a stale or silent one. After the last phase the gauge is 0.

Thread safety: StatsPublisher is not thread-safe, so the beat thread publishes only inside `phase()`, and the
process publishes only outside it (the main thread never publishes during a phase; `phase()` joins the
thread before it returns). A snapshot that races a new ProfileStats key is skipped, not fatal.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

PHASES = {"running": 0, "loading": 1, "compiling": 2, "first batch": 3}  # the `phase` gauge's values
PHASE_NAMES = {v: k for k, v in PHASES.items()}


class StartupBeat:
    """Heartbeats with a phase gauge while a start-up phase runs; `stats` None (stats off) only logs."""

    def __init__(self, stats, log: logging.Logger, who: str, log_every_s: float = 30.0) -> None:
        self.stats, self.log, self.who, self.log_every_s = stats, log, who, log_every_s

    @contextlib.contextmanager
    def phase(self, name: str, what: str = "") -> Iterator[None]:
        code = PHASES[name]
        self.log.info("%s: %s%s", self.who, name, f" ({what})" if what else "")
        done = threading.Event()
        t0 = time.monotonic()
        thread = threading.Thread(target=self._beat, args=(name, code, done, t0), name=f"startup-{name}",
                                  daemon=True)  # fmt: skip
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=30.0)  # the beat wakes on `done` at once; publishing never blocks
            self.log.info("%s: %s done in %.1f s", self.who, name, time.monotonic() - t0)

    def running(self, step: int | None = None) -> None:
        """The start-up is over: one snapshot with phase 0 (called outside any phase, by the publishing thread)."""
        if self.stats:
            self.stats.publish(step, extra_gauges={"phase": PHASES["running"]})

    def _beat(self, name: str, code: int, done: threading.Event, t0: float) -> None:
        interval = self.stats.interval_s if self.stats else self.log_every_s
        next_log = t0 + self.log_every_s
        while True:
            if self.stats:
                try:
                    self.stats.publish(extra_gauges={"phase": code})
                except RuntimeError:  # the main thread added a ProfileStats key mid-snapshot: skip this beat
                    pass
            if done.wait(interval):
                return
            if time.monotonic() >= next_log:
                self.log.info("%s: still %s (%.0f s)", self.who, name, time.monotonic() - t0)
                next_log += self.log_every_s
