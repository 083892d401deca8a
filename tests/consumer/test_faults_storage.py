"""A full disk, a read-only run folder, no room in shared memory: clear errors at start or at the failing write,
and the previous checkpoint stays intact. Real small tmpfs mounts (root only; skipped otherwise)."""

import errno
import uuid

import pytest
import torch

from bench.harness import write_job
from bench.soak_faults import fill, unfill
from common.ring import RingError, SlotRing
from common.storage import StorageError, check_room, check_writable
from consumer.checkpoint import CheckpointWriteError, checkpoint_bytes, load_latest, save_checkpoint
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer
from tests.consumer.test_drafter_common import (
    LAYER_IDS,
    distinct_seqs,
    drafter_cfg,
    packed,
    target_features,
    tiny_target,
)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    model = tiny_target(path)
    seqs = distinct_seqs([30, 26])
    batch = (target_features(model, seqs), *packed(seqs))
    t = Trainer(drafter_cfg(num_layers=1), load_target_parts(path), LAYER_IDS, "cpu")
    t.train_batch(*batch, seq=0)
    t.batch = batch
    return t


def test_read_only_run_folder_is_a_clear_error_at_start(tmpfs):
    ro = tmpfs(1024, read_only=True)
    with pytest.raises(
        StorageError, match=r"run folder .*/mnt0/run is not writable: the file system is mounted read-only"
    ):
        check_writable(ro / "run", "run folder")


def test_producer_refuses_a_read_only_run_folder_before_loading_anything(tmpfs, tmp_path, caplog):
    from producer.__main__ import main

    ro = tmpfs(1024, read_only=True)
    job = tmp_path / "job.toml"
    write_job(
        job,
        {
            "job": {"run_dir": f"{ro}/run"},
            "target": {"path": "nowhere"},
            "data": {"path": "nowhere"},
            "drafters": [{"name": "d0"}],
        },
    )
    assert main(["--job", str(job)]) == 2
    assert "is not writable: the file system is mounted read-only" in caplog.text


def test_too_little_room_for_a_checkpoint_names_both_sizes(tmpfs, trainer):
    small = tmpfs(512)
    need = checkpoint_bytes(trainer)
    with pytest.raises(StorageError, match=r"has 0\.5 MiB free but needs about \d+\.\d MiB"):
        check_room(small / "checkpoints" / "d0", need, "checkpoint folder")


def test_checkpoint_estimate_covers_a_real_checkpoint(tmp_path, trainer):
    path = save_checkpoint(tmp_path, trainer)
    actual = sum(f.stat().st_size for f in path.iterdir())
    assert actual <= checkpoint_bytes(trainer) <= 4 * actual + (1 << 20)


def test_a_full_disk_fails_the_write_clearly_and_keeps_the_previous_checkpoint(tmpfs, trainer):
    root = tmpfs(16 * 1024) / "d0"
    first = save_checkpoint(root, trainer)
    saved = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train_batch(*trainer.batch, seq=1)
    fill(root.parent, leave_bytes=16 * 1024)
    try:
        with pytest.raises(CheckpointWriteError) as failed:
            save_checkpoint(root, trainer)
    finally:
        unfill(root.parent)
    assert failed.value.errno == errno.ENOSPC
    assert f"cannot write checkpoint step_{trainer.step} in {root}: No space left on device" in str(failed.value)
    assert f"the previous checkpoint ({first.name}) is intact" in str(failed.value)
    assert sorted(p.name for p in root.iterdir()) == ["latest", first.name]  # no half-written temp folder
    current = load_latest(root)
    assert current.path == first
    for k, v in saved.items():
        assert torch.equal(current.state["model"][k], v)
    assert save_checkpoint(root, trainer).name == f"step_{trainer.step}"  # room again: saving works


def test_no_room_in_shared_memory_fails_the_ring_at_create(tmpfs):
    shm = tmpfs(1024)
    with pytest.raises(RingError, match=r"has 1\.0 MiB free but the ring needs 4\.0 MiB.*--shm-size"):
        SlotRing.create("cpu", 4, 1 << 20, name=f"full-{uuid.uuid4().hex[:8]}", shm_dir=str(shm))
    assert list(shm.iterdir()) == []
