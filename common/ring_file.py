"""The CPU ring's file name, without torch: launch.sh asks for it (common.joblock info) on every start, and a
torch import there cost ~2.7 s of CPU a start."""

from __future__ import annotations

import os
import re
from pathlib import Path

from common.ring_error import RingError

RING_FILE_PREFIX = "dflash-ring-"  # /dev/shm/{prefix}{ring name}: the one place it is spelt


def ring_path(shm_dir: str | os.PathLike, name: str) -> Path:
    """The CPU ring's file: derived from the job's name so a restarted producer finds a stale one."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", name):
        raise RingError(f"ring name {name!r} must be 1-100 characters of [A-Za-z0-9_.-]")
    return Path(shm_dir) / f"{RING_FILE_PREFIX}{name}"
