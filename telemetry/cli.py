"""`dflash-stats RUN_DIR | --job JOB.toml [--once | --json | --plot]`: the live state of a running job.

Attaches to the telemetry process's republish socket (it sends the latest window to a newcomer at
once, then one per window). Exit status: 0 shown; 1 nothing is publishing (no window within
--timeout, or no live process); 2 no such run directory / job file / telemetry socket. `--plot` draws
the run's pictures from its metrics.jsonl instead (telemetry.plot; no telemetry process needed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from common.config import ConfigError, load_job
from common.run_paths import RunPaths
from common.startup import PHASE_NAMES
from telemetry.aggregate import source_prefix
from telemetry.service import REPUBLISH_SOCKET
from telemetry.sinks import WINDOW_TOPIC

# the fields of a window the CLI shows, by type (anything else in a window is ignored)
PROCESS_TEXT = ("source", "role", "name", "host", "state")
PROCESS_INTS = ("pid", "step", "gaps", "restarts")
PROCESS_NUMBERS = ("tokens_per_s", "wait_pct", "busy_pct", "age_s")
PROCESS_METRICS = ("loss", "tau_est", "phase")  # per-source window figures (gauges), read from metrics
GPU_TEXT = ("uuid", "name")
GPU_INTS = ("index", "memory_used_bytes", "memory_total_bytes")
GPU_NUMBERS = ("util_pct", "mem_util_pct", "power_w", "power_limit_w", "temperature_c", "sm_clock_mhz")


class CliError(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def resolve(run_dir: str | None, job_file: str | None, need_socket: bool = True) -> tuple[RunPaths, float]:
    """(run paths, window_s) from a job file or a run directory (its job.toml copy, when present)."""
    window_s = 5.0
    if job_file:
        try:
            job = load_job(job_file)
        except ConfigError as err:
            raise CliError(str(err), 2) from None
        paths, window_s = job.run_paths, job.telemetry.window_s
    elif run_dir:
        paths = RunPaths(Path(run_dir))
        if paths.job_copy.is_file():
            try:
                window_s = load_job(paths.job_copy).telemetry.window_s
            except ConfigError:
                pass  # the socket alone is enough to attach
    else:
        raise CliError("dflash-stats: give a RUN_DIR or --job JOB.toml", 2)
    if not paths.root.is_dir():
        raise CliError(f"dflash-stats: run directory {paths.root} does not exist", 2)
    if need_socket and not (paths.sockets / REPUBLISH_SOCKET).exists():
        raise CliError(
            f"dflash-stats: no telemetry socket at {paths.sockets / REPUBLISH_SOCKET}: is this job's telemetry running?",
            2,
        )
    return paths, window_s


class MalformedWindow(ValueError):
    """A window that does not have the telemetry process's shape (a rogue or broken publisher): skipped."""


MAX_ENTRIES = 4096  # processes or GPUs in one window; more is not a real job
MAX_TEXT = 200  # characters kept of any string


def _number(v: Any, key: str, *, integer: bool = False) -> float | int | None:
    """None, or a finite int/float (NaN/inf become None); integer fields take integral floats too."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise MalformedWindow(f"{key} is {type(v).__name__}, not a number")
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if integer:
        if isinstance(v, float) and not v.is_integer():
            raise MalformedWindow(f"{key} is {v!r}, not an integer")
        return int(v)
    return v


def _text(v: Any, key: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise MalformedWindow(f"{key} is {type(v).__name__}, not a string")
    return v[:MAX_TEXT]


def _table(v: Any, key: str, kind: type) -> Any:
    if v is None:
        return kind()
    if not isinstance(v, kind):
        raise MalformedWindow(f"{key} is {type(v).__name__}, not a {kind.__name__}")
    if kind is list and len(v) > MAX_ENTRIES:
        raise MalformedWindow(f"{key} has {len(v)} entries (at most {MAX_ENTRIES})")
    return v


def _record(v: Any, key: str, texts: tuple[str, ...], ints: tuple[str, ...], numbers: tuple[str, ...]) -> dict:
    entry = _table(v, key, dict)
    out: dict[str, Any] = {k: _text(entry.get(k), f"{key}.{k}") for k in texts}
    out |= {k: _number(entry.get(k), f"{key}.{k}", integer=True) for k in ints}
    out |= {k: _number(entry.get(k), f"{key}.{k}") for k in numbers}
    return out


def _scalars(v: Any, key: str) -> dict[str, Any]:
    """A flat dict of str keys to short scalars (health): anything else is malformed."""
    out = {}
    for k, x in _table(v, key, dict).items():
        if not isinstance(k, str):
            raise MalformedWindow(f"{key} has a {type(k).__name__} key")
        out[k[:MAX_TEXT]] = (
            x if isinstance(x, bool) else _text(x, f"{key}.{k}") if isinstance(x, str) else _number(x, f"{key}.{k}")
        )
    return out


def view(doc: Any) -> dict[str, Any]:
    """The stable JSON shape (snake_case keys, units in names) built from a telemetry window; every field
    type-checked (MalformedWindow says which one is wrong), strings cut to MAX_TEXT characters."""
    if not isinstance(doc, dict):
        raise MalformedWindow(f"the window is {type(doc).__name__}, not a map")
    now = time.time()
    sent = _number(doc.get("time"), "time")
    metrics = _table(doc.get("metrics"), "metrics", dict)
    return {
        "query_time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "job": _text(doc.get("job"), "job"),
        "run_dir": _text(doc.get("run_dir"), "run_dir"),
        "window_s": _number(doc.get("window_s"), "window_s"),
        "telemetry_uptime_s": _number(doc.get("uptime_s"), "uptime_s"),
        "window_age_s": None if sent is None else now - sent,
        "processes": [_process(s, metrics) for s in _table(doc.get("sources"), "sources", list)],
        "gpus": [_record(g, "gpus[]", GPU_TEXT, GPU_INTS, GPU_NUMBERS) for g in _table(doc.get("gpus"), "gpus", list)],
        "ring": _record(doc.get("ring"), "ring", (), ("slots_total",), ("slots_in_use",)),
        "pipeline": {
            key: _number(metrics.get(f"pipeline/{key}"), f"metrics.pipeline/{key}")
            for key in ("tokens_per_s", "producers_reporting", "producer_balance")
        },
        "health": _scalars(doc.get("health"), "health"),
    }


def _process(v: Any, metrics: dict) -> dict[str, Any]:
    """A source's summary plus its loss and τ of this window (None for a producer, or no step this window)."""
    out = _record(v, "sources[]", PROCESS_TEXT, PROCESS_INTS, PROCESS_NUMBERS)
    prefix = source_prefix(out["role"], out["name"]) if out["role"] and out["name"] else None
    for key in PROCESS_METRICS:
        out[key] = None if prefix is None else _number(metrics.get(f"{prefix}/{key}"), f"metrics.{prefix}/{key}")
    code = None if out["phase"] is None else round(out["phase"])  # a window's mean, if it spans a change
    out["phase"] = PHASE_NAMES.get(code, "running") if code is not None else None
    return out


def shown_state(p: dict[str, Any]) -> str | None:
    """A live process in a start-up phase (loading, compiling, first batch) shows the phase instead."""
    return p["phase"] if p["state"] == "live" and p["phase"] not in (None, "running") else p["state"]


def fmt(v: Any, spec: str = ".1f") -> str:
    """A cell: "-" for None, numbers by spec (an integer spec takes floats too), anything else as text."""
    if v is None:
        return "-"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v:.0f}" if spec == "d" and isinstance(v, float) else format(v, spec)
    return str(v)


# header: the widest cell shown whole (process names take what is left of 80 columns, at most 24)
PROCESS_COLUMNS = {"state": 11, "step": 9, "tok/s": 8, "wait%": 5, "busy%": 5, "loss": 7, "τ": 5, "age s": 6}


def render(state: dict[str, Any]):
    """rich renderable: processes, GPUs, ring. Text from the window is escaped (never read as rich markup)."""
    from rich import box
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    def cell(v: Any, spec: str = ".1f") -> str:
        return escape(fmt(v, spec))

    procs = Table(
        title=f"dflash job {cell(state['job'])} — window {cell(state['window_s'])} s, age {cell(state['window_age_s'])} s",
        box=box.SIMPLE_HEAD,  # no side borders, one space between columns: whole headers in 80 columns
        pad_edge=False,
        collapse_padding=True,
    )
    procs.add_column("process", overflow="ellipsis", max_width=24)  # the one column that shrinks
    for col, widest in PROCESS_COLUMNS.items():  # an absurd value (a rogue publisher's) is cut, not the table
        procs.add_column(col, justify="left" if col == "state" else "right", no_wrap=True, min_width=len(col),
                         max_width=widest, overflow="ellipsis")  # fmt: skip
    for p in state["processes"]:
        style = None if p["state"] == "live" else "red"
        procs.add_row(cell(p["name"]), cell(shown_state(p)), cell(p["step"], "d"), cell(p["tokens_per_s"], ".0f"),
                      cell(p["wait_pct"], ".0f"), cell(p["busy_pct"], ".0f"), cell(p["loss"], ".3f"),
                      cell(p["tau_est"], ".2f"), cell(p["age_s"]), style=style)  # fmt: skip
    parts: list[Any] = [procs]
    if state["gpus"]:
        gpus = Table(title="GPUs", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for col in ("gpu", "name", "util %", "mem busy %", "memory GiB", "power W", "temp C"):
            gpus.add_column(col)
        for g in state["gpus"]:
            used, total = g["memory_used_bytes"], g["memory_total_bytes"]
            mem = "-" if used is None or total is None else f"{used / 2**30:.1f}/{total / 2**30:.1f}"
            gpus.add_row(cell(g["index"], "d"), cell(g["name"]), cell(g["util_pct"], ".0f"), cell(g["mem_util_pct"], ".0f"),
                         mem, cell(g["power_w"], ".0f"), cell(g["temperature_c"], ".0f"))  # fmt: skip
        parts.append(gpus)
    parts.append(escape(summary(state)))
    return Group(*parts)


def summary(state: dict[str, Any]) -> str:
    ring, health = state["ring"], state["health"]
    return (
        f"ring: {fmt(ring.get('slots_in_use'))}/{fmt(ring.get('slots_total'), 'd')} slots in use | pipeline "
        f"{fmt(state['pipeline']['tokens_per_s'], '.0f')} tok/s{_producers(state['pipeline'])} | telemetry: {fmt(health.get('messages'), 'd')} msgs, "
        f"{fmt(health.get('gaps'), 'd')} gaps, {fmt(health.get('decode_errors'), 'd')} decode errors, "
        f"W&B {fmt(health.get('wandb_mode'))} queue {fmt(health.get('wandb_queue'), 'd')}"
        + dropped_note(health, " | ")
        + (f" | skipped {state['malformed_windows']} malformed window(s)" if state.get("malformed_windows") else "")
    )


def dropped_note(health: dict[str, Any], sep: str) -> str:
    """`sep` + "metrics.jsonl: N window(s) not written (why, while it fails)" when telemetry dropped any; else ""."""
    dropped = health.get("jsonl_dropped")
    if not isinstance(dropped, (int, float)) or not dropped:
        return ""
    why = health.get("jsonl_error")
    return f"{sep}metrics.jsonl: {int(dropped)} window(s) not written" + (f" ({why})" if why else "")


def _producers(pipeline: dict[str, Any]) -> str:
    """Several target replicas: how many report, and the slowest one's rate ÷ the fastest one's."""
    n = pipeline.get("producers_reporting")
    if not n or n < 2:
        return ""
    return f" from {fmt(n, '.0f')} producers, balance {fmt(pipeline.get('producer_balance'), '.2f')}"


def plain_line(state: dict[str, Any]) -> str:
    """One line per window for a pipe or a log file (live mode when stdout is not a terminal)."""
    procs = " ".join(
        f"{fmt(p['name'])}={fmt(shown_state(p))}/step {fmt(p['step'], 'd')}/{fmt(p['tokens_per_s'], '.0f')} tok/s"
        + (f"/loss {fmt(p['loss'], '.3f')}/τ {fmt(p['tau_est'], '.2f')}" if p["loss"] is not None else "")
        for p in state["processes"]
    )
    return f"{state['query_time']} job {fmt(state['job'])}: {procs or 'no processes'} | {summary(state)}"


class Receiver:
    """Windows from the republish socket, each checked by `view`; malformed ones are counted and skipped."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.malformed = 0
        self.last_fault: str | None = None

    def receive(self, timeout_s: float) -> dict[str, Any] | None:
        """The newest valid window (as `view` shapes it) that arrives within timeout_s; older queued ones are
        skipped."""
        state = None
        deadline = time.monotonic() + timeout_s
        while state is None and (remaining := deadline - time.monotonic()) > 0:
            if self.sock.poll(remaining * 1e3):
                state = self._one()
        while state is not None and self.sock.poll(0):
            state = self._one() or state
        if state is not None:
            state["malformed_windows"] = self.malformed
        return state

    def _one(self) -> dict[str, Any] | None:
        frames = self.sock.recv_multipart()
        try:
            doc = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
            return view(doc)
        except (ValueError, TypeError) as err:  # MalformedWindow; msgpack's errors; an unhashable map key
            self.malformed += 1
            self.last_fault = f"{type(err).__name__}: {str(err)[:MAX_TEXT]}"
            return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-stats", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", help="the job's run directory")
    parser.add_argument("--job", help="job file (TOML), instead of RUN_DIR")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="print one table and exit")
    mode.add_argument("--json", action="store_true", help="print one JSON document and exit")
    mode.add_argument("--plot", action="store_true",
                      help="write RUN_DIR/plots/*.png (loss, τ, tokens/s; acceptance histogram) and exit")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=None, help="seconds to wait for data (default 2× window)")
    args = parser.parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C or a SIGTERM ends the view cleanly, even when started with SIGINT ignored (a background job of
        # a script, which is how CI and wrappers start it): Python then never installs its own handler.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.plot:
        from telemetry.plot import main as plot

        try:
            paths, _ = resolve(args.run_dir, args.job, need_socket=False)
        except CliError as err:
            print(err, file=sys.stderr)
            return err.status
        return plot([str(paths.root)])
    try:
        paths, window_s = resolve(args.run_dir, args.job)
    except CliError as err:
        print(err, file=sys.stderr)
        return err.status
    timeout_s = args.timeout if args.timeout is not None else max(2.0 * window_s, 2.0)
    context = zmq.Context()
    sock = context.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, WINDOW_TOPIC)
    sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)  # a window is kilobytes: a rogue giant frame drops the link
    sock.connect(paths.ipc(REPUBLISH_SOCKET))
    receiver = Receiver(sock)
    try:
        state = receiver.receive(timeout_s)
        if receiver.malformed:
            print(
                f"dflash-stats: skipped {receiver.malformed} malformed window(s) (last: {receiver.last_fault})",
                file=sys.stderr,
            )
        if state is None:
            print(f"dflash-stats: nothing published on {paths.ipc(REPUBLISH_SOCKET)} within {timeout_s:.1f} s"
                  " (telemetry not running or stuck)", file=sys.stderr)  # fmt: skip
            return 1
        if args.json or args.once:
            return _print_once(state, args.json)
        return _live(receiver, state, timeout_s)
    except KeyboardInterrupt:
        return 0
    finally:
        sock.close()
        context.term()


def _print_once(state: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(state, sort_keys=True, allow_nan=False))
    else:
        from rich.console import Console

        Console().print(render(state))
    if not any(p["state"] == "live" for p in state["processes"]):
        print("dflash-stats: telemetry is up but no process is publishing stats", file=sys.stderr)
        return 1
    return 0


def _live(receiver: Receiver, state: dict[str, Any], timeout_s: float) -> int:
    """A table redrawn in place on a terminal; one plain line per new window otherwise (a pipe, a log)."""
    if not sys.stdout.isatty():
        try:
            while True:
                print(
                    plain_line(state)
                    if state is not None
                    else f"{datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')} no window within"
                    f" {timeout_s:.1f} s (telemetry not running or stuck)",
                    flush=True,
                )
                state = receiver.receive(timeout_s)
        except BrokenPipeError:  # the reader went away (| head): not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
            return 0
    from rich.live import Live

    with Live(render(state), refresh_per_second=2) as live:
        while True:
            state = receiver.receive(timeout_s) or state
            live.update(render(state))


if __name__ == "__main__":
    sys.exit(main())
