"""Checkpoints never load silently broken: the manifest, the fallback to the previous intact checkpoint, the
clear error when none is left, and the exactly-once lineage through a fallback (issue 14 item 7)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.accounting import DeliveryLedger, TrainLedger, ledger_id_of
from common.accounting_check import check_run
from common.checkpoint_pointer import write_pointer
from consumer.checkpoint import (
    MANIFEST,
    STATE_FILE,
    NoIntactCheckpoint,
    load_latest,
    resume_checkpoint,
    save_checkpoint,
    write_checkpoint,
    write_manifest,
)
from consumer.checkpoint_state import Restored, checkpoint_state, restore
from consumer.export.layout import drafter_shape, trainer_export_config
from consumer.group_cursor import GroupCursor
from consumer.shape import ShapeMismatch, check_shape
from consumer.target_parts import load_target_parts
from consumer.trainer import NonFiniteCheckpointError, NonFiniteTrainingError, Trainer
from tests.consumer.test_drafter_common import (
    LAYER_IDS,
    distinct_seqs,
    drafter_cfg,
    packed,
    target_features,
    tiny_target,
)
from tests.jobs import tiny_assets, write_job

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    model = tiny_target(path)
    seqs = distinct_seqs([30, 26])
    return load_target_parts(path), (target_features(model, seqs), *packed(seqs))


def _trainer(setup, **cfg) -> Trainer:
    return Trainer(drafter_cfg(**cfg), setup[0], LAYER_IDS, "cpu")


def _two_checkpoints(setup, root: Path) -> tuple[Path, Path, Trainer]:
    """step_1 and step_2 of one trainer, both intact; returns (older, newer, trainer)."""
    trainer = _trainer(setup)
    trainer.train_batch(*setup[1], seq=0)
    older = save_checkpoint(root, trainer)
    trainer.train_batch(*setup[1], seq=1)
    newer = save_checkpoint(root, trainer)
    return older, newer, trainer


def test_manifest_is_written_last_and_lists_every_file(setup, tmp_path):
    _, newer, _ = _two_checkpoints(setup, tmp_path)
    manifest = json.loads((newer / MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["config.json", "dflash.py", "model.safetensors", STATE_FILE]
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (newer / name).stat().st_size and len(entry["xxh3_128"]) == 32
    newest = max(newer.iterdir(), key=lambda p: p.stat().st_mtime_ns)
    assert newest.name == MANIFEST
    assert load_latest(tmp_path).path == newer and load_latest(tmp_path).skipped == ()


def test_truncated_trainer_state_falls_back_to_the_previous_checkpoint(setup, tmp_path, caplog):
    older, newer, _ = _two_checkpoints(setup, tmp_path)
    state = newer / STATE_FILE
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    with caplog.at_level(logging.INFO):
        got = load_latest(tmp_path)
    assert got.path == older and got.step == 1 and got.state["step"] == 1 and got.skipped == (newer,)
    assert f"checkpoint {newer} is not used: {state} has" in caplog.text and "(truncated?)" in caplog.text
    assert f"resuming from the previous intact checkpoint {older} (step 1) instead of step_2" in caplog.text


def test_truncated_trainer_state_with_a_matching_manifest_names_the_file(setup, tmp_path, caplog):
    """Torn after the manifest was made (or the manifest rewritten): torch.load's error carries the file name."""
    older, newer, _ = _two_checkpoints(setup, tmp_path)
    state = newer / STATE_FILE
    state.write_bytes(state.read_bytes()[:1000])
    write_manifest(newer, ("config.json", "model.safetensors", "dflash.py", STATE_FILE))
    assert load_latest(tmp_path).path == older
    assert f"{state} cannot be read:" in caplog.text


def test_non_finite_weights_fall_back_and_are_never_blamed_on_the_producer(setup, tmp_path, caplog):
    older, _, trainer = _two_checkpoints(setup, tmp_path)
    with torch.no_grad():
        trainer.model.fc.weight[0, 0] = float("nan")  # a diverged run, saved with a matching manifest
    trainer.step += 1
    poisoned = save_checkpoint(tmp_path, trainer)
    caplog.clear()
    got = load_latest(tmp_path)
    assert got.path == older.parent / "step_2" and poisoned in got.skipped
    assert "non-finite weights['fc.weight'] (1 of" in caplog.text and "producer" not in caplog.text
    # loaded anyway (by hand), the trainer says so at load, naming where it came from
    fresh = _trainer(setup)
    state = torch.load(poisoned / STATE_FILE, weights_only=True)
    with pytest.raises(NonFiniteCheckpointError, match=rf"weights loaded from {poisoned} are non-finite \(fc.weight\)"):
        fresh.load_state_dict(state, str(poisoned))


def test_training_on_non_finite_weights_blames_the_weights(setup):
    """If weights do go non-finite, the error after max_nonfinite_steps says so instead of blaming the batches."""
    trainer = _trainer(setup, max_nonfinite_steps=2)
    with torch.no_grad():
        trainer.model.fc.weight.fill_(float("inf"))
    with pytest.raises(NonFiniteTrainingError) as err:
        for s in range(3):
            trainer.train_batch(*setup[1], seq=s)
    assert "The drafter's own weights are non-finite (fc.weight" in str(err.value)
    assert "hidden states from the producer" not in str(err.value)


def test_non_finite_batches_still_blame_the_batches(setup):
    trainer = _trainer(setup, max_nonfinite_steps=2)
    hidden, *rest = setup[1]
    with pytest.raises(NonFiniteTrainingError, match="The weights are finite, so the batches are"):
        for s in range(3):
            trainer.train_batch(torch.full_like(hidden, float("nan")), *rest, seq=s)


def test_manifest_mismatch_falls_back(setup, tmp_path, caplog):
    older, newer, _ = _two_checkpoints(setup, tmp_path)
    export = newer / "model.safetensors"
    data = bytearray(export.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    export.write_bytes(bytes(data))
    assert load_latest(tmp_path).path == older
    assert f"{export} does not match its xxh3_128 digest in {MANIFEST}" in caplog.text


def test_missing_manifest_falls_back(setup, tmp_path, caplog):
    older, newer, _ = _two_checkpoints(setup, tmp_path)
    (newer / MANIFEST).unlink()
    assert load_latest(tmp_path).path == older
    assert f"{newer / MANIFEST} is missing" in caplog.text


def test_latest_naming_a_missing_directory_falls_back(setup, tmp_path):
    _, newer, _ = _two_checkpoints(setup, tmp_path)
    write_pointer(tmp_path, "step_99")
    assert load_latest(tmp_path).path == newer


def test_all_corrupt_is_a_clear_error_naming_the_folder(setup, tmp_path):
    older, newer, _ = _two_checkpoints(setup, tmp_path)
    for ck in (older, newer):
        (ck / STATE_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(
        NoIntactCheckpoint,
        match=rf"no intact checkpoint in {tmp_path}: {older / STATE_FILE}|"
        rf"no intact checkpoint in {tmp_path}: {newer / STATE_FILE}",
    ) as err:
        load_latest(tmp_path)
    assert str(older / STATE_FILE) in str(err.value) and str(newer / STATE_FILE) in str(err.value)


def test_resume_sets_broken_checkpoints_aside_and_repoints_latest(setup, tmp_path):
    older, newer, _ = _two_checkpoints(setup, tmp_path)
    (newer / MANIFEST).unlink()
    assert resume_checkpoint(tmp_path).path == older
    assert os.readlink(tmp_path / "latest") == "step_1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt-step_2", "latest", "step_1"]
    assert load_latest(tmp_path).skipped == ()  # nothing left to fall back past


def test_fallback_keeps_the_exactly_once_lineage(setup, tmp_path):
    """The accounting chain through a fallback: the broken step_4 leaves the lineage, its seqs are trained
    again once from step_2, and the checker passes (before the retraining too: `latest` names step_2)."""
    run, root = tmp_path, tmp_path / "checkpoints" / "d0"
    producer = DeliveryLedger(run, node=0, total_batches=4, epoch_batches=[4], sample_ids=range(8))
    for seq in range(4):
        producer.delivered(seq, 0, [2 * seq, 2 * seq + 1], [("d0", 0, 1)])
    producer.close()
    batch = setup[1]

    def incarnation(trainer, seqs, base):
        ledger = TrainLedger(run, "d0", 0, 1, base=base, base_step=trainer.step)
        cursor = GroupCursor.from_state(trainer.state_dict(), 1, 1, "test") if trainer.step else GroupCursor.fresh(1)
        for pair in seqs:
            for s in pair:
                trainer.train_batch(*batch, seq=s)
                ledger.stepped(trainer.step, [s])
            cursor = cursor.advance({0: list(pair)})
            state = cursor.to_state()
            entry = ledger.checkpoint(
                trainer.step, {0: list(pair)}, state["cursors"], state["trained_above"], producers=state["producers"]
            )
            write_checkpoint(
                root,
                checkpoint_state(trainer.state_dict(), shape=drafter_shape(trainer), cursor=cursor, ledger=entry),
                trainer_export_config(trainer),
            )
            ledger.saved(trainer.step)
        ledger.close()

    incarnation(_trainer(setup), [(0, 1), (2, 3)], None)
    assert check_run(run).ok
    (root / "step_4" / STATE_FILE).write_bytes((root / "step_4" / STATE_FILE).read_bytes()[:4000])
    resumed = resume_checkpoint(root)
    assert resumed.path.name == "step_2" and resumed.state["last_seq"] == 1
    mid = check_run(run)
    assert mid.ok and mid.drafters["d0"].final_checkpoint == "step_2" and not mid.drafters["d0"].complete
    trainer = _trainer(setup)
    trainer.load_state_dict(resumed.state, str(resumed.path))
    incarnation(trainer, [(2, 3)], ledger_id_of(resumed.state))
    final = check_run(run)
    d0 = final.drafters["d0"]
    assert final.ok, (final.errors, d0.errors)
    assert (d0.final_checkpoint, d0.trained_batches, d0.duplicate_batches, d0.complete) == ("step_4", 4, 0, True)
    assert d0.epochs_complete == 1 and d0.lineage_checkpoints == 2


def test_consumer_process_with_no_intact_checkpoint_exits_2_naming_the_folder(tmp_path_factory):
    """The real entry point: one clear line, no traceback, before it ever contacts a producer."""
    job = write_job(tiny_assets(tmp_path_factory.mktemp("assets")))
    root = job.parent / "checkpoints" / "d0" / "step_3"
    root.mkdir(parents=True)
    (root / STATE_FILE).write_bytes(b"\0" * 100)
    (root.parent / "latest").write_text("step_3\n")
    done = subprocess.run(
        [sys.executable, "-m", "consumer", "--job", str(job), "--drafter", "d0", "--profile-interval", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 2, done.stderr
    assert f"no intact checkpoint in {root.parent}: {root / MANIFEST} is missing" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "key, job, was, now",
    [
        ("num_layers", {"num_layers": 2}, 1, 2),
        ("block_size", {"block_size": 8}, 4, 8),
        (
            "layer_types",
            {"layer_types": ["sliding_attention"], "sliding_window": 4},
            ["full_attention"],
            ["sliding_attention"],
        ),
    ],
)
def test_a_changed_drafter_shape_is_one_line_naming_the_key_and_both_values(setup, tmp_path, key, job, was, now):
    """Before: block_size was a ValueError traceback, num_layers torch's raw "Missing key(s) in state_dict"."""
    trainer = _trainer(setup)
    trainer.train_batch(*setup[1], seq=0)
    path = save_checkpoint(tmp_path, trainer)
    state = load_latest(tmp_path).state
    assert state["shape"]["num_layers"] == 1 and state["shape"]["optimizer"] == "AdamW"
    check_shape(state, drafter_shape(_trainer(setup)), "d0", str(path))  # the same shape: nothing to say
    with pytest.raises(ShapeMismatch) as err:
        check_shape(state, drafter_shape(_trainer(setup, **job)), "d0", str(path))
    assert str(err.value) == (
        f"drafter d0: {path} was trained with {key} = {was!r}, this job has {key} = {now!r}"
        f" (drafters.{key}): its weights and optimizer state do not fit; set it back to"
        f" {was!r}, or train the new shape in a new run folder (job.run_dir)"
    )


def test_a_checkpoint_from_before_recorded_shapes_is_checked_against_its_config_json(setup, tmp_path):
    trainer = _trainer(setup)
    trainer.train_batch(*setup[1], seq=0)
    path = save_checkpoint(tmp_path, trainer)
    state = torch.load(path / STATE_FILE, weights_only=True)
    del state["shape"]
    torch.save(state, path / STATE_FILE)
    write_manifest(path, ("config.json", "model.safetensors", "dflash.py", STATE_FILE))
    old = load_latest(tmp_path).state
    assert "optimizer" not in old["shape"] and old["shape"]["num_layers"] == 1  # from config.json
    with pytest.raises(ShapeMismatch, match="was trained with num_layers = 1, this job has num_layers = 2"):
        check_shape(old, drafter_shape(_trainer(setup, num_layers=2)), "d0", str(path))
    check_shape(old, drafter_shape(_trainer(setup)), "d0", str(path))


def test_restore_gives_each_part_its_entries_back(setup):
    """What checkpoint_state put in, restore reads back: the trainer's step and weights, the group cursor, the
    lineages; another data.lineage keeps the weights and starts a fresh cursor; a changed shape is refused
    before any weight is loaded."""
    trainer = _trainer(setup)
    trainer.train_batch(*setup[1], seq=0)
    cursor = GroupCursor(1, ((5,),), (((7,),),))
    state = checkpoint_state(
        trainer.state_dict(),
        shape=drafter_shape(trainer),
        cursor=cursor,
        ledger={"id": "d0:x:1:1", "lineages": ["main"]},
    )
    fresh = _trainer(setup)
    same = restore(state, "step_1", fresh, nnodes=1, producers=1, lineage="main")
    assert same == Restored(cursor, ["main"], True) and fresh.step == 1 and fresh.last_seq == 4
    assert all(torch.equal(a, b) for a, b in zip(fresh.params, trainer.params, strict=True))
    new = restore(state, "step_1", _trainer(setup), nnodes=1, producers=1, lineage="more")
    assert new == Restored(GroupCursor.fresh(1, 1), ["main", "more"], False)
    assert restore(None, "", _trainer(setup), nnodes=2, producers=1, lineage="main") == Restored(
        GroupCursor.fresh(2, 1), ["main"], True
    )
    other = _trainer(setup, num_layers=2)
    with pytest.raises(ShapeMismatch, match="step_1 was trained with num_layers = 1, this job has num_layers = 2"):
        restore(state, "step_1", other, nnodes=1, producers=1, lineage="main")
    assert other.step == 0
