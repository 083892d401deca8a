"""Disk checks at start: a run folder we cannot write, or too little room for what we must write, is a clear
error before the first batch rather than a traceback hours later. (/dev/shm room for the ring is checked by
common/ring.py when it allocates.)"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import time
from pathlib import Path

log = logging.getLogger(__name__)

PROBE_PREFIX = ".write-probe-"
STALE_PROBE_S = 60.0  # a probe lives for microseconds: one this old was left by a killed process


class StorageError(RuntimeError):
    """A folder that cannot hold what the job must write there; the message names it and the remedy."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_writable(path: Path, what: str) -> None:
    """Create `path` if needed and prove a file can be written in it (read-only mounts, permissions). Probes
    that killed processes left there (older than STALE_PROBE_S; a live one is another process's) are removed."""
    remove_stale_probes(Path(path))
    probe = Path(path) / f"{PROBE_PREFIX}{secrets.token_hex(4)}"
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as err:
        hint = {
            errno.EROFS: "the file system is mounted read-only",
            errno.EACCES: "permission denied",
            errno.ENOSPC: "the disk is full",
            errno.EDQUOT: "the disk quota is exhausted",
        }
        raise StorageError(
            f"{what} {path} is not writable: {hint.get(err.errno, err.strerror)}"
            f" ({err.filename or path}); choose a writable job.run_dir"
        ) from None


def remove_stale_probes(path: Path) -> int:
    """Remove the write probes in `path` older than STALE_PROBE_S, saying so; returns how many."""
    if not path.is_dir():
        return 0
    old = time.time() - STALE_PROBE_S
    stale = []
    for probe in path.glob(f"{PROBE_PREFIX}*"):
        try:
            if probe.is_file() and probe.stat().st_mtime < old:
                probe.unlink()
                stale.append(probe.name)
        except OSError:
            pass  # removed meanwhile, or not ours to remove: the write probe below says what is wrong
    if stale:
        log.info("removed %d write probe(s) left in %s by killed processes: %s", len(stale), path, ", ".join(stale))
    return len(stale)


def check_room(path: Path, need_bytes: int, what: str) -> None:
    """`path` is writable and has at least `need_bytes` free."""
    check_writable(path, what)
    free = free_bytes(path)
    if free < need_bytes:
        raise StorageError(
            f"{what} {path} has {_mib(free)} free but needs about {_mib(need_bytes)}: free"
            " space there or choose another job.run_dir"
        )
