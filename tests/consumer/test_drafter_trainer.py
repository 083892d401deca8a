"""The training step engine: learning, frozen target parts, accumulation, schedule, resume, non-finite."""

from __future__ import annotations

import logging

import pytest
import torch

from common.profile import ProfileStats
from consumer.checkpoint import load_latest, save_checkpoint
from consumer.trainer import NonFiniteTrainingError, SkipCounters, SkipCounts, Trainer, lr_factor
from tests.consumer.test_drafter_common import (
    LAYER_IDS,
    drafter_cfg,
    parts_and_batch,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target on disk, its parts, and one packed batch of two sequences with their features."""
    return parts_and_batch(tmp_path_factory.mktemp("target"), [40, 56])


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_overfits_one_batch(setup):
    """Anchors are resampled every step; the drafter learns the batch by heart: the loss falls below
    10% of its first value and slot-1 accuracy passes 90%."""
    parts, batch = setup
    trainer = Trainer(drafter_cfg(), parts, LAYER_IDS, "cpu")
    history = [trainer.train_batch(*batch, seq=i) for i in range(120)]
    first = history[0]["loss"]
    last = sum(h["loss"] for h in history[-10:]) / 10
    acc1 = sum(h["acc_slot_1"] for h in history[-10:]) / 10
    assert last < 0.1 * first, (first, last)
    assert acc1 > 0.9, acc1
    assert history[-1]["tau_est"] > 3.0  # B = 4: most blocks fully right
    assert set(history[-1]) >= {
        "loss",
        "lr",
        "grad_norm",
        "acc_slot_1",
        "acc_slot_3",
        "tau_est",
        "tokens",
        "steps",
        "nonfinite_skipped",
    }
    assert all(type(v) is float for v in history[-1].values())


def test_frozen_parts_stay_bit_identical(setup):
    parts, batch = setup
    trainer = Trainer(drafter_cfg(), parts, LAYER_IDS, "cpu")
    embed, head = trainer.model.embed_tokens.clone(), trainer.model.lm_head.clone()
    before = params(trainer)
    for i in range(3):
        trainer.train_batch(*batch, seq=i)
    assert torch.equal(trainer.model.embed_tokens, embed) and torch.equal(trainer.model.lm_head, head)
    assert torch.equal(embed, parts.embed_tokens) and torch.equal(head, parts.lm_head)
    assert all(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # all trained


def test_accumulates_until_tokens_per_step(setup):
    parts, batch = setup
    T = batch[1].numel()
    prof = ProfileStats()
    trainer = Trainer(drafter_cfg(tokens_per_step=2 * T), parts, LAYER_IDS, "cpu", prof=prof)
    before = params(trainer)
    assert trainer.train_batch(*batch, seq=0) is None
    assert trainer.step == 0 and all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    metrics = trainer.train_batch(*batch, seq=1)
    assert trainer.step == 1 and trainer.last_seq == 1 and metrics["steps"] == 1.0
    assert metrics["tokens"] == 2 * T
    snap = prof.snapshot()
    assert snap["counters"]["tokens"] == 2 * T and snap["counters"]["anchors"] == 2 * 2 * 8


@pytest.mark.parametrize(("normaliser", "want"), [("anchors", 2 * 8), ("sequences", 2)])
def test_dpace_normaliser_is_what_the_step_divides_by(setup, normaliser, want):
    """One batch of two sequences, 8 anchors each: the step's pending divisor is 16 anchors or 2 sequences,
    and the logged loss is Σ w·CE over it, so the two differ by exactly that ratio on the same anchors."""
    parts, batch = setup
    trainer = Trainer(
        drafter_cfg(loss="dpace", dpace_normaliser=normaliser, tokens_per_step=2 * batch[1].numel()),
        parts,
        LAYER_IDS,
        "cpu",
    )
    assert trainer.train_batch(*batch, seq=0) is None  # accumulating: nothing divided yet
    assert float(trainer._pending_weight) == want
    loss_sum = float(trainer._pending_loss)
    assert trainer.metrics.read()["loss"] == pytest.approx(loss_sum / want, rel=1e-6)


def test_lr_schedule():
    f = dict(total_steps=100, warmup_frac=0.1, min_lr_ratio=0.1)
    assert lr_factor(0, **f) == pytest.approx(0.1)
    assert lr_factor(9, **f) == pytest.approx(1.0)
    assert lr_factor(10, **f) == pytest.approx(1.0)
    assert lr_factor(55, **f) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(100, **f) == pytest.approx(0.1) and lr_factor(500, **f) == pytest.approx(0.1)


def test_resume_is_bit_identical(setup, tmp_path):
    """k batches, checkpoint, a fresh Trainer resumes from it, more batches: the same weights, optimizer
    state and anchors as an uninterrupted run."""
    parts, batch = setup
    cfg = drafter_cfg(warmup_frac=0.2, total_steps=8)

    def run(trainer, seqs):
        return [trainer.train_batch(*batch, seq=s)["loss"] for s in seqs]

    straight = Trainer(cfg, parts, LAYER_IDS, "cpu")
    want = run(straight, range(6))
    first = Trainer(cfg, parts, LAYER_IDS, "cpu")
    got = run(first, range(3))
    save_checkpoint(tmp_path, first)
    resumed = Trainer(cfg, parts, LAYER_IDS, "cpu")
    resumed.load_state_dict(load_latest(tmp_path).state)
    assert resumed.last_seq == 2 and resumed.step == 3
    got += run(resumed, range(3, 6))
    assert got == want
    for (k, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    sa, sb = straight.optimizer.state_dict(), resumed.optimizer.state_dict()
    for i in sa["state"]:
        for key in sa["state"][i]:
            assert torch.equal(sa["state"][i][key], sb["state"][i][key])
    assert straight.scheduler.get_last_lr() == resumed.scheduler.get_last_lr()


def test_state_is_that_of_the_last_completed_step(setup):
    """Batches accumulated since the last step are not in the state: resume replays them."""
    parts, batch = setup
    T = batch[1].numel()
    trainer = Trainer(drafter_cfg(tokens_per_step=2 * T), parts, LAYER_IDS, "cpu")
    for s in range(3):
        trainer.train_batch(*batch, seq=s)
    state = trainer.state_dict()
    assert state["step"] == 1 and state["last_seq"] == 1
    replay = Trainer(drafter_cfg(tokens_per_step=2 * T), parts, LAYER_IDS, "cpu")
    replay.load_state_dict(state)
    for s in (2, 3):
        replay.train_batch(*batch, seq=s)
    trainer.train_batch(*batch, seq=3)
    assert all(
        torch.equal(a, b)
        for a, b in zip(trainer.model.state_dict().values(), replay.model.state_dict().values(), strict=True)
    )


def test_nonfinite_steps_are_skipped_then_stop_the_run(setup, caplog):
    parts, (hidden, ids, mask, cu) = setup
    bad = hidden.clone()
    bad[5, 3] = float("nan")  # one poisoned feature row, as a broken producer would send
    trainer = Trainer(drafter_cfg(max_nonfinite_steps=3), parts, LAYER_IDS, "cpu")
    trainer.train_batch(hidden, ids, mask, cu, seq=0)
    before = params(trainer)
    opt_before = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    with caplog.at_level(logging.WARNING, logger="consumer.trainer"):
        m = trainer.train_batch(bad, ids, mask, cu, seq=1)
    assert m["nonfinite_skipped"] == 1.0 and "seq 1" in caplog.text
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # no update
    assert all(torch.equal(opt_before[k], v) for k, v in trainer.optimizer.state_dict()["state"][0].items())
    assert trainer.train_batch(hidden, ids, mask, cu, seq=2)["nonfinite_skipped"] == 1.0  # recovers
    assert all(torch.isfinite(v).all() for v in trainer.model.state_dict().values())
    trainer.train_batch(bad, ids, mask, cu, seq=3)
    trainer.train_batch(bad, ids, mask, cu, seq=4)  # two in a row: still under the limit
    with pytest.raises(NonFiniteTrainingError, match=r"3 optimizer steps in a row.*seq 3 to seq 5.*producer"):
        trainer.train_batch(bad, ids, mask, cu, seq=5)


def test_nonfinite_limit_is_checked_on_log_steps(setup):
    """No device sync between log steps: a run of bad steps is caught at the next log step."""
    parts, (hidden, ids, mask, cu) = setup
    bad = hidden.clone()
    bad[0, 0] = float("inf")
    trainer = Trainer(drafter_cfg(max_nonfinite_steps=2, log_every=4), parts, LAYER_IDS, "cpu")
    trainer.train_batch(hidden, ids, mask, cu, seq=0)
    trainer.train_batch(bad, ids, mask, cu, seq=1)
    trainer.train_batch(bad, ids, mask, cu, seq=2)  # the run reaches the limit here, unread
    with pytest.raises(NonFiniteTrainingError, match="seq 1 to seq 2"):
        trainer.train_batch(hidden, ids, mask, cu, seq=3)  # step 4: a log step


def test_skip_counters_count_runs_and_restart_the_window_at_each_read():
    """The named skip counters (one int64 device tensor): totals, the current run, the longest run since the
    last read, and the seqs where the current run began and the latest skip was."""
    counters = SkipCounters(torch.device("cpu"))
    for seq, bad in [(10, True), (11, True), (12, False), (13, True)]:
        counters.update(torch.tensor(bad), seq)
    assert counters.read() == SkipCounts(skipped=3, run=1, longest=2, first_seq=13, last_seq=13)
    counters.update(torch.tensor(False), 14)
    assert counters.read() == SkipCounts(skipped=3, run=0, longest=1, first_seq=13, last_seq=13)  # window restarted
    counters.restart(5)
    assert counters.skipped() == 5 and counters.read() == SkipCounts(5, 0, 0, 0, 0)


def test_bad_shapes_and_cpu_flex_are_clear_errors(setup):
    parts, (hidden, ids, mask, cu) = setup
    trainer = Trainer(drafter_cfg(), parts, LAYER_IDS, "cpu")
    with pytest.raises(ValueError, match="batch seq 7: hidden has shape"):
        trainer.train_batch(hidden[:, :64], ids, mask, cu, seq=7)
    with pytest.raises(ValueError, match="flex"):
        Trainer(drafter_cfg(attention="flex"), parts, LAYER_IDS, "cpu")
