"""The replica group's cursor per producer (target.replicas = R: producer p makes the node's seqs ≡ p mod R):
bounded however far apart the producers run, converted exactly from per-node checkpoints and across a
change of R, carried in each HELLO, and read back by common/accounting_check.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.accounting import DeliveryLedger, TrainLedger
from common.accounting_check import check_run
from consumer.checkpoint_state import checkpoint_state, world_change
from consumer.distributed import GroupError
from consumer.group_cursor import GroupCursor
from consumer.resume_points import ResumePoints
from consumer.service import ConsumerService


def test_a_stalled_producer_does_not_grow_what_the_fast_one_leaves_above_its_cursor():
    """Producer 0 made seqs 0 and 2 and stalls with 2 in flight; producer 1 runs on (seqs 1, 3, 5, ...), and
    at every checkpoint one of its batches is still in flight to the other replica (round-robin + join)."""
    c = GroupCursor.fresh(1, 2).advance({0: [0]})
    fast = [2 * i + 1 for i in range(400)]
    held: list[int] = []
    sizes = []
    for k in range(100):
        window = fast[4 * k : 4 * k + 4]
        c = c.advance({0: held + window[:2] + window[3:]})  # window[2] is in flight at this checkpoint
        held = [window[2]]
        sizes.append([len(a) for a in c.trained_above[0]])
    assert c.cursors == ((2, fast[4 * 99 + 2]),) == ((2, 797),)
    assert c.trained_above == (((), (799,)),)
    assert max(max(s) for s in sizes) == 1  # per producer: what is in flight from it, at every checkpoint
    assert sum(len(a) for a in c.to_state()["trained_above"]) == 1  # what checkpoints and ledger records carry
    per_node = c.regroup(1)  # the same trained seqs under one cursor per node: what the lag piles up
    assert per_node.cursors == ((2,),) and len(per_node.above(0)) == 398  # 3, 5, ... 799 but 797


def test_a_per_node_checkpoint_resumes_under_two_producers_exactly():
    """A checkpoint written before cursors were per producer (no "producers" key: one cursor per node)."""
    old = {"group": {"cursors": [5, 3], "trained_above": [[7, 8, 10], [4, 6]], "world_size": 2}, "last_seq": 4}
    c = GroupCursor.from_state(old, 2, 2, "step_9")
    # node 0: trained = below 5, and 7, 8, 10; node 1: below 3, and 4, 6
    assert c.cursors == ((6, 5), (8, 3))
    assert c.trained_above == (((8, 10), (7,)), ((), ()))
    assert c.above(0) == {7, 8, 10} and c.above(1) == set()
    assert c.to_state() == {"producers": 2, "cursors": [6, 5, 8, 3], "trained_above": [[8, 10], [7], [], []]}
    assert GroupCursor.from_state({"last_seq": 9}, 1, 2, "step_10").cursors == ((10, 11),)
    assert c.regroup(1).to_state() == {"producers": 1, "cursors": [5, 3], "trained_above": [[7, 8, 10], [4, 6]]}
    assert GroupCursor.from_state(old, 2, 1, "step_9") == c.regroup(1)  # one producer: read as it was written


def test_a_checkpoint_of_r_producers_resumes_under_another_r_exactly():
    c = GroupCursor.fresh(1, 2).advance({0: [0, 1, 2, 3, 5, 9, 4, 11]})
    assert c.cursors == ((6, 7),) and c.trained_above == (((), (9, 11)),)
    three = GroupCursor.from_state({"group": c.to_state()}, 1, 3, "step_4")
    # trained: 0-5, 9, 11; shard 0 mod 3 = 0 3 6 ..., 1 mod 3 = 1 4 7 ..., 2 mod 3 = 2 5 8 11 ...
    assert three.cursors == ((6, 7, 8),) and three.trained_above == (((9,), (), (11,)),)
    assert three.regroup(2) == c and three.regroup(1).cursors == ((6,),)
    assert GroupCursor.from_state({"group": three.to_state()}, 1, 2, "step_4") == c


def test_malformed_or_foreign_cursors_are_refused_naming_the_checkpoint():
    with pytest.raises(GroupError, match=r"step_3: its group cursor is malformed \(3 cursors"):
        GroupCursor.from_state(
            {"group": {"producers": 2, "cursors": [0, 1, 2], "trained_above": [[], [], []]}}, 1, 2, "step_3"
        )
    with pytest.raises(GroupError, match="step_3 was written by a group over 2 node"):
        GroupCursor.from_state({"group": GroupCursor.fresh(2, 2).to_state()}, 1, 2, "step_3")


def test_each_hello_carries_its_producers_cursor_and_replays_above_it_are_skipped():
    cursor = GroupCursor(2, ((6, 5), (8, 3)), (((8, 10), (7,)), ((), ())))
    service = ConsumerService(
        SimpleNamespace(step=4),
        stream=None,
        save_checkpoint=lambda what: None,
        group=SimpleNamespace(env=SimpleNamespace(node_rank=0)),
        resume=ResumePoints(cursor, 0),
        checkpoint_every=10,
        idle_timeout_s=1.0,
    )
    assert (service.resume_seq(0), service.resume_seq(1)) == (6, 5)
    assert service._skip == {7, 8, 10} and service.producers == 2
    service.resume.highest_seen[1] = 9  # trained 9 from producer 1 since: a re-attachment asks past it
    assert (service.resume_seq(0), service.resume_seq(1)) == (6, 10)


class FakeTrainer:
    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}


class TwoProducerRun:
    """One node, two producers (one plan, seqs 0-5, samples 2s and 2s + 1), one drafter of one replica."""

    def __init__(self, run):
        self.run = run
        for seqs in ([0, 2, 4], [1, 3, 5]):  # each producer logs the node's plan and its own deliveries
            producer = DeliveryLedger(run, node=0, total_batches=6, epoch_batches=[6], sample_ids=range(12))
            for s in seqs:
                producer.delivered(s, 0, [2 * s, 2 * s + 1], [("d0", 0, 1)])
            producer.close()
        self.trainer = FakeTrainer()
        self.ledger = TrainLedger(run, "d0", 0, 1, base=None, base_step=0)
        self.cursor = GroupCursor.fresh(1, 2)

    def save(self, trained: list[int], claim: GroupCursor | None = None) -> dict:
        """Train `trained` and checkpoint, the way ConsumerService._save does (`claim`: a wrong cursor instead)."""
        self.trainer.step += len(trained)
        self.cursor = self.cursor.advance({0: trained})
        cursor = claim or self.cursor
        state = cursor.to_state()
        entry = self.ledger.checkpoint(
            self.trainer.step, {0: trained}, state["cursors"], state["trained_above"], producers=state["producers"]
        )
        what = checkpoint_state(self.trainer.state_dict(), shape={}, cursor=cursor, ledger=entry)
        ckpts = self.run / "checkpoints" / "d0"
        (ckpts / f"step_{self.trainer.step}").mkdir(parents=True)
        torch.save(what, ckpts / f"step_{self.trainer.step}" / "trainer_state.pt")
        (ckpts / "latest").write_text(f"step_{self.trainer.step}\n")
        self.ledger.saved(self.trainer.step)
        return what


def test_accounting_check_reads_the_cursor_per_producer(tmp_path):
    run = TwoProducerRun(tmp_path)
    state = run.save([1, 3, 0])
    assert state["group"] == {"producers": 2, "cursors": [2, 5], "trained_above": [[], []], "world_size": 1}
    assert state["last_seq"] == 1  # every seq up to it trained: node 0's lowest untrained seq - 1
    mid = check_run(tmp_path).drafters["d0"]
    assert mid.ok and not mid.complete and mid.missing_batches == 0 and mid.trained_batches == 3
    run.save([2, 4, 5])
    done = check_run(tmp_path).drafters["d0"]
    assert done.ok and done.complete and done.epochs_complete == 1 and done.trained_batches == 6


def test_accounting_check_finds_a_seq_missing_below_a_producers_cursor(tmp_path):
    """The last record claims producer 1 trained 1, 3 and 5 (cursor 7); 3 never was."""
    run = TwoProducerRun(tmp_path)
    run.save([0, 1, 5], claim=GroupCursor(2, ((2, 7),), (((), ()),)))
    bad = check_run(tmp_path).drafters["d0"]
    assert (bad.missing_batches, bad.lost_samples, bad.ok) == (1, 2, False)


def test_checkpoint_state_puts_each_part_under_its_own_key():
    """One function assembles trainer_state.pt: the trainer's entries as given, the shape, the group cursor
    (its last_seq replaces the trainer's) and the ledger entry; without a cursor the trainer's last_seq stays."""
    trainer = {"model": {}, "step": 7, "last_seq": 41, "rng": torch.tensor([1, 2], dtype=torch.uint8)}
    cursor = GroupCursor(2, ((6, 5),), (((8,), ()),))
    state = checkpoint_state(
        trainer, shape={"block_size": 8}, cursor=cursor, world_size=3, ledger={"id": "d0:x:7:1", "lineages": ["main"]}
    )
    assert set(state) == {"model", "step", "last_seq", "rng", "shape", "group", "ledger"}
    assert state["group"] == {"producers": 2, "cursors": [6, 5], "trained_above": [[8], []], "world_size": 3}
    assert state["last_seq"] == 4 and state["step"] == 7 and state["shape"] == {"block_size": 8}
    assert state["ledger"] == {"id": "d0:x:7:1", "lineages": ["main"]} and state["rng"] is trainer["rng"]
    alone = checkpoint_state(trainer, shape={})
    assert set(alone) == {"model", "step", "last_seq", "rng", "shape"} and alone["last_seq"] == 41
    assert trainer == {"model": {}, "step": 7, "last_seq": 41, "rng": trainer["rng"]}  # the input is left alone


def test_a_resume_under_another_world_size_is_said_in_one_line_naming_what_was_re_sharded():
    ddp2 = {"group": {"producers": 1, "cursors": [9], "trained_above": [[]], "world_size": 2}}
    fsdp2 = {**ddp2, "rng_replicas": torch.zeros(2, 4, dtype=torch.uint8)}
    assert world_change(ddp2, "ck/step_4", 2, sharded=False) is None
    assert world_change(None, "", 1, sharded=False) is None and world_change({}, "x", 2, sharded=True) is None
    assert world_change(ddp2, "ck/step_4", 1, sharded=False) == (
        "ck/step_4 was written by a group of 2 replica(s), this run has 1: weights and optimizer state loaded whole"
        " on each of the 1 replica(s); the group cursor goes on, the producer dealing the remaining seqs to 1"
        " replica(s)"
    )
    assert world_change(fsdp2, "ck/step_4", 3, sharded=True) == (
        "ck/step_4 was written by a group of 2 replica(s), this run has 3: weights, gradients and optimizer state"
        " re-sharded from 2 to 3 shard(s) (FSDP); the writer's anchor RNG on every replica (the 2 per-replica"
        " streams fit 2); the group cursor goes on, the producer dealing the remaining seqs to 3 replica(s)"
    )
