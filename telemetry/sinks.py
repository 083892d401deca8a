"""Where window documents go: W&B (own thread, bounded queue), metrics.jsonl, and an XPUB for the CLI."""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
from pathlib import Path
from typing import Any

import msgpack
import zmq

WINDOW_TOPIC = b"telemetry.window"
UPTIME_METRIC = "telemetry/uptime_s"
WALL_CLOCK_GROUPS = ("telemetry", "gpu", "pipeline", "drafter")  # plotted against UPTIME_METRIC


def json_safe(value: Any) -> Any:
    """NaN/inf become null: JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class JsonlSink:
    """One JSON object per window appended to metrics.jsonl, written at once so a tail -f sees it.

    A window that cannot be written (a full disk, EIO) is dropped and counted, never fatal: the live view
    (the XPUB) and W&B go on. A write cut short is truncated back, so the file holds whole lines only. The
    first failure of a run of them is logged, and the recovery with how many windows were lost; the counts
    are in every window's health (`jsonl_dropped`, `jsonl_error`)."""

    def __init__(self, path: Path, log: logging.Logger | None = None) -> None:
        self.path = path
        self.log = log or logging.getLogger(__name__)
        self.dropped = 0  # windows never written, in all
        self.error: str | None = None  # why the last write failed, while failing; None once writable again
        self._failing = 0  # windows dropped since the last successful write
        self._fd: int | None = None

    def write(self, doc: dict[str, Any]) -> bool:
        """Append one window; False (counted, logged on the first of a run) when it could not be written."""
        data = (json.dumps(json_safe(doc), allow_nan=False) + "\n").encode()
        start = None
        try:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            start = os.fstat(self._fd).st_size
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as err:
            self._drop(err, start)
            return False
        if self._failing:
            self.log.warning(
                "%s is writable again: %d window(s) were dropped (%s)", self.path, self._failing, self.error
            )
            self._failing, self.error = 0, None
        return True

    def _drop(self, err: OSError, start: int | None) -> None:
        if start is not None and self._fd is not None:
            try:
                os.ftruncate(self._fd, start)  # no torn line for readers, and the room it took back
            except OSError:
                pass
        self.dropped += 1
        self._failing += 1
        self.error = f"{err.strerror or err}"
        if self._failing == 1:
            self.log.warning(
                "cannot write %s (%s): windows are dropped and counted until it can; the live view goes on",
                self.path,
                self.error,
            )

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Republisher:
    """XPUB bound for `dflash-stats`: sends each window while someone listens, and the last one to a
    newcomer at once (so `--once` does not wait a whole window)."""

    def __init__(self, context: zmq.Context, endpoint: str) -> None:
        self.socket = context.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 16)
        self.socket.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscribe, so the count stays right
        self.socket.bind(endpoint)
        self.subscribers = 0
        self._last: bytes | None = None

    def publish(self, doc: dict[str, Any]) -> None:
        self._last = msgpack.packb(doc, use_bin_type=True)
        if self.subscribers > 0:
            self._send()

    def on_readable(self) -> None:
        """Read subscription notices (b"\\x01topic" / b"\\x00topic")."""
        while True:
            try:
                msg = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == b"\x01":
                self.subscribers += 1
                if self._last is not None:
                    self._send()
            elif msg[:1] == b"\x00":
                self.subscribers = max(0, self.subscribers - 1)

    def _send(self) -> None:
        try:
            self.socket.send_multipart([WINDOW_TOPIC, self._last], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a stalled viewer: it gets the next window

    def close(self) -> None:
        self.socket.close()


class WandbSink:
    """W&B in its own thread: init and finish may block for tens of seconds, the loop must not.

    Each source prefix gets its own step metric (`consumer/d0_r0/*` against `consumer/d0_r0/step`);
    sources without a step and the wall-clock groups use `telemetry/uptime_s`.
    """

    def __init__(
        self,
        *,
        mode: str,
        project: str,
        entity: str | None,
        root_dir: Path,
        group: str,
        run_id: str,
        queue_size: int,
        name: str | None = None,
        log: logging.Logger,
        config: dict[str, Any] | None = None,
        init_timeout_s: float = 30.0,
        finish_timeout_s: float = 10.0,
    ) -> None:
        if mode not in ("online", "offline"):
            raise ValueError(f"W&B sink mode must be online or offline, got {mode!r}")
        self.mode, self.log = mode, log
        self._init_args = dict(
            project=project,
            entity=entity,
            dir=str(root_dir),  # W&B writes into <dir>/wandb, i.e. RunPaths.wandb
            group=group,  # the job: every node's run in one group, so a multi-machine job reads as one
            name=name,  # the node: one run per machine
            job_type="telemetry",
            id=run_id,
            resume="allow",
            config=config or {},
        )
        self._settings = dict(
            x_disable_stats=True,
            console="off",
            disable_git=True,
            silent=True,  # our own log lines say where the run is
            init_timeout=init_timeout_s,
            finish_timeout=finish_timeout_s,
        )
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wandb-sink", daemon=True)
        self._defined: set[str] = set()
        self.dropped = 0
        self.errors = 0
        self.mode_used: str | None = None  # after init: online, offline, or "failed"

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._thread.start()

    def submit(self, metrics: dict[str, float], source_prefixes: list[str]) -> bool:
        """Queue one window (Python floats only); a full queue drops it and counts."""
        row = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        try:
            self._queue.put_nowait((row, list(source_prefixes)))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def close(self, timeout_s: float = 15.0) -> None:
        """Drain, finish (bounded by finish_timeout), and give up on the thread after timeout_s."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self.log.warning("W&B did not finish within %.0f s; abandoning it", timeout_s)

    def _run(self) -> None:
        run = self._init()
        while True:
            try:
                row, prefixes = self._queue.get(timeout=0.2)
            except queue.Empty:
                if self._stop.is_set():
                    break
                continue
            if run is None:
                continue
            try:
                self._define(run, row, prefixes)
                run.log(row)
            except Exception as err:
                self.errors += 1
                if self.errors == 1:
                    self.log.warning("W&B log failed (further failures only counted): %s", err)
        if run is not None:
            try:
                run.finish()
            except Exception as err:
                self.log.warning("W&B finish failed: %s", err)

    def _init(self):
        import wandb  # here, not at module import: only this thread pays for it

        modes = ["online", "offline"] if self.mode == "online" else ["offline"]
        for mode in modes:
            try:
                run = wandb.init(mode=mode, settings=wandb.Settings(**self._settings), **self._init_args)
            except Exception as err:
                wandb.teardown()  # a failed init keeps the run id "in use" in this process
                self.log.warning("W&B %s init failed (%s)%s", mode, err, "; trying offline" if mode == "online" else "")
                continue
            self.mode_used = mode
            run.define_metric(UPTIME_METRIC)
            for group in WALL_CLOCK_GROUPS:
                run.define_metric(f"{group}/*", step_metric=UPTIME_METRIC)
            self.log.info("W&B %s run %s in %s", mode, run.id, run.dir)
            return run
        self.mode_used = "failed"
        self.log.warning("W&B unavailable: windows go to metrics.jsonl only")
        return None

    def _define(self, run, row: dict[str, float], prefixes: list[str]) -> None:
        for prefix in prefixes:
            if prefix in self._defined:
                continue
            step = f"{prefix}/step"
            if step in row:
                run.define_metric(step)
                run.define_metric(f"{prefix}/*", step_metric=step)
            else:
                run.define_metric(f"{prefix}/*", step_metric=UPTIME_METRIC)
            self._defined.add(prefix)
