"""Checkpoints: the published DFlash export (dflash.md §3) plus the training state, written atomically.

    <ckpt_root>/step_<N>/config.json         the drafter config SGLang / vLLM / transformers read
                         model.safetensors   trained weights only (no embedding, no lm_head), export dtype
                         dflash.py           modeling file for AutoModel + trust_remote_code
                         trainer_state.pt    float32 weights, optimizer, scheduler, RNG, last trained seq
    <ckpt_root>/latest                       "step_<N>", replaced atomically after the directory is complete

A checkpoint is written into a temporary directory next to its final place, fsynced, then renamed;
`latest` moves only after that, so a crash at any point leaves the previous checkpoint intact and current.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from common.config import DTYPE_BYTES
from common.storage import free_bytes
from consumer.model import DrafterArch
from consumer.target_parts import TargetParts

EXPORT_MODULE = Path(__file__).parent / "export" / "dflash.py"
STATE_FILE = "trainer_state.pt"
LATEST = "latest"


def export_config(
    arch: DrafterArch,
    parts: TargetParts,
    *,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int],
    dtype: str,
) -> dict:
    """config.json of the published format ([SF] configs/qwen3-8b-dflash.json, z-lab's drafters)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        "num_target_layers": parts.num_hidden_layers,
        "num_hidden_layers": arch.num_layers,
        "layer_types": ["full_attention"] * arch.num_layers,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": parts.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": arch.num_layers,
        "tie_word_embeddings": False,
        "vocab_size": parts.vocab_size,
        "use_cache": True,
        "dtype": dtype,
    }


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_export(out_dir: Path, model_state: dict[str, torch.Tensor], config: dict) -> None:
    """config.json + model.safetensors (cast to config['dtype']) + dflash.py into out_dir (which exists)."""
    dtype = getattr(torch, config["dtype"])
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model_state.items()}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(EXPORT_MODULE, out_dir / "dflash.py")
    for name in ("config.json", "model.safetensors", "dflash.py"):
        _fsync_file(out_dir / name)


KEEP_LAST = 3  # older step_<N> directories are removed once a newer checkpoint is complete


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (disk full, read-only, ...); the previous one is intact."""


def checkpoint_bytes(trainer) -> int:
    """About what one checkpoint of `trainer` takes on disk, from its parameter count: the export (trained
    weights in the export dtype) and trainer_state.pt (the model state as held plus Adam's two moments)."""
    held = sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values())
    trained = sum(p.numel() for p in trainer.params)
    return int(1.1 * (held + trained * (DTYPE_BYTES[trainer.cfg.dtype] + 8))) + (1 << 20)


def save_checkpoint(ckpt_root: str | Path, trainer, keep_last: int = KEEP_LAST) -> Path:
    """Write <ckpt_root>/step_<trainer.step>/ atomically and point `latest` at it; returns its path.
    Keeps the newest `keep_last` checkpoints, so a long run does not fill the disk.

    A failed write raises CheckpointWriteError naming the folder, the free space and the checkpoint that
    stays current."""
    root = Path(ckpt_root)
    try:
        return _save(root, trainer, keep_last)
    except (OSError, SafetensorError, RuntimeError) as err:  # safetensors and torch.save do not raise OSError
        raise _write_error(root, trainer, err) from err


def _write_error(root: Path, trainer, err: Exception) -> CheckpointWriteError:
    try:
        free = free_bytes(root)
    except OSError:
        free = None
    code = getattr(err, "errno", None)
    if code is None:  # "... (os error 28)" from safetensors; nothing at all from torch.save's "file write failed"
        found = re.search(r"os error (\d+)", str(err))
        code = int(found[1]) if found else errno.ENOSPC if free is not None and free < checkpoint_bytes(trainer) \
            else errno.EIO
    pointer = root / LATEST
    current = pointer.read_text().strip() if pointer.is_file() else "none"
    reason = os.strerror(code) if code != errno.EIO else f"{type(err).__name__}: {err}"
    room = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
    return CheckpointWriteError(code, f"cannot write checkpoint step_{trainer.step} in {root}: {reason} ({room});"
                                      f" the previous checkpoint ({current}) is intact and stays current")


def _save(root: Path, trainer, keep_last: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{trainer.step}"
    final = root / name
    config = export_config(
        trainer.arch,
        trainer.parts,
        block_size=trainer.cfg.block_size,
        mask_token_id=trainer.mask_token_id,
        target_layer_ids=trainer.target_layer_ids,
        dtype=trainer.cfg.dtype,
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    stale = None
    try:
        write_export(tmp, trainer.model.state_dict(), config)
        torch.save(trainer.state_dict(), tmp / STATE_FILE)
        _fsync_file(tmp / STATE_FILE)
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. on shutdown right after a periodic save)
            stale = Path(tempfile.mkdtemp(prefix=f".{name}.old.", dir=root))
            os.rename(final, stale / name)
        os.rename(tmp, final)
        _fsync_dir(root)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(name + "\n")
        _fsync_file(pointer)
        os.replace(pointer, root / LATEST)
        _fsync_dir(root)
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
    steps = sorted((int(p.name.removeprefix("step_")), p) for p in root.glob("step_*") if p.name[5:].isdigit())
    for _, old in steps[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    state: dict  # Trainer.state_dict(), tensors on the CPU


def load_latest(ckpt_root: str | Path) -> Checkpoint | None:
    """The checkpoint `latest` points at, or None when there is none yet (a fresh run)."""
    root = Path(ckpt_root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = root / name
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"{pointer} points at {name!r}, but {state_file} does not exist")
    try:
        step = int(name.removeprefix("step_"))
    except ValueError:
        raise ValueError(f"{pointer}: {name!r} is not a step_<N> directory name") from None
    state = torch.load(state_file, map_location="cpu", weights_only=True)
    return Checkpoint(path=path, step=step, state=state)
