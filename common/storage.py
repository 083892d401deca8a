"""Disk checks at start: a run folder we cannot write, or too little room for what we must write, is a clear
error before the first batch rather than a traceback hours later. (/dev/shm room for the ring is checked by
common/ring.py when it allocates.)"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path


class StorageError(RuntimeError):
    """A folder that cannot hold what the job must write there; the message names it and the remedy."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_writable(path: Path, what: str) -> None:
    """Create `path` if needed and prove a file can be written in it (read-only mounts, permissions)."""
    probe = Path(path) / f".write-probe-{secrets.token_hex(4)}"
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


def check_room(path: Path, need_bytes: int, what: str) -> None:
    """`path` is writable and has at least `need_bytes` free."""
    check_writable(path, what)
    free = free_bytes(path)
    if free < need_bytes:
        raise StorageError(
            f"{what} {path} has {_mib(free)} free but needs about {_mib(need_bytes)}: free"
            " space there or choose another job.run_dir"
        )
