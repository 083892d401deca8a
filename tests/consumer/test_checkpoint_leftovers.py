"""What kills leave in a checkpoint folder (issue 36 §3) and a `best` whose checkpoint is broken (§5): put back
or removed at resume, each said in a line; other files and other drafters' folders untouched."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from common.checkpoint_pointer import BEST, read_pointer
from common.storage import check_writable
from consumer.best_checkpoint import RECORD, BestCheckpoint, settle_best
from consumer.checkpoint import STATE_FILE, NoIntactCheckpoint, resume_checkpoint, save_checkpoint
from consumer.trainer import Trainer
from tests.consumer.test_drafter_common import (
    LAYER_IDS,
    drafter_cfg,
    parts_and_batch,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return parts_and_batch(tmp_path_factory.mktemp("target"), [30, 26])


def _two(setup, root: Path) -> tuple[Path, Path]:
    """step_1 and step_2 of one trainer, both intact."""
    trainer = Trainer(drafter_cfg(num_layers=1), setup[0], LAYER_IDS, "cpu")
    trainer.train_batch(*setup[1], seq=0)
    older = save_checkpoint(root, trainer)
    trainer.train_batch(*setup[1], seq=1)
    return older, save_checkpoint(root, trainer)


def _truncate(ckpt: Path) -> None:
    state = ckpt / STATE_FILE
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])


def test_each_kind_of_leftover_is_removed_at_resume_and_said_and_nothing_else(setup, tmp_path, caplog):
    root = tmp_path / "checkpoints" / "d0"
    _, newer = _two(setup, root)
    killed = root / ".step_3.k1ll3d_x"  # a write killed before its rename: a whole checkpoint's files
    shutil.copytree(newer, killed)
    aside = root / ".step_2.old.ab12cd34"  # step_2 saved again, killed after the new copy took the name
    shutil.copytree(newer, aside / "step_2")
    (root / ".write-probe-0a1b2c3d").write_bytes(b"x")
    os.symlink("step_2", root / ".latest.tmp")
    (root / ".best.json.tmp").write_text("{}")
    others = [root / "notes.txt", root / ".step_2.keep", root / "corrupt-step_0", tmp_path / "checkpoints" / "d1"]
    others[0].write_text("mine")
    others[1].write_text("not a mkdtemp name")
    others[2].mkdir()
    (others[3] / ".step_5.ab12cd34").mkdir(parents=True)  # another drafter's folder: its own writer's business
    expected = sum(f.stat().st_size for d in (killed, aside) for f in d.rglob("*") if f.is_file()) + 1 + 2
    with caplog.at_level(logging.INFO):
        got = resume_checkpoint(root)
    assert got.path == newer and got.skipped == ()
    kept = [".step_2.keep", "corrupt-step_0", "latest", "notes.txt", "step_1", "step_2"]
    assert sorted(p.name for p in root.iterdir()) == kept
    assert all(p.exists() for p in others) and (others[3] / ".step_5.ab12cd34").is_dir()
    line = next(r.getMessage() for r in caplog.records if "leftover" in r.getMessage())
    assert line.startswith(f"removed 5 leftover(s) of interrupted checkpoint writes from {root} (")
    assert f"({expected / 2**20:.1f} MiB freed)" in line
    for name in (".best.json.tmp", ".latest.tmp", ".step_2.old.ab12cd34", ".step_3.k1ll3d_x", ".write-probe-0a1b2c3d"):
        assert name in line


def test_an_aside_copy_whose_step_is_missing_is_put_back_and_resumed(setup, tmp_path, caplog):
    """Killed between the two renames of a step saved again: `latest -> step_2` names nothing, the previous
    copy sits aside and the new one under its temporary name. The aside copy is the one resumed."""
    root = tmp_path / "ck"
    _, newer = _two(setup, root)
    aside = root / ".step_2.old.ab12cd34"
    aside.mkdir()
    os.rename(newer, aside / "step_2")
    (root / ".step_2.zz99yy88").mkdir()
    with caplog.at_level(logging.INFO):
        got = resume_checkpoint(root)
    assert got.path == newer and got.step == 2 and got.skipped == ()
    assert "put step_2 back from .step_2.old.ab12cd34: a write of the same step was killed" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2"]


def test_leftovers_stay_when_no_checkpoint_is_intact(setup, tmp_path):
    """Nothing to resume from: a temporary may be what a recovery by hand needs."""
    root = tmp_path / "ck"
    older, newer = _two(setup, root)
    _truncate(older)
    _truncate(newer)
    (root / ".step_3.ab12cd34").mkdir()
    with pytest.raises(NoIntactCheckpoint):
        resume_checkpoint(root)
    assert (root / ".step_3.ab12cd34").is_dir()


def test_a_stale_write_probe_is_removed_a_fresh_one_is_another_process_s(tmp_path, caplog):
    stale, fresh = tmp_path / ".write-probe-00000001", tmp_path / ".write-probe-00000002"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    past = time.time() - 120
    os.utime(stale, (past, past))
    with caplog.at_level(logging.INFO):
        check_writable(tmp_path, "run folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == [fresh.name]
    assert f"removed 1 write probe(s) left in {tmp_path} by killed processes: {stale.name}" in caplog.text


def _record_best(root: Path, name: str, tau: float) -> None:
    BestCheckpoint(root).record(name, int(name[5:]), tau, 1.0, 1)


def test_a_truncated_best_is_set_aside_and_removed_not_announced(setup, tmp_path, caplog):
    root = tmp_path / "ck"
    older, newer = _two(setup, root)
    _record_best(root, "step_1", 1.0)
    _truncate(older)
    got = resume_checkpoint(root)  # `latest` (step_2) is intact: resume does not read step_1
    assert got.path == newer
    settle_best(root, got.path)
    assert read_pointer(root, BEST) is None and not (root / RECORD).exists()
    assert (root / "corrupt-step_1").is_dir() and not older.exists()
    assert f"the best checkpoint {older}, held-out τ 1.000 at step 1 is not usable: {older / STATE_FILE} has" in (
        caplog.text
    )
    assert "set aside as corrupt-step_1. `best` and best.json removed: the next whole held-out pass" in caplog.text
    assert BestCheckpoint(root).best is None  # nothing for job_validation to announce


def test_a_best_set_aside_by_resume_s_fallback_is_removed_and_said(setup, tmp_path, caplog):
    root = tmp_path / "ck"
    older, newer = _two(setup, root)
    _record_best(root, "step_2", 1.5)
    _truncate(newer)
    got = resume_checkpoint(root)
    assert got.path == older and (root / "corrupt-step_2").is_dir()
    assert read_pointer(root, BEST) == "step_2"  # dangling, until settled
    settle_best(root, got.path)
    assert read_pointer(root, BEST) is None and not (root / RECORD).exists()
    assert f"the best checkpoint {newer}, held-out τ 1.500 at step 2 is not usable: it is gone (set aside as" in (
        caplog.text
    )


def test_an_intact_best_is_kept(setup, tmp_path):
    root = tmp_path / "ck"
    _, newer = _two(setup, root)
    _record_best(root, "step_1", 1.25)
    settle_best(root, newer)
    assert read_pointer(root, BEST) == "step_1"
    assert json.loads((root / RECORD).read_text())["tau"] == 1.25
    assert BestCheckpoint(root).best.tau == 1.25
