"""What killed checkpoint writes leave in a drafter's checkpoint folder: put back or removed at start-up.

A write (consumer/checkpoint.py, consumer/best_checkpoint.py, common/checkpoint_pointer.py, common/storage.py)
works in hidden siblings of its final place, and a kill inside it leaves them there:

    .step_<N>.<8 chars>/              a checkpoint being written, never renamed into place (up to a whole one)
    .step_<N>.old.<8 chars>/step_<N>  the previous copy of a step saved again, moved aside for the new copy
    .write-probe-<hex>                the start-up write probe
    .latest.tmp, .best.tmp            a pointer's new symlink before its rename
    .best.json.tmp                    best.json before its rename

Only the group's writer (global rank 0) writes the folder, so when it starts each of them is dead. An aside
copy whose `step_<N>` is missing was the current checkpoint (killed between the two renames): `put_back`
renames it into place before resume reads the folder. `remove_leftovers` runs after resume has found the
newest intact checkpoint and removes every other match, saying what it removed and how much room that gave
back, before the free-space check. Names that match none of these patterns (other files, `corrupt-step_<N>`
kept for a post-mortem, other drafters' folders) are never touched.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

WRITE_TMP = re.compile(r"\.step_(\d+)\.[a-z0-9_]{8}")  # tempfile.mkdtemp's 8 random characters
ASIDE = re.compile(r"\.step_(\d+)\.old\.[a-z0-9_]{8}")
SMALL = re.compile(r"\.write-probe-[0-9a-f]+|\.(latest|best)\.tmp|\.best\.json\.tmp")


def _size(path: Path) -> int:
    """Bytes held by a file or a folder (a symlink counts as nothing; what vanishes meanwhile too)."""
    if path.is_symlink() or not path.is_dir():
        try:
            return 0 if path.is_symlink() else path.stat().st_size
        except OSError:
            return 0
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(dirpath) / name).lstat().st_size
            except OSError:
                pass
    return total


def leftovers(ckpt_root: Path) -> list[Path]:
    """The folder's entries that only a killed write leaves behind, by name."""
    if not ckpt_root.is_dir():
        return []
    return sorted(
        p
        for p in ckpt_root.iterdir()
        if WRITE_TMP.fullmatch(p.name) or ASIDE.fullmatch(p.name) or SMALL.fullmatch(p.name)
    )


def put_back(ckpt_root: Path) -> list[Path]:
    """Rename each aside copy `.step_<N>.old.<x>/step_<N>` whose `step_<N>` is missing back into place (the
    write that moved it was killed before its new copy took the name); returns the checkpoints put back."""
    restored = []
    for aside in leftovers(ckpt_root):
        found = ASIDE.fullmatch(aside.name)
        if not found:
            continue
        name = f"step_{found[1]}"
        if (aside / name).is_dir() and not (ckpt_root / name).exists():
            os.rename(aside / name, ckpt_root / name)
            log.warning(
                "put %s back from %s: a write of the same step was killed after moving it aside", name, aside.name
            )
            restored.append(ckpt_root / name)
    return restored


def remove_leftovers(ckpt_root: Path) -> tuple[int, int]:
    """Remove what killed writes left in `ckpt_root` and say so in one line; returns (entries, bytes) removed."""
    removed, kept = [], []
    for path in leftovers(ckpt_root):
        size = _size(path)
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
            removed.append((path, size))
        except OSError as err:
            kept.append(f"{path.name} ({err.strerror})")
    if removed:
        log.warning(
            "removed %d leftover(s) of interrupted checkpoint writes from %s (%s freed): %s",
            len(removed),
            ckpt_root,
            _mib(sum(n for _, n in removed)),
            ", ".join(f"{p.name} ({_mib(n)})" for p, n in removed),
        )
    if kept:
        log.warning("could not remove leftover(s) of checkpoint writes from %s: %s", ckpt_root, ", ".join(kept))
    return len(removed), sum(n for _, n in removed)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
