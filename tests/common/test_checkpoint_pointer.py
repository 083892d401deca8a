"""`latest` is a loadable directory (a relative symlink, replaced atomically); old text pointers still read."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

from common.accounting_check import final_ledger_id
from common.checkpoint_pointer import read_pointer, write_pointer
from consumer.checkpoint import load_latest, save_checkpoint
from consumer.trainer import Trainer
from evaluation.evaluate import resolve_export_dir
from tests.consumer.test_drafter_common import (
    LAYER_IDS,
    drafter_cfg,
    parts_and_batch,
)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    parts, batch = parts_and_batch(tmp_path_factory.mktemp("target"), [20, 18])
    trainer = Trainer(drafter_cfg(num_layers=1), parts, LAYER_IDS, "cpu")
    trainer.train_batch(*batch, seq=0)
    return trainer


def test_latest_is_a_relative_symlink_that_from_pretrained_loads(trainer, tmp_path):
    ckpt = save_checkpoint(tmp_path, trainer)
    latest = tmp_path / "latest"
    assert latest.is_symlink() and os.readlink(latest) == "step_1" and latest.resolve() == ckpt
    model = transformers.AutoModel.from_pretrained(
        str(latest), trust_remote_code=True, local_files_only=True, dtype=torch.float32
    )
    assert type(model).__name__ == "DFlashDraftModel"
    want = load_file(ckpt / "model.safetensors")["fc.weight"].float()
    assert torch.equal(model.state_dict()["fc.weight"], want) and want.abs().sum() > 0
    # relative: the run folder moved elsewhere still resolves
    moved = tmp_path.parent / f"{tmp_path.name}-moved"
    tmp_path.rename(moved)
    assert (moved / "latest" / "config.json").is_file()
    assert load_latest(moved).path == moved / "step_1"
    assert resolve_export_dir(moved) == moved / "step_1"


def test_an_old_text_pointer_is_read_and_the_next_save_makes_it_a_symlink(trainer, tmp_path):
    ckpt = save_checkpoint(tmp_path, trainer)
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").write_text("step_1\n")  # the layout of runs written before the symlink
    assert read_pointer(tmp_path) == "step_1"
    assert load_latest(tmp_path).path == ckpt and resolve_export_dir(tmp_path) == ckpt
    assert final_ledger_id(tmp_path)[1:] == (1, "step_1")
    trainer.step += 1
    try:
        save_checkpoint(tmp_path, trainer)
    finally:
        trainer.step -= 1
    assert (tmp_path / "latest").is_symlink() and read_pointer(tmp_path) == "step_2"
    assert final_ledger_id(tmp_path)[1:] == (2, "step_2")


def test_write_pointer_replaces_atomically_and_survives_a_leftover_temp(tmp_path):
    for name in ("step_1", "step_2"):
        (tmp_path / name).mkdir()
    assert read_pointer(tmp_path) is None and read_pointer(tmp_path, "best") is None
    write_pointer(tmp_path, "step_1")
    os.symlink("step_9", tmp_path / ".latest.tmp")  # a write killed between its two steps
    write_pointer(tmp_path, "step_2")
    write_pointer(tmp_path, "step_1", "best")
    assert (read_pointer(tmp_path), read_pointer(tmp_path, "best")) == ("step_2", "step_1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "latest", "step_1", "step_2"]
    with pytest.raises(ValueError, match=r"checkpoint pointer latest: '\.\./x' is not a sibling"):
        write_pointer(tmp_path, "../x")
