"""`python -m telemetry.progress JOB.toml`: one progress line per drafter on the launching terminal.

launch.sh starts it beside the job's processes, so `make demo` (or any launch) is not silent for the minutes of
training: step/total, loss, τ, tokens/s and ETA per drafter, as tqdm users expect. It only reads what the job
already publishes (the telemetry process's republished windows, as `dflash-stats` does) and writes nothing
but its lines: on a terminal one line rewritten in place (a part per drafter); otherwise (a pipe, a log file)
a plain line per drafter every DFLASH_PROGRESS_EVERY seconds (default 30) and at each change of state. It ends when every
drafter of the job has exited, or when its launch.sh does (common/supervisor.py's parent-death signal).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TextIO

import zmq

from common.config import ConfigError, load_job
from common.supervisor import watch_supervisor
from telemetry.cli import Receiver, dropped_note, fmt, shown_state
from telemetry.service import REPUBLISH_SOCKET
from telemetry.sinks import WINDOW_TOPIC

EVERY_ENV = "DFLASH_PROGRESS_EVERY"
RATE_SPAN_S = 120.0  # the step rate behind the ETA: over the last two minutes (a start-up stall ages out)
_REPLICA = re.compile(r"_r\d+$")


@dataclass
class Drafter:
    """What the line of one drafter shows, from the windows seen so far."""

    name: str
    total_steps: int
    state: str | None = None
    step: int | None = None
    loss: float | None = None
    tau: float | None = None
    tokens_per_s: float | None = None
    history: deque = field(default_factory=deque)  # (monotonic time, step) for the step rate

    def update(self, sources: list[dict[str, Any]], now: float) -> None:
        """Take this window's figures: the first replica's step, loss and τ (replicas train in lockstep),
        the tokens/s of all replicas together; a figure missing from this window keeps its last value."""
        first = min(sources, key=lambda p: p["name"])
        self.state = shown_state(first)
        rates = [p["tokens_per_s"] for p in sources if p["tokens_per_s"] is not None]
        self.tokens_per_s = sum(rates) if rates else self.tokens_per_s
        self.loss = first["loss"] if first["loss"] is not None else self.loss
        self.tau = first["tau_est"] if first["tau_est"] is not None else self.tau
        if first["step"] is not None and first["step"] != self.step:
            self.step = first["step"]
            self.history.append((now, self.step))
            while len(self.history) > 2 and now - self.history[0][0] > RATE_SPAN_S:
                self.history.popleft()

    @property
    def finished(self) -> bool:
        return self.state == "exited"

    def eta_s(self) -> float | None:
        if self.finished or self.step is None or len(self.history) < 2 or self.step >= self.total_steps:
            return None
        (t0, s0), (t1, s1) = self.history[0], self.history[-1]
        return (self.total_steps - self.step) * (t1 - t0) / (s1 - s0) if s1 > s0 and t1 > t0 else None

    def short(self) -> str:
        """The terminal's part: `d_b16 120/740 loss 2.314 τ 3.10 1.5k tok/s ETA 5:15`."""
        if self.step is None:
            return f"{self.name} {self.state or 'waiting'}"
        rate = "-" if self.tokens_per_s is None else f"{self.tokens_per_s / 1000:.1f}k"
        state = "" if self.state == "live" else f" [{self.state}]"
        return (
            f"{self.name} {self.step}/{self.total_steps} loss {fmt(self.loss, '.3f')} τ {fmt(self.tau, '.2f')}"
            f" {rate} tok/s ETA {clock(self.eta_s())}{state}"
        )

    def line(self) -> str:
        if self.step is None:
            return f"{self.name}: {self.state or 'waiting'}"
        pct = f" ({100 * self.step / self.total_steps:.0f}%)" if self.total_steps else ""
        state = "" if self.state == "live" else f" [{self.state}]"
        return (
            f"{self.name}: step {self.step}/{self.total_steps}{pct} loss {fmt(self.loss, '.4f')}"
            f" τ {fmt(self.tau, '.2f')} {fmt(self.tokens_per_s, ',.0f')} tok/s ETA {clock(self.eta_s())}{state}"
        )


def clock(seconds: float | None) -> str:
    """h:mm:ss or m:ss; "-" while unknown."""
    if seconds is None:
        return "-"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def drafter_of(source: dict[str, Any]) -> str | None:
    """The drafter a window's source trains (`d_b16_r1` → `d_b16`); None for anything but a consumer."""
    return _REPLICA.sub("", source["name"]) if source["role"] == "consumer" and source["name"] else None


class Display:
    """On a terminal one line, rewritten in place (carriage return), with a part per drafter: it never moves the
    cursor up, so whatever launch.sh prints meanwhile (a failure, its log tail) is never overwritten. Elsewhere
    a plain line per drafter, every `every_s` and at a change of state (a finish, a phase)."""

    def __init__(self, out: TextIO, every_s: float) -> None:
        self.out, self.every_s = out, every_s
        self.tty = out.isatty()
        self.drawn = False  # a line is on the terminal, not yet ended
        self.printed: dict[str, tuple[float, str | None]] = {}  # plain mode: when and in which state, per drafter
        self.note = ""  # the last note shown: a new one is printed at once in plain mode

    def show(self, drafters: list[Drafter], now: float, note: str = "") -> None:
        """`note`: what telemetry could not do (dropped metrics.jsonl windows), after the drafters' parts."""
        if self.tty:
            width = max(20, shutil.get_terminal_size().columns - 1)  # never wrap: a wrapped line breaks the \r
            self.out.write("\r" + (" | ".join(d.short() for d in drafters) + note)[:width] + "\x1b[K")
            self.drawn = True
        else:
            for d in drafters:
                when, state = self.printed.get(d.name, (None, None))
                if when is None or now - when >= self.every_s or d.state != state or note != self.note:
                    self.out.write(f"progress: {d.line()}{note}\n")
                    self.printed[d.name] = (now, d.state)
        self.note = note
        self.out.flush()

    def close(self) -> None:
        """End the terminal's line, so what follows starts on a line of its own."""
        if self.drawn:
            self.out.write("\n")
            self.out.flush()
            self.drawn = False


def run(job_file: str, out: TextIO, every_s: float, timeout_s: float = 3600.0) -> int:
    """Follow the job until every drafter has exited (or `timeout_s` with no window at all)."""
    job = load_job(job_file)
    drafters = {d.name: Drafter(d.name, d.total_steps) for d in job.drafters}
    display = Display(out, every_s)
    context = zmq.Context()
    sock = context.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, WINDOW_TOPIC)
    sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
    sock.connect(job.run_paths.ipc(REPUBLISH_SOCKET))  # before telemetry binds it too: ZeroMQ connects when it can
    receiver = Receiver(sock)
    try:
        while True:
            state = receiver.receive(timeout_s)
            if state is None:
                return 1
            now = time.monotonic()
            by_drafter: dict[str, list[dict[str, Any]]] = {}
            for p in state["processes"]:
                if (name := drafter_of(p)) in drafters:
                    by_drafter.setdefault(name, []).append(p)
            for name, sources in by_drafter.items():
                drafters[name].update(sources, now)
            seen = [d for d in drafters.values() if d.state is not None]
            if seen:
                display.show(seen, now, dropped_note(state["health"], " | "))
            if seen and all(d.finished for d in drafters.values()):
                return 0
    finally:
        display.close()
        sock.close()
        context.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m telemetry.progress", description=__doc__.splitlines()[0])
    parser.add_argument("job", help="the job file (TOML)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # launch.sh ended: the lines drawn stay as they are
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    watch_supervisor()
    try:
        return run(args.job, sys.stdout, float(os.environ.get(EVERY_ENV, "30")))
    except ConfigError as err:
        print(f"progress: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
