"""Checkpoints: an export directory (consumer/export/layout.py) plus the training state, written atomically.

    <ckpt_root>/step_<N>/config.json         \
                         model.safetensors    the export (consumer/export/layout.py)
                         dflash.py           /
                         trainer_state.pt    the checkpoint state (consumer/checkpoint_state.py): weights,
                                             optimizer, scheduler, RNG, step, group cursor, ledger id, shape
                         manifest.json       size and xxh3-128 digest of each file above, written last
    <ckpt_root>/latest -> step_<N>           a relative symlink (a loadable directory), replaced atomically
                                             after the directory is complete (common/checkpoint_pointer.py)

This module is the life cycle only: `write_checkpoint` writes a state dict and its export into a temporary
directory next to its final place, fsyncs, renames, then moves `latest`, so a crash at any point leaves the
previous checkpoint intact and current; it keeps the newest KEEP_LAST.

Resuming never loads a broken checkpoint silently: `load_latest` checks the manifest (present, every size
and digest matching), reads trainer_state.pt and checks that the weights and optimizer moments are finite.
A checkpoint that fails is logged with its file and the reason, and the next older one is tried;
`resume_checkpoint` (the consumer's entry) also sets the broken ones aside as `corrupt-step_<N>` and
points `latest` at the one it resumed from, so the exactly-once checker walks the lineage really resumed,
and removes what killed writes left (consumer/checkpoint_leftovers.py).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError, safe_open

from common.checkpoint_pointer import BEST, LATEST, read_pointer, write_pointer
from common.config import DTYPE_BYTES
from common.storage import free_bytes
from consumer.checkpoint_leftovers import put_back, remove_leftovers
from consumer.checkpoint_state import checkpoint_state
from consumer.export.layout import EXPORT_FILES, drafter_shape, extra_export_files, trainer_export_config, write_export
from consumer.shape import shape_from_config

STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
DIGEST = "xxh3_128"
CORRUPT_PREFIX = "corrupt-"

log = logging.getLogger(__name__)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


KEEP_LAST = 3  # older step_<N> directories are removed once a newer checkpoint is complete


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (disk full, read-only, ...); the previous one is intact."""


def checkpoint_bytes(trainer) -> int:
    """About what one checkpoint of `trainer` takes on disk, from its parameter count: the export (trained
    weights in the export dtype) and trainer_state.pt (the model state as held plus Adam's two moments)."""
    held = sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values())
    trained = sum(p.numel() for p in trainer.params)
    return int(1.1 * (held + trained * (DTYPE_BYTES[trainer.cfg.dtype] + 8))) + (1 << 20)


def _state_bytes(state: dict, export_dtype: str) -> int:
    """About what `state` takes on disk written as a checkpoint: every tensor it holds, plus its weights again
    in the export dtype (checkpoint_bytes from the state instead of the trainer)."""

    def tensors(obj):
        if torch.is_tensor(obj):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from tensors(v)

    held = sum(t.numel() * t.element_size() for t in tensors(state))
    exported = sum(t.numel() for t in state["model"].values()) * DTYPE_BYTES[export_dtype]
    return int(1.1 * (held + exported)) + (1 << 20)


def save_checkpoint(ckpt_root: str | Path, trainer, keep_last: int = KEEP_LAST) -> Path:
    """A lone, unsharded trainer's checkpoint (no group cursor, no ledger record): `write_checkpoint` of its
    checkpoint_state and export config."""
    state = checkpoint_state(trainer.state_dict(), shape=drafter_shape(trainer))
    return write_checkpoint(ckpt_root, state, trainer_export_config(trainer), keep_last)


def write_checkpoint(ckpt_root: str | Path, state: dict, export: dict, keep_last: int = KEEP_LAST) -> Path:
    """Write <ckpt_root>/step_<state["step"]>/ atomically and point `latest` at it; returns its path.
    `state` (consumer/checkpoint_state.py) becomes trainer_state.pt, its "model" the export with config
    `export` (consumer/export/layout.py). Keeps the newest `keep_last` checkpoints, so a long run does not
    fill the disk.

    A failed write raises CheckpointWriteError naming the folder, the free space and the checkpoint that
    stays current."""
    root = Path(ckpt_root)
    try:
        return _write(root, state, export, keep_last)
    except (OSError, SafetensorError, RuntimeError) as err:  # safetensors and torch.save do not raise OSError
        raise _write_error(root, state, export, err) from err


def _write_error(root: Path, state: dict, export: dict, err: Exception) -> CheckpointWriteError:
    try:
        free = free_bytes(root)
    except OSError:
        free = None
    code = getattr(err, "errno", None)
    if code is None:  # "... (os error 28)" from safetensors; nothing at all from torch.save's "file write failed"
        found = re.search(r"os error (\d+)", str(err))
        full = free is not None and free < _state_bytes(state, export["dtype"])
        code = int(found[1]) if found else errno.ENOSPC if full else errno.EIO
    current = read_pointer(root) or "none"
    reason = os.strerror(code) if code != errno.EIO else f"{type(err).__name__}: {err}"
    room = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
    return CheckpointWriteError(
        code,
        f"cannot write checkpoint step_{state['step']} in {root}: {reason} ({room});"
        f" the previous checkpoint ({current}) is intact and stays current",
    )


def _write(root: Path, state: dict, export: dict, keep_last: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{state['step']}"
    final = root / name
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    stale = None
    try:
        write_export(tmp, state["model"], export)
        torch.save(state, tmp / STATE_FILE)
        files = (*EXPORT_FILES, *extra_export_files(export), STATE_FILE)
        for file in files:
            _fsync_file(tmp / file)
        write_manifest(tmp, files)
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. on shutdown right after a periodic save)
            stale = Path(tempfile.mkdtemp(prefix=f".{name}.old.", dir=root))
            os.rename(final, stale / name)
        os.rename(tmp, final)
        _fsync_dir(root)
        write_pointer(root, name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if stale is not None and not final.exists():
            os.rename(stale / name, final)  # put the previous copy of this step back
        raise
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)
    _prune(root, keep_last)
    return final


def _prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest `keep_last` step directories, never the one `best` points at."""
    best = read_pointer(root, BEST)  # consumer/best_checkpoint.py
    steps = sorted((int(p.name.removeprefix("step_")), p) for p in root.glob("step_*") if p.name[5:].isdigit())
    for _, old in steps[:-keep_last]:
        if old.name != best:
            shutil.rmtree(old, ignore_errors=True)


def _digest(path: Path) -> str:
    """xxh3-128 of the file: it catches corruption (torn or flipped bytes), not tampering (whoever can write
    the file can write the manifest), at ~5× sha256's speed (2.3 vs 0.45 GB/s measured on the test machine)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(out_dir: Path, names: tuple[str, ...]) -> None:
    """manifest.json: size and digest of each file, written after them (a checkpoint without it is incomplete)."""
    files = {n: {"bytes": (out_dir / n).stat().st_size, DIGEST: _digest(out_dir / n)} for n in names}
    (out_dir / MANIFEST).write_text(json.dumps({"version": 1, "files": files}, indent=1) + "\n")
    _fsync_file(out_dir / MANIFEST)


class CheckpointCorrupt(ValueError):
    """One checkpoint that must not be loaded; the message names the file and what is wrong."""


class NoIntactCheckpoint(RuntimeError):
    """Every checkpoint in the folder is broken: the message names the folder and each checkpoint's fault."""


def _check_manifest(path: Path) -> None:
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointCorrupt(f"{manifest} is missing: the checkpoint is incomplete or was written without one")
    try:
        files = json.loads(manifest.read_text())["files"]
        wanted = {str(n): (int(f["bytes"]), str(f[DIGEST])) for n, f in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointCorrupt(f"{manifest} is unreadable ({type(err).__name__}: {err})") from None
    for name in (*EXPORT_FILES, STATE_FILE):
        if name not in wanted:
            raise CheckpointCorrupt(f"{manifest} does not list {name}")
    for name, (size, digest) in wanted.items():
        file = path / name
        if not file.is_file():
            raise CheckpointCorrupt(f"{file} is missing (listed in {MANIFEST})")
        if file.stat().st_size != size:
            raise CheckpointCorrupt(f"{file} has {file.stat().st_size} bytes, {MANIFEST} says {size} (truncated?)")
        if _digest(file) != digest:
            raise CheckpointCorrupt(
                f"{file} does not match its {DIGEST} digest in {MANIFEST} (changed after it was written)"
            )


def _non_finite(tensors: dict, where: str) -> str | None:
    """The first floating tensor holding NaN/Inf, as "where[key] (n of m values)", else None."""
    for key, t in tensors.items():
        if isinstance(t, dict):
            found = _non_finite(t, f"{where}[{key!r}]")
            if found:
                return found
        elif torch.is_tensor(t) and t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                return f"{where}[{key!r}] ({bad} of {t.numel()} values)"
    return None


def _read_checked(path: Path) -> Checkpoint:
    """The checkpoint in `path`, or CheckpointCorrupt naming the file and the fault."""
    if not path.is_dir():
        raise CheckpointCorrupt(f"{path} does not exist")
    try:
        step = int(path.name.removeprefix("step_"))
    except ValueError:
        raise CheckpointCorrupt(f"{path.name!r} is not a step_<N> directory name") from None
    _check_manifest(path)
    state_file = path / STATE_FILE
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as err:  # a torch UnpicklingError / RuntimeError (truncated zip) ... : say which file
        raise CheckpointCorrupt(f"{state_file} cannot be read: {type(err).__name__}: {str(err)[:200]}") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointCorrupt(f"{state_file} holds no trainer state (no 'model' entry)")
    found = _non_finite(state["model"], "weights")
    found = found or _non_finite(state.get("optimizer", {}).get("state", {}), "optimizer state")
    if found:
        raise CheckpointCorrupt(f"{state_file}: non-finite {found}: the checkpoint's training had diverged")
    export = path / "model.safetensors"
    try:
        with safe_open(str(export), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                found = _non_finite({key: f.get_tensor(key)}, "weights")
                if found:
                    raise CheckpointCorrupt(f"{export}: non-finite {found} in the export")
    except (SafetensorError, OSError) as err:
        raise CheckpointCorrupt(f"{export} cannot be read: {err}") from None
    if "shape" not in state:  # written before trainer_state recorded its shape: the export config says it
        try:
            state["shape"] = shape_from_config(json.loads((path / "config.json").read_text()))
        except (OSError, ValueError) as err:
            raise CheckpointCorrupt(f"{path / 'config.json'} is unreadable: {err}") from None
    return Checkpoint(path=path, step=step, state=state)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    state: dict  # Trainer.state_dict(), tensors on the CPU
    skipped: tuple[Path, ...] = ()  # newer checkpoints that were broken (load_latest fell back past them)


def _candidates(root: Path) -> list[Path]:
    """What `latest` points at, then every older step_<N> directory, newest first."""
    name = read_pointer(root)
    steps = sorted(((int(p.name[5:]), p) for p in root.glob("step_*") if p.name[5:].isdigit()), reverse=True)
    top = int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else math.inf
    return [root / name] + [p for n, p in steps if n < top]


def load_latest(ckpt_root: str | Path) -> Checkpoint | None:
    """The newest intact checkpoint from `latest` down, or None when there is none yet (a fresh run).

    Read-only. Each broken one is logged with its file and fault; `Checkpoint.skipped` lists them. When
    every one is broken: NoIntactCheckpoint naming the folder."""
    root = Path(ckpt_root)
    if read_pointer(root) is None:
        return None
    faults: list[tuple[Path, str]] = []
    for path in _candidates(root):
        try:
            ckpt = _read_checked(path)
        except CheckpointCorrupt as err:
            log.error("checkpoint %s is not used: %s", path, err)
            faults.append((path, str(err)))
            continue
        if faults:
            log.warning(
                "resuming from the previous intact checkpoint %s (step %d) instead of %s",
                path,
                ckpt.step,
                ", ".join(p.name for p, _ in faults),
            )
        return dataclasses.replace(ckpt, skipped=tuple(p for p, _ in faults))
    raise NoIntactCheckpoint(
        f"no intact checkpoint in {root}: "
        + "; ".join(msg for _, msg in faults)
        + ". Move the folder aside to start afresh, or restore a checkpoint from a backup"
    )


def check_checkpoint(path: Path) -> None:
    """Raise CheckpointCorrupt naming the file and the fault unless `path` passes every check resume makes."""
    _read_checked(path)


def set_aside(path: Path) -> Path:
    """Rename the broken checkpoint `path` to corrupt-step_<N> (a free variant of the name), saying so: kept
    for a post-mortem, never pruned nor loaded."""
    aside = path.parent / f"{CORRUPT_PREFIX}{path.name}"
    if aside.exists():
        aside = Path(tempfile.mkdtemp(prefix=f"{CORRUPT_PREFIX}{path.name}.", dir=path.parent))
        aside.rmdir()
    os.rename(path, aside)
    log.warning("set the broken checkpoint %s aside as %s", path, aside.name)
    return aside


def resume_checkpoint(ckpt_root: str | Path) -> Checkpoint | None:
    """load_latest, after putting back a checkpoint a killed write had moved aside; when it fell back: set the
    broken newer checkpoints aside as corrupt-step_<N> (kept for a post-mortem, never pruned nor loaded) and
    point `latest` at the one resumed from (atomically). Then, the newest intact checkpoint known, the
    leftovers of killed writes are removed (consumer/checkpoint_leftovers.py); when none is intact they stay,
    for a recovery by hand.

    Only the process that writes the folder (the group's rank 0) may call this."""
    root = Path(ckpt_root)
    put_back(root)
    ckpt = load_latest(root)
    if ckpt is not None and ckpt.skipped:
        for path in ckpt.skipped:
            if path.is_dir():
                set_aside(path)
        write_pointer(root, ckpt.path.name)
        log.warning("%s now points at %s", root / LATEST, ckpt.path.name)
    remove_leftovers(root)
    return ckpt
