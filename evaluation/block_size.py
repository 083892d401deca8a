"""A drafter drafts correctly only at the block size it was trained with (issue 30 §2): `dflash-eval --block-size`
must equal the export's trained block, else one line and exit 2 (evaluation/cli.py).

Where the trained block is recorded (consumer/export/layout.py writes both places): `dflash_config.block_size`,
which z-lab's and SGLang's readers look at first, then the top-level `block_size` (vLLM's DSpark and SGLang's DSpark
parser); a published config that states neither was trained at 16 (z-lab's and SGLang's default).
"""

from __future__ import annotations

from pathlib import Path

from evaluation.drafter_folder import read_config

DEFAULT_BLOCK_SIZE = 16  # z-lab's and SGLang's reader default


def trained_block_size(config: dict) -> int:
    """The block size an export config.json records (DSpark: the drafted positions, its `block_size`)."""
    inner = config.get("dflash_config") or {}
    value = inner.get("block_size", config.get("block_size"))
    return int(value) if value is not None else DEFAULT_BLOCK_SIZE


def check_block_size(export_dir: str | Path, requested: int | None) -> int:
    """The trained block size of the export in `export_dir`; ValueError (one line naming the file, both sizes)
    when `requested` (the --block-size asked for; None: the trained one) differs from it."""
    file = Path(export_dir) / "config.json"
    trained = trained_block_size(read_config(Path(export_dir)))  # a damaged or foreign config: one line too
    if requested is not None and requested != trained:
        raise ValueError(
            f"--block-size {requested}: {file} was trained at block size {trained}; a drafter served at another"
            f" block size drafts wrong tokens silently, so evaluate it at {trained} (or train one at {requested})"
        )
    return trained
