"""Validation in a group of replicas (issue 22 item 3): the passes reach one replica (rank 1, as the producer
sends each to one), the writer (rank 0) keeps `best`, unsharded and under distributed = "fsdp" (whose
forward is collective: the other replica stands in). Two gloo processes run the real consumer loop over a
scripted stream; the best checkpoint is then evaluated again here, unsharded, on the same held-out batches."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from common.checkpoint_pointer import BEST, read_pointer
from consumer.best_checkpoint import Best, Candidate, decide, vote_row
from consumer.checkpoint import STATE_FILE
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer
from consumer.validation import Evaluator
from tests.consumer.test_drafter_common import (
    LAYER_IDS,
    distinct_seqs,
    drafter_cfg,
    packed,
    target_features,
    tiny_target,
)
from tests.jobs import run_ranks


def test_the_group_decides_best_from_the_writers_record_and_the_latest_pass():
    nan = math.nan
    mine = vote_row(Candidate(3, 12, 2.5, 1.1), None, False)  # rank 1 evaluated pass 3 at step 12
    assert mine[:5] == [1.0, 3, 12, 2.5, 1.1] and math.isnan(mine[5]) and mine[6] == 0.0
    writer = vote_row(None, Best("step_8", 8, 2.0, 1.3, 2), True)  # the writer's record: τ 2.0; step 12 saved
    assert writer == [0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 1.0]
    assert decide([writer, mine]) == (Candidate(3, 12, 2.5, 1.1), False)  # saved already: no second save
    unsaved = vote_row(None, Best("step_8", 8, 2.0, 1.3, 2), False)
    assert decide([unsaved, mine]) == (Candidate(3, 12, 2.5, 1.1), True)
    assert decide([unsaved, vote_row(Candidate(3, 12, 2.0, 1.0), None, False)]) is None  # a tie keeps the earlier
    assert decide([unsaved, vote_row(Candidate(3, 12, nan, 1.0), None, False)]) is None  # NaN never counts
    assert decide([unsaved, vote_row(None, None, False)]) is None  # nobody completed a pass
    fresh = vote_row(None, None, False)  # no record yet: any finite τ is the best
    assert decide([fresh, vote_row(Candidate(1, 4, 1.01, 5.0), None, False)]) == (Candidate(1, 4, 1.01, 5.0), True)
    assert decide([fresh, vote_row(Candidate(1, 0, 3.0, 5.0), None, False)]) is None  # untrained weights
    # two replicas holding passes (a re-formed group): the latest pass decides, whatever the rank order
    two = [vote_row(Candidate(4, 9, 1.5, 1.0), None, False), vote_row(Candidate(5, 9, 1.2, 1.0), None, False)]
    assert decide(two) == (Candidate(5, 9, 1.2, 1.0), True)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("valgroup")
    model = tiny_target(tmp / "target")

    def batch(lengths, seed):
        seqs = distinct_seqs(lengths, seed=seed)
        return (target_features(model, seqs), *packed(seqs))

    v0, v1 = batch([40, 24], 20), batch([48], 21)
    batches = {"train": [v0, v1], "v0": v0, "v1": v1}  # trained on what is evaluated: τ moves within 12 steps
    torch.save(batches, tmp / "batches.pt")
    run_ranks(
        lambda rank, port: [
            "-m",
            "tests.procs.validation_group_worker",
            tmp / "target",
            tmp / "batches.pt",
            tmp,
            rank,
            2,
            port,
        ]
    )
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(2)]
    return tmp, batches, ranks


def reevaluate(tmp: Path, batches: dict, step_dir: Path) -> float:
    """The held-out τ of a saved checkpoint's weights, unsharded, in this process (the worker's drafter)."""
    trainer = Trainer(
        drafter_cfg(num_layers=2, anchors_per_seq=32), load_target_parts(tmp / "target"), LAYER_IDS, "cpu"
    )
    trainer.model.load_state_dict(torch.load(step_dir / STATE_FILE, weights_only=True)["model"])
    evaluator = Evaluator(trainer)
    evaluator.add(*batches["v0"], sample_ids=[100], validation=(1, 0, 2))
    return evaluator.add(*batches["v1"], sample_ids=[101], validation=(1, 1, 2)).metrics["tau_est"]


STEPS_OF_PASSES = {  # rank 1's passes follow its batches 2, 5, 7, 9 and 12 (of 12 rounds)
    "ddp": [(1, 2), (2, 5), (3, 7), (4, 9), (5, 12)],
    "fsdp": [(1, 2), (2, 5), (3, 7), (4, 9), (5, 12)],
    "fsdp_accum": [(1, 1), (2, 2), (3, 3), (4, 4), (5, 6)],  # a step every two rounds: passes 2-4 mid-step
}


@pytest.mark.parametrize("mode", list(STEPS_OF_PASSES))
def test_the_writer_keeps_the_best_of_passes_another_replica_evaluated(run, mode):
    tmp, batches, ranks = run
    writer, holder = ranks[0][mode], ranks[1][mode]
    assert writer["holds_record"] and not holder["holds_record"]
    assert writer["passes"] == []  # rank 0 never saw a validation batch: it stood in
    assert [(p["pass"], p["step"]) for p in holder["passes"]] == STEPS_OF_PASSES[mode]
    assert writer["steps"] == holder["steps"] == STEPS_OF_PASSES[mode][-1][1]
    taus = [p["tau_est"] for p in holder["passes"]]
    assert all(math.isfinite(t) and t >= 1.0 for t in taus)
    won = holder["passes"][taus.index(max(taus))]  # the first of the highest: a tie keeps the earlier
    root = tmp / mode / "checkpoints" / "d0"
    record = json.loads((root / "best.json").read_text())
    assert record == {
        "checkpoint": f"step_{won['step']}",
        "step": won["step"],
        "tau": won["tau_est"],
        "loss": won["loss"],
        "pass": won["pass"],
    }
    assert read_pointer(root, BEST) == f"step_{won['step']}"
    # the checkpoint `best` names holds the weights that pass evaluated
    again = reevaluate(tmp, batches, root / "best")
    if mode == "ddp":
        assert again == won["tau_est"]
    else:  # the sharded forward all-gathers the same weights; sums may round differently
        assert again == pytest.approx(won["tau_est"], rel=1e-5)


def test_a_best_saved_inside_an_open_fsdp_step_holds_the_weights_that_pass_evaluated(run):
    """fsdp_accum: passes 3 and 4 beat the best while their step's batches were deferred (FSDP runs them at
    the step); the collective save there wrote the last completed step's weights, the ones evaluated."""
    tmp, batches, ranks = run
    passes = {p["pass"]: p for p in ranks[1]["fsdp_accum"]["passes"]}
    assert passes[4]["tau_est"] > max(passes[p]["tau_est"] for p in (1, 2, 3))  # pass 4 was a new best
    step_dir = tmp / "fsdp_accum" / "checkpoints" / "d0" / f"step_{passes[4]['step']}"
    assert reevaluate(tmp, batches, step_dir) == pytest.approx(passes[4]["tau_est"], rel=1e-5)
