"""Validation during training (data.validation): the held-out split, its audit, forward-only evaluation that
leaves training bit-identical, and the best checkpoint (consumer/best_checkpoint.py)."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
import torch

from common.accounting import DeliveryLedger, TrainLedger, sample_digest
from common.accounting_check import read_records
from common.accounting_validation import check_validation, held_out_curve
from common.checkpoint_pointer import BEST, read_pointer
from common.config import ConfigError, parse_job
from consumer.best_checkpoint import BestCheckpoint
from consumer.checkpoint import write_checkpoint
from consumer.distributed import GroupEnv, ReplicaGroup
from consumer.export.layout import trainer_export_config
from consumer.group_cursor import GroupCursor
from consumer.loss import DPaceLoss, full_logits_loss
from consumer.objective import attention_masks, build_draft_batch
from consumer.resume_points import ResumePoints
from consumer.service import ConsumerService
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer
from consumer.validation import ANCHOR_STREAM, Evaluator, PassResult
from producer.data import ChatDataset, ChatEncoder, DataError
from producer.fingerprint import PlanChanged, check_plan, plan_fingerprint
from producer.plan import BatchPlan
from producer.tokenizer import load_tokenizer
from producer.validation import (
    excluded_ids,
    held_out_set,
    pack_pass,
    pass_ids,
    split_fingerprint,
    split_held_out,
)
from tests.consumer.test_drafter_common import (
    LAYER_IDS,
    distinct_seqs,
    drafter_cfg,
    packed,
    target_features,
    tiny_target,
)
from tests.jobs import tiny_assets

# ------------------------------------------------------------------------------------------ the split


def test_split_is_seeded_by_record_excluded_from_the_plan_and_bounded():
    held = split_held_out(240, 0.1, 7)
    assert held.tolist() == [
        3,
        21,
        39,
        51,
        62,
        69,
        71,
        96,
        98,
        105,
        109,
        116,
        120,
        130,
        134,
        138,
        146,
        148,
        156,
        160,
        181,
        199,
        217,
        224,
    ]  # pinned: the same data and seed hold out the same records
    assert split_held_out(240, 0.1, 7).tolist() == held.tolist()
    assert split_held_out(10, 0.2, 0).tolist() == [0, 9] and split_held_out(10, 0.2, 1).tolist() == [3, 4]
    assert len(split_held_out(3, 0.01, 0)) == 1  # at least one
    with pytest.raises(DataError, match="nothing is left to train on"):
        split_held_out(1, 0.5, 0)
    lengths = [5 + i % 7 for i in range(240)]
    plan = BatchPlan(lengths, seed=7, epochs=2, tokens_per_batch=64, length_group_window=2, exclude=held)
    for epoch in range(2):
        planned = [s for b in plan.epoch_batches(epoch) for s in b]
        assert sorted(planned) == sorted(set(range(240)) - set(held.tolist()))  # each training record once
    assert pass_ids(list(range(20)), 5, 7).tolist() == [7, 9, 15, 18, 19]  # a seeded subset, the same every pass
    assert pack_pass([3, 9, 5, 9, 2], [0, 1, 2, 3, 4], 12) == [(1,), (3,), (2, 0, 4)]  # longest first, ties by id


def test_the_split_is_in_the_plan_fingerprint_and_a_changed_split_is_refused(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": []}\n')
    lengths = [7] * 50

    def fp(validation):
        return plan_fingerprint(
            data_path=data,
            data_format="chat",
            tokenizer_dir=tmp_path,
            chat_template_kwargs={},
            max_length=8,
            tokens_per_batch=64,
            length_group_window=2,
            seed=3,
            shard=(0, 1),
            lengths=lengths,
            validation=split_fingerprint(validation, len(lengths), 3),
        )

    split = fp(0.1)
    assert split["validation"] == {"fraction": 0.1, "records": 5, "digest": sample_digest(split_held_out(50, 0.1, 3))}
    assert fp("val.jsonl")["validation"] is None and fp(None)["validation"] is None  # a file leaves the plan as is
    previous = [{"lineage": "main", "fingerprint": split, "epochs": [0]}]
    assert "matches" in check_plan(previous, "main", fp(0.1), 1, tmp_path)
    with pytest.raises(
        PlanChanged,
        match=r"the held-out records \(data.validation\): a 0.1 split \(5 records.*→ a 0.2"
        r" split \(10 records",
    ):
        check_plan(previous, "main", fp(0.2), 1, tmp_path)
    with pytest.raises(PlanChanged, match=r"data.validation\): a 0.1 split .* → none"):
        check_plan(previous, "main", fp(None), 1, tmp_path)
    older = {k: v for k, v in fp(None).items() if k != "validation"}  # a fingerprint written before the key
    assert "matches" in check_plan(
        [{"lineage": "main", "fingerprint": older, "epochs": [0]}], "main", fp(None), 1, tmp_path
    )


def test_a_validation_file_or_split_of_real_records_and_the_pass_schedule(tmp_path_factory):
    assets = tiny_assets(tmp_path_factory.mktemp("assets"))
    encoder = ChatEncoder(load_tokenizer(assets / "tokenizer"), 256)
    train = ChatDataset(assets / "train.jsonl", "chat", encoder)
    val_file = assets / "val.jsonl"
    val_file.write_text("".join(line + "\n" for line in (assets / "train.jsonl").read_text().splitlines()[:5]))
    common = dict(eval_every=3, max_records=4, seed=7, tokens_per_batch=512, dataset=train, encoder=encoder)
    held = held_out_set(validation=str(val_file), **common)
    assert held.source == "file" and held.held_out.tolist() == [0, 1, 2, 3, 4] and len(held.pass_samples) == 4
    assert excluded_ids(str(val_file), len(train), 7).size == 0  # the training plan keeps every record
    record = held.plan_record()
    assert record["file"]["bytes"] == val_file.stat().st_size and record["held_out_ids"] is None
    reader = held.dataset.reader()
    for batch in held.packed():  # the records as the training data's reader gives them, end to end
        assert batch.input_ids.tolist() == [t for i in batch.sample_ids for t in reader.read(i)[0]]
    reader.close()
    split = held_out_set(validation=0.1, **common)
    assert split.held_out.tolist() == split_held_out(len(train), 0.1, 7).tolist() and split.dataset is train
    assert sorted(split.pass_samples) == pass_ids(split.held_out, 4, 7).tolist()
    assert [split.passes_at(c, 10) for c in (0, 2, 3, 5, 6, 9, 10)] == [0, 0, 1, 1, 2, 3, 4]  # and one at the end
    assert held_out_set(validation=None, **common) is None
    with pytest.raises(DataError, match="is the training data itself"):
        held_out_set(validation=str(assets / "train.jsonl"), **common)
    with pytest.raises(DataError, match=r"nope\.jsonl is not a file"):
        held_out_set(validation=str(assets / "nope.jsonl"), **common)


def test_a_bad_validation_key_names_it():
    doc = {
        "job": {"name": "j", "run_dir": "/tmp/x"},
        "target": {"path": "/t"},
        "drafters": [{"name": "d0"}],
        "data": {"path": "d.jsonl", "validation": 0.7},
    }
    with pytest.raises(ConfigError, match=r"data.validation: 0.7: a fraction of the records in \(0, 0.5\]"):
        parse_job(doc, "job.toml")
    doc["data"]["validation"] = ""
    with pytest.raises(ConfigError, match=r"data\.validation: an empty path"):
        parse_job(doc, "job.toml")


# ------------------------------------------------------------------------------------------ the audit


def _validation_log(root, *, trained_held_out: bool = False, twice: bool = False):
    held = [3, 7]
    plan = {
        "source": "split",
        "held_out": 2,
        "held_out_ids": held,
        "samples": 2,
        "digest": sample_digest(held),
        "batches": 1,
        "eval_every": 1,
    }
    producer = DeliveryLedger(root, 0, 2, [2], [0, 1, 2, 4, 5, 6], validation=plan)
    producer.delivered(0, 0, [0, 1], [("d0", 0, 1)])
    producer.validated(1, 0, held, [("d0", 0, 1)])
    producer.delivered(1, 0, [2, 7] if trained_held_out else [2, 4], [("d0", 0, 1)])
    producer.validated(2, 0, held, [("d0", 0, 1)])
    consumer = TrainLedger(root, "d0", 0, 1, base=None, base_step=0)
    consumer.evaluated(1, 1, held, 1.25)
    consumer.evaluated(2, 2, [3, 3] if twice else held, 1.5)
    return read_records([root])[0]


def test_held_out_records_never_trained_and_each_pass_evaluated_once_are_audited(tmp_path):
    ok = check_validation("d0", _validation_log(tmp_path / "ok"))
    assert (
        ok.ok,
        ok.held_out,
        ok.pass_samples,
        ok.passes_sent,
        ok.passes_evaluated,
        ok.passes_exact,
        ok.held_out_trained,
    ) == (True, 2, 2, 2, 2, 2, 0)
    leaked = check_validation("d0", _validation_log(tmp_path / "leak", trained_held_out=True))
    assert not leaked.ok and leaked.held_out_trained == 1
    assert leaked.errors == ["held-out record 7 (node 0, lineage 'main') was delivered for training"]
    twice = check_validation("d0", _validation_log(tmp_path / "twice", twice=True))
    assert not twice.ok and (twice.passes_exact, twice.passes_mismatched) == (1, 1)
    assert "evaluation pass 2 (step 2): 1 distinct records, 1 evaluated twice" in twice.errors[0]
    assert check_validation("d1", _validation_log(tmp_path / "other")).passes_sent == 0  # another drafter's
    assert held_out_curve(_validation_log(tmp_path / "curve"), "d0") == [(1, 1, 1.25), (2, 2, 1.5)]


# ------------------------------------------------------------------------------------------ evaluation


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target's parts, four training batches and two validation batches with the target's features."""
    path = tmp_path_factory.mktemp("target")
    model = tiny_target(path)

    def batch(lengths, seed):
        seqs = distinct_seqs(lengths, seed=seed)
        return (target_features(model, seqs), *packed(seqs))

    train = [batch([40, 56], s) for s in range(4)]
    val = [batch([48, 30], 10), batch([64], 11)]
    return load_target_parts(path), train, val


def _state(trainer):
    return {
        **{k: v.clone() for k, v in trainer.model.state_dict().items()},
        "rng": trainer.generator.get_state(),
        "step": torch.tensor(trainer.step),
    }


def test_validation_on_or_off_trains_bit_identical_weights(setup):
    parts, train, val = setup
    plain = Trainer(drafter_cfg(), parts, LAYER_IDS, "cpu")
    with_val = Trainer(drafter_cfg(), parts, LAYER_IDS, "cpu")
    evaluator = Evaluator(with_val)
    results = []
    for seq, b in enumerate(train):
        plain.train_batch(*b, seq=seq)
        with_val.train_batch(*b, seq=seq)
        for i, v in enumerate(val):  # a whole pass after every step, and half a pass (dropped) after the first
            if seq == 0 and i == 1:
                break
            results.append(evaluator.add(*v, sample_ids=[10 * seq + i], validation=(seq + 1, i, len(val))))
    a, b = _state(plain), _state(with_val)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    opt_a, opt_b = plain.optimizer.state_dict()["state"], with_val.optimizer.state_dict()["state"]
    assert all(torch.equal(opt_a[i][k], opt_b[i][k]) for i in opt_a for k in opt_a[i])
    whole = [r for r in results if r is not None]
    assert [(r.pass_, r.step, r.samples, r.tokens) for r in whole] == [
        (2, 2, [10, 11], 142),
        (3, 3, [20, 21], 142),
        (4, 4, [30, 31], 142),
    ]


@pytest.mark.parametrize("loss", ["dpace", "decay"])
def test_a_pass_is_the_drafters_loss_and_tau_on_the_held_out_batches(setup, loss):
    """The evaluator's figures against an independent computation: the documented anchors, the unchunked loss
    of the drafter's own objective (so val_loss reads as the training loss does: D-PACE's Σ w·CE per valid
    anchor, the decay's Σ w·CE / Σ w)."""
    parts, _, val = setup
    trainer = Trainer(drafter_cfg(loss=loss), parts, LAYER_IDS, "cpu")
    cfg = trainer.cfg
    result = Evaluator(trainer).add(*val[0], sample_ids=[0], validation=(1, 0, 1))
    with torch.no_grad():
        hidden, ids, mask, cu = val[0]
        gen = torch.Generator().manual_seed((trainer.seed * 1_000_003 + ANCHOR_STREAM + 0) % 2**63)
        batch = build_draft_batch(
            ids,
            mask,
            cu,
            anchors_per_seq=cfg.anchors_per_seq,
            block_size=cfg.block_size,
            mask_token_id=trainer.mask_token_id,
            gamma=cfg.loss_gamma,
            generator=gen,
            partial_blocks=cfg.partial_blocks,
            max_anchors=trainer.max_anchors,
        )
        masks = attention_masks(batch, trainer.arch.attention_layers, cfg.sliding_window, flex=False)
        h = trainer.model(hidden.float(), batch.ctx_pos, batch.block_ids, batch.block_pos, masks)
        if loss == "dpace":
            mask = (batch.weights > 0).float()
            ls, correct = full_logits_loss(h, trainer.model.lm_head, batch.labels, mask, DPaceLoss(cfg.block_size, 0.5))
            weight = float(mask.view(-1, cfg.block_size).any(dim=1).sum())  # anchors with a supervised slot
        else:
            ls, correct = full_logits_loss(h, trainer.model.lm_head, batch.labels, batch.weights)
            weight = float(batch.weights.sum())
        loss_sum = float(ls)
        ok = (correct & (batch.weights > 0)).view(-1, cfg.block_size)
        leading = float(ok[:, 1:].long().cumprod(1).sum())
        anchors = ok.shape[0]
    assert result.metrics["loss"] == pytest.approx(loss_sum / weight, rel=1e-5)
    assert result.metrics["tau_est"] == pytest.approx(1 + leading / anchors)
    again = Evaluator(trainer).add(*val[0], sample_ids=[0], validation=(2, 0, 1))
    assert again.metrics == result.metrics  # the same anchors every pass


# ------------------------------------------------------------------------------------------ best


def _service(trainer, root, best):
    env = GroupEnv.resolve({}, replica=0, replicas=1, node_rank=0, nnodes=1)
    save = functools.partial(write_checkpoint, root, export=trainer_export_config(trainer), keep_last=2)
    return ConsumerService(
        trainer,
        stream=None,
        save_checkpoint=save,
        group=ReplicaGroup(env, torch.device("cpu")),
        resume=ResumePoints(GroupCursor.fresh(1), 0),
        checkpoint_every=1000,
        idle_timeout_s=1.0,
        best=best,
    )


def test_best_moves_only_on_a_strictly_higher_tau_survives_pruning_and_resume(setup, tmp_path):
    parts, train, _ = setup
    trainer = Trainer(drafter_cfg(), parts, LAYER_IDS, "cpu")
    root = tmp_path / "checkpoints" / "d0"
    service = _service(trainer, root, BestCheckpoint(root))
    taus = [1.5, 1.2, 1.5, 2.0, math.nan, 1.9, 1.95]  # one pass after each step
    best_after = []
    for step, tau in enumerate(taus, start=1):
        trainer.train_batch(*train[step % 4], seq=step - 1)
        service._keep_best(
            PassResult(step, trainer.step, {"loss": 3.0 - tau if tau == tau else 9.0, "tau_est": tau}, [0], 10)
        )
        if step in (5, 6, 7):
            service._save("periodic")  # newer checkpoints: keep_last = 2 prunes the older ones
        best_after.append(read_pointer(root, BEST))
    assert best_after == ["step_1", "step_1", "step_1", "step_4", "step_4", "step_4", "step_4"]  # tie: the earlier
    assert json.loads((root / "best.json").read_text()) == {
        "checkpoint": "step_4",
        "step": 4,
        "tau": 2.0,
        "loss": 1.0,
        "pass": 4,
    }
    assert sorted(p.name for p in root.glob("step_*")) == ["step_4", "step_6", "step_7"]  # best kept past keep_last
    assert (root / "best").is_symlink() and (root / "best" / "config.json").is_file()  # loadable as `latest`
    assert (root / "best" / "model.safetensors").is_file()

    resumed = BestCheckpoint(root)  # a restart: the best-so-far value is the one to beat
    assert (resumed.best.step, resumed.best.tau) == (4, 2.0)
    again = _service(trainer, root, resumed)
    again._saved_step = trainer.step
    again._keep_best(PassResult(8, trainer.step, {"loss": 1.2, "tau_est": 1.99}, [0], 10))
    assert read_pointer(root, BEST) == "step_4"
    again._keep_best(PassResult(8, trainer.step, {"loss": 0.9, "tau_est": 2.5}, [0], 10))
    assert read_pointer(root, BEST) == "step_7" and BestCheckpoint(root).best.tau == 2.5  # no second save of step 7

    (root / "best.json").write_text(
        json.dumps({"checkpoint": "step_6", "step": 6, "tau": 3.0, "loss": 1.0, "pass": 6})
    )  # a crash between the record and the pointer
    assert BestCheckpoint(root).best.step == 6 and read_pointer(root, BEST) == "step_6"
    assert np.isfinite(BestCheckpoint(root).best.loss)
