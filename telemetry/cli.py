"""`dflash-stats RUN_DIR | --job JOB.toml [--once | --json]`: the live state of a running job.

Attaches to the telemetry process's republish socket (it sends the latest window to a newcomer at
once, then one per window). Exit status: 0 shown; 1 nothing is publishing (no window within
--timeout, or no live process); 2 no such run directory / job file / telemetry socket.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from common.config import ConfigError, RunPaths, load_job
from telemetry.service import REPUBLISH_SOCKET
from telemetry.sinks import WINDOW_TOPIC, json_safe

PROCESS_KEYS = ("source", "role", "name", "pid", "host", "state", "step", "tokens_per_s", "wait_pct",
                "busy_pct", "age_s", "gaps", "restarts")  # fmt: skip
GPU_KEYS = ("index", "uuid", "name", "util_pct", "mem_util_pct", "memory_used_bytes", "memory_total_bytes",
            "power_w", "power_limit_w", "temperature_c", "sm_clock_mhz")  # fmt: skip


class CliError(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def resolve(run_dir: str | None, job_file: str | None) -> tuple[RunPaths, float]:
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
    if not (paths.sockets / REPUBLISH_SOCKET).exists():
        raise CliError(
            f"dflash-stats: no telemetry socket at {paths.sockets / REPUBLISH_SOCKET}: is this job's telemetry running?",
            2,
        )
    return paths, window_s


def view(doc: dict[str, Any]) -> dict[str, Any]:
    """The stable JSON shape (snake_case keys, units in names) built from a telemetry window."""
    now = time.time()
    return json_safe(
        {
            "query_time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "job": doc.get("job"),
            "run_dir": doc.get("run_dir"),
            "window_s": doc.get("window_s"),
            "telemetry_uptime_s": doc.get("uptime_s"),
            "window_age_s": now - doc.get("time", now),
            "processes": [{k: s.get(k) for k in PROCESS_KEYS} for s in doc.get("sources", [])],
            "gpus": [{k: g.get(k) for k in GPU_KEYS} for g in doc.get("gpus", [])],
            "ring": doc.get("ring", {}),
            "pipeline": {"tokens_per_s": doc.get("metrics", {}).get("pipeline/tokens_per_s")},
            "health": doc.get("health", {}),
        }
    )


def render(state: dict[str, Any]):
    """rich renderable: processes, GPUs, ring."""
    from rich.console import Group
    from rich.table import Table

    def fmt(v: Any, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)

    procs = Table(
        title=f"dflash job {state['job']} — window {fmt(state['window_s'])} s, age {fmt(state['window_age_s'])} s"
    )
    for col in ("role", "name", "state", "step", "tokens/s", "wait %", "busy %", "age s", "gaps"):
        procs.add_column(col, justify="left" if col in ("role", "name", "state") else "right")
    for p in state["processes"]:
        style = None if p["state"] == "live" else "red"
        procs.add_row(p["role"], p["name"], p["state"], fmt(p["step"], "d") if p["step"] is not None else "-",
                      fmt(p["tokens_per_s"], ".0f"), fmt(p["wait_pct"]), fmt(p["busy_pct"]), fmt(p["age_s"]),
                      fmt(p["gaps"], "d"), style=style)  # fmt: skip
    parts: list[Any] = [procs]
    if state["gpus"]:
        gpus = Table(title="GPUs")
        for col in ("gpu", "name", "util %", "mem busy %", "memory GiB", "power W", "temp C"):
            gpus.add_column(col)
        for g in state["gpus"]:
            used, total = g["memory_used_bytes"], g["memory_total_bytes"]
            mem = "-" if used is None or total is None else f"{used / 2**30:.1f}/{total / 2**30:.1f}"
            gpus.add_row(fmt(g["index"], "d"), g["name"] or "-", fmt(g["util_pct"], ".0f"), fmt(g["mem_util_pct"], ".0f"),
                         mem, fmt(g["power_w"], ".0f"), fmt(g["temperature_c"], ".0f"))  # fmt: skip
        parts.append(gpus)
    ring, health = state["ring"], state["health"]
    parts.append(
        f"ring: {fmt(ring.get('slots_in_use'))}/{fmt(ring.get('slots_total'), 'd')} slots in use | pipeline "
        f"{fmt(state['pipeline']['tokens_per_s'], '.0f')} tok/s | telemetry: {fmt(health.get('messages'), 'd')} msgs, "
        f"{fmt(health.get('gaps'), 'd')} gaps, {fmt(health.get('decode_errors'), 'd')} decode errors, "
        f"W&B {health.get('wandb_mode')} queue {fmt(health.get('wandb_queue'), 'd')}"
    )
    return Group(*parts)


def receive(sock: zmq.Socket, timeout_s: float) -> dict[str, Any] | None:
    """The newest window that arrives within timeout_s (older queued ones are skipped)."""
    doc = None
    deadline = time.monotonic() + timeout_s
    while doc is None and (remaining := deadline - time.monotonic()) > 0:
        if sock.poll(remaining * 1e3):
            doc = _decode(sock.recv_multipart())
    while doc is not None and sock.poll(0):
        doc = _decode(sock.recv_multipart()) or doc
    return doc


def _decode(frames: list[bytes]) -> dict[str, Any] | None:
    try:
        doc = msgpack.unpackb(frames[-1], raw=False)
    except Exception:
        return None
    return doc if isinstance(doc, dict) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-stats", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", help="the job's run directory")
    parser.add_argument("--job", help="job file (TOML), instead of RUN_DIR")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="print one table and exit")
    mode.add_argument("--json", action="store_true", help="print one JSON document and exit")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds to wait for data (default 2× window)"
    )
    args = parser.parse_args(argv)
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
    sock.connect(paths.ipc(REPUBLISH_SOCKET))
    try:
        doc = receive(sock, timeout_s)
        if doc is None:
            print(f"dflash-stats: nothing published on {paths.ipc(REPUBLISH_SOCKET)} within {timeout_s:.1f} s"
                  " (telemetry not running or stuck)", file=sys.stderr)  # fmt: skip
            return 1
        if args.json or args.once:
            return _print_once(view(doc), args.json)
        return _live(sock, doc, timeout_s)
    finally:
        sock.close()
        context.term()


def _print_once(state: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(state, sort_keys=True))
    else:
        from rich.console import Console

        Console().print(render(state))
    if not any(p["state"] == "live" for p in state["processes"]):
        print("dflash-stats: telemetry is up but no process is publishing stats", file=sys.stderr)
        return 1
    return 0


def _live(sock: zmq.Socket, doc: dict[str, Any], timeout_s: float) -> int:
    from rich.live import Live

    with Live(render(view(doc)), refresh_per_second=2) as live:
        try:
            while True:
                doc = receive(sock, timeout_s) or doc
                live.update(render(view(doc)))
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    sys.exit(main())
