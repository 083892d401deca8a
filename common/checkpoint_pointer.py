"""The `latest` (and `best`) pointer of a drafter's checkpoint folder: one writer, one reader.

A pointer is a relative symlink `<ckpt_root>/latest -> step_<N>`, so the pointer itself is a loadable
checkpoint directory: `AutoModel.from_pretrained("RUN_DIR/checkpoints/b16/latest", trust_remote_code=True)`
works like any export. It is replaced atomically (a symlink under a temporary name, then `os.replace`), so a
reader sees the old target or the new one, never neither. Runs written before this held a text file
`latest` containing "step_<N>"; `read_pointer` accepts both, and the next write turns the file into a symlink.
It lives in `common` because the consumer writes it and the exactly-once checker reads it.
"""

from __future__ import annotations

import os
from pathlib import Path

LATEST = "latest"
BEST = "best"


def read_pointer(ckpt_root: str | Path, pointer: str = LATEST) -> str | None:
    """The checkpoint name (e.g. "step_40") that `ckpt_root/pointer` names; None when there is no pointer.

    The named directory may be missing (pruned, set aside): callers decide what that means."""
    path = Path(ckpt_root) / pointer
    if path.is_symlink():
        return Path(os.readlink(path)).name
    if path.is_file():  # the text pointer of older runs
        return path.read_text().strip() or None
    return None


def write_pointer(ckpt_root: str | Path, name: str, pointer: str = LATEST) -> Path:
    """Point `ckpt_root/pointer` at the sibling directory `name`, atomically; returns the pointer's path.

    The directory is fsynced after the rename, so the new pointer survives a crash once this returns."""
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"checkpoint pointer {pointer}: {name!r} is not a sibling directory name")
    root = Path(ckpt_root)
    tmp = root / f".{pointer}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()  # left by a write that was killed between the two steps
    os.symlink(name, tmp)
    os.replace(tmp, root / pointer)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return root / pointer
