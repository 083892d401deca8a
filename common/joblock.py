"""One running job per run folder: the lock every process takes before it touches the folder.

    RUN_DIR/job-n<node>.lock        launch.sh holds it exclusively (flock) for its whole process group and
                                    writes "pid=… start=… launch=…" into it; the processes it starts inherit
                                    the lock and find their launch's id in $DFLASH_LAUNCH_ID.
    RUN_DIR/locks/n<node>-<name>.lock   each process's own lock, held exclusively for its life.

A process started without launch.sh (by hand, by systemd) takes the job lock shared, so the processes of
one unmanaged job coexist while a launch.sh of the same job is refused, and vice versa. Either way a
second copy of one process (its own lock) is refused. The refusal names the holder's pid and start time.
A one-off step that rewrites the folder (`python -m demo prepare` building the demo's assets) takes the job lock
exclusively for its length (`exclusive`), unless the launch.sh that started it holds it already.

    python -m common.joblock info JOB.toml [--node-rank R]   run folder, lock file, ring file (for launch.sh)
    python -m common.joblock holders RUN_DIR [--node-rank R]  who holds the job's locks, one line each
    python -m common.joblock reclaim RUN_DIR [--node-rank R] [--grace S]
        the job lock is held but the launch.sh that took it is gone: its orphans are stopped (SIGTERM, SIGKILL
        after S seconds), and exit 0 once the lock is free; exit 75 when a live launch (or processes started by
        hand) holds it. Orphans stop by themselves (common/supervisor.py); this is for those that did not.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.supervisor import running

LAUNCH_ENV = "DFLASH_LAUNCH_ID"  # set by launch.sh for the processes it starts


class JobLocked(RuntimeError):
    """Another launch or process of this job holds the run folder; the message names it."""


def job_lock_path(run_dir: str | Path, node: int) -> Path:
    return Path(run_dir) / f"job-n{node}.lock"


def process_lock_path(run_dir: str | Path, node: int, name: str) -> Path:
    return Path(run_dir) / "locks" / f"n{node}-{name}.lock"


def _read_fields(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except OSError:
        return {}
    return dict(word.split("=", 1) for word in text.split() if "=" in word)


def _describe(fields: dict[str, str], what: str) -> str:
    if not fields.get("pid"):
        return what
    start = fields.get("start", "?")
    launch = f", launch {fields['launch']}" if fields.get("launch") else ""
    return f"{what} pid {fields['pid']} (started {start}{launch})"


def _held(path: Path, mode: int = fcntl.LOCK_EX) -> bool:
    """Whether some process holds `path` locked: in any mode (LOCK_EX asked), or exclusively (LOCK_SH asked)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def holders(run_dir: str | Path, node: int = 0) -> list[str]:
    """One line per live holder of this job's locks: the launch, then each process."""
    out = []
    job_lock = job_lock_path(run_dir, node)
    fields = _read_fields(job_lock)
    if _held(job_lock, fcntl.LOCK_SH) and fields.get("launch"):  # held exclusively: by a launch
        gone = "" if _launch_running(fields) else " (gone: its processes hold the lock)"
        out.append(_describe(fields, "launch.sh") + gone)
    elif _held(job_lock, fcntl.LOCK_SH) and fields.get("by"):  # held exclusively by a one-off step
        out.append(_describe(fields, fields["by"].replace("_", " ")))
    for name, fields in _process_holders(run_dir, node):
        out.append(_describe(fields, name))
    return out


def _process_holders(run_dir: str | Path, node: int) -> list[tuple[str, dict[str, str]]]:
    """(process name, its lock's fields) of every process that holds its own lock now."""
    return [
        (path.stem.split("-", 1)[1], _read_fields(path))
        for path in sorted((Path(run_dir) / "locks").glob(f"n{node}-*.lock"))
        if _held(path)
    ]


def _launch_running(fields: dict[str, str]) -> bool:
    """Whether the launch.sh named in the job lock still runs (a pid reused by another program is not it)."""
    pid = int(fields["pid"]) if fields.get("pid", "").isdigit() else 0
    if not pid or not running(pid):
        return False
    try:
        return b"launch.sh" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def reclaim(run_dir: str | Path, node: int, grace_s: float, log=print) -> bool:
    """Stop the orphans of a dead launch that still hold the job lock; True once the lock is free.

    Only processes whose own lock names the dead launch's id are signalled: a live launch, or processes
    started by hand (no launch id), are never touched (False)."""
    job_lock = job_lock_path(run_dir, node)
    fields = _read_fields(job_lock)
    launch = fields.get("launch", "")
    if not launch or _launch_running(fields):
        return False
    orphans = [
        (name, int(f["pid"]))
        for name, f in _process_holders(run_dir, node)
        if f.get("launch") == launch and f.get("pid", "").isdigit()
    ]
    if not orphans:  # its processes are gone or on their way out, and what still holds the job lock inherited
        # the dead launch's descriptor from them (a child that outlives its parent by a moment): wait for it
        deadline = time.monotonic() + grace_s
        while _held(job_lock) and time.monotonic() < deadline:
            time.sleep(0.1)
        return not _held(job_lock)
    listed = ", ".join(f"{name} pid {pid}" for name, pid in orphans)
    log(
        f"launch.sh: {_describe(fields, 'the launch.sh')} that held {run_dir} is gone; its processes still run"
        f" ({listed}): stopping them (SIGTERM, SIGKILL after {grace_s:g}s) before this launch starts"
    )
    start = time.monotonic()
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for _, pid in orphans:
            if running(pid):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while _held(job_lock) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _held(job_lock):
            log(
                f"launch.sh: the processes of launch {launch} ended after {time.monotonic() - start:.1f}s;"
                " the job lock is free"
            )
            return True
    return False


@dataclass
class JobLock:
    """What a process holds while it runs the job: released by `release`, when the object is dropped (an
    entry point called in-process, as bench.entry_worker does, returns), or by the kernel at exit."""

    fds: list[int]
    launch_id: str  # the launch this process belongs to ("" when started without launch.sh)

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def __del__(self) -> None:
        self.release()


def _stamp(fd: int, launch_id: str, by: str = "") -> None:
    start = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    by_word = f" by={by.replace(' ', '_')}" if by else ""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid={os.getpid()} start={start} launch={launch_id}{by_word}\n".encode(), 0)


def exclusive(run_dir: str | Path, what: str, node: int = 0) -> JobLock:
    """Hold the job lock exclusively while `what` rewrites the run folder: nothing else of the job may run.

    Started by the launch.sh that holds the lock ($DFLASH_LAUNCH_ID names it): that launch's lock covers it.
    Raises JobLocked naming the holder (a launch, its processes, another `what`) otherwise."""
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = job_lock_path(root, node)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fields = _read_fields(path)
        os.close(fd)
        env_id = os.environ.get(LAUNCH_ENV, "")
        if env_id and fields.get("launch") == env_id:
            return JobLock([], env_id)
        held_by = "; ".join(holders(root, node)) or f"{_describe(fields, 'a process')} (job lock {path})"
        raise JobLocked(f"{root} is in use by {held_by}; {what} not started") from None
    _stamp(fd, "", what)
    return JobLock([fd], "")


def enter(run_dir: str | Path, name: str, node: int = 0) -> JobLock:
    """Take this process's place in the job at `run_dir`, before it touches anything there.

    Raises JobLocked (naming the holder) when another launch of the job, or another copy of `name`, runs."""
    root = Path(run_dir)
    (root / "locks").mkdir(parents=True, exist_ok=True)
    job_path = job_lock_path(root, node)
    env_id = os.environ.get(LAUNCH_ENV, "")
    job_fd = os.open(job_path, os.O_RDWR | os.O_CREAT, 0o644)
    launch_id = ""
    try:
        fcntl.flock(job_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # a launch holds it: ours, or another one
        fields = _read_fields(job_path)
        if not env_id or fields.get("launch") != env_id:
            os.close(job_fd)
            holder = _describe(fields, fields.get("by", "launch.sh").replace("_", " "))
            raise JobLocked(f"{root} is in use by {holder}; {name} not started") from None
        launch_id = env_id
    fds = [job_fd]
    own_path = process_lock_path(root, node, name)
    own_fd = os.open(own_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(own_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fields = _read_fields(own_path)
        os.close(own_fd)
        os.close(job_fd)
        raise JobLocked(
            f"{root}: {_describe(fields, f'another {name}')} is running for this job; {name} not started"
        ) from None
    _stamp(own_fd, launch_id)
    fds.append(own_fd)
    return JobLock(fds, launch_id)


def main(argv: list[str] | None = None) -> int:
    from common.config import ConfigError, load_job
    from common.ring_file import ring_path

    ap = argparse.ArgumentParser(prog="python -m common.joblock", description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["info", "holders", "reclaim"])
    ap.add_argument("path", help="the job file (info) or the run folder (holders, reclaim)")
    ap.add_argument("--node-rank", type=int, default=int(os.environ.get("NODE_RANK", 0)))
    ap.add_argument("--grace", type=float, default=60.0, help="reclaim: seconds the orphans get to stop")
    args = ap.parse_args(argv)
    if args.what == "holders":
        print("\n".join(holders(args.path, args.node_rank)) or "nobody")
        return 0
    if args.what == "reclaim":
        return 0 if reclaim(args.path, args.node_rank, args.grace) else 75
    try:
        job = load_job(args.path)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    root = job.run_paths.root.resolve()
    ring = str(ring_path("/dev/shm", job.ring_name(args.node_rank))) if job.transport_kind == "cpu" else ""
    print(f"{root}\t{job_lock_path(root, args.node_rank)}\t{ring}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
