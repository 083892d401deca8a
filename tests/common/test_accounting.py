"""The job log and its checker: a simulated run of crashes, failed saves and resumes, and what it must catch."""

import json
from pathlib import Path

import pytest
import torch

from common.accounting import DeliveryLedger, JobLog, LineageError, TrainLedger, ledger_id_of, resume_lineage
from common.accounting_check import check_run, main

# a plan of 2 epochs × 6 batches over samples 0..11, two samples a batch (epoch 1 in another order)
EPOCHS = {
    0: [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)],
    1: [(5, 2), (11, 0), (7, 9), (1, 3), (10, 4), (6, 8)],
    2: [(3, 8), (0, 6), (9, 1), (4, 11), (2, 7), (5, 10)],
}  # only in the plan that grew to 3 epochs
TOTAL = 12


def samples_of(seq):
    return EPOCHS[seq // 6][seq % 6]


class FakeTrainer:
    def __init__(self, step=0):
        self.step = step

    def state_dict(self):
        return {"step": self.step}


class FakeRun:
    """A producer that delivers in order, and consumers whose 'checkpoints' are trainer_state.pt files."""

    def __init__(self, root: Path, drafters=("d0",), epochs=2, lineage="main", fingerprint=None):
        self.root = root
        self.producer = DeliveryLedger(
            root, 0, 6 * epochs, [6] * epochs, range(12), lineage=lineage, fingerprint=fingerprint
        )
        self.session = 0
        self.drafters = drafters

    def deliver(self, seq, drafter="d0"):
        self.session += 1
        self.producer.delivered(seq, seq // 6, samples_of(seq), [(drafter, 0, self.session)])

    def consumer(self, drafter="d0", lineage="main"):
        return FakeConsumer(self, drafter, lineage)

    def check(self):
        return check_run(self.root)


class FakeConsumer:
    def __init__(self, run: FakeRun, drafter: str, lineage: str = "main"):
        self.run, self.drafter = run, drafter
        self.ckpts = run.root / "checkpoints" / drafter
        base, step, state = None, 0, None
        if (self.ckpts / "latest").exists():
            state = torch.load(self.ckpts / (self.ckpts / "latest").read_text().strip() / "trainer_state.pt")
            base, step = ledger_id_of(state), state["step"]
        self.lineages, self.same_plan = resume_lineage(state, lineage)
        self.trainer = FakeTrainer(step)
        self.ledger = TrainLedger(run.root, drafter, 0, 1, base=base, base_step=step, lineages=self.lineages)
        self.since_save: list[int] = []

    def train(self, seq):
        self.run.deliver(seq, self.drafter)
        self.trainer.step += 1
        self.since_save.append(seq)
        self.ledger.stepped(self.trainer.step, [seq])

    def save(self, fail=False):
        entry = self.ledger.checkpoint(self.trainer.step, {0: self.since_save}, [max(self.since_save) + 1], [[]])
        self.since_save = []
        if fail:  # ENOSPC before the rename: nothing on disk, `saved` never called
            return
        name = f"step_{self.trainer.step}"
        (self.ckpts / name).mkdir(parents=True, exist_ok=True)
        torch.save({**self.trainer.state_dict(), "ledger": entry}, self.ckpts / name / "trainer_state.pt")
        (self.ckpts / "latest").write_text(name + "\n")
        self.ledger.saved(self.trainer.step)

    def crash(self):
        """A kill: the process's records are on disk (each was one write as it was made)."""


def test_crash_resume_and_failed_save_train_every_sample_once(tmp_path):
    run = FakeRun(tmp_path)
    a = run.consumer()
    for s in range(4):
        a.train(s)
    a.save()  # step 4
    for s in range(4, 7):
        a.train(s)
    a.crash()  # 4, 5, 6 lost with it
    b = run.consumer()
    for s in range(4, 8):
        b.train(s)
    b.save(fail=True)  # disk full: 4..7 stay pending, the parent stays step 4
    for s in range(8, 12):
        b.train(s)
    b.save()
    b.ledger.close()
    report = run.check()
    d0 = report.drafters["d0"]
    assert report.ok, report.to_dict()
    assert (d0.trained_batches, d0.duplicate_batches, d0.missing_batches, d0.lost_samples) == (12, 0, 0, 0)
    assert d0.complete and d0.epochs_complete == 2 and d0.lineage_checkpoints == 2
    assert (d0.crash_lost_batches, d0.crash_lost_retrained) == (3, 3)


def test_a_batch_trained_twice_in_the_lineage_is_a_duplicate(tmp_path):
    run = FakeRun(tmp_path)
    a = run.consumer()
    for s in range(6):
        a.train(s)
    a.save()
    b = run.consumer()
    for s in range(5, 12):  # seq 5 was in the checkpoint already
        b.train(s)
    b.save()
    d0 = run.check().drafters["d0"]
    assert not d0.ok
    assert d0.duplicate_batches == 1 and d0.duplicate_samples == 2  # samples 10, 11 of epoch 0


def test_a_skipped_batch_is_missing_and_its_samples_lost(tmp_path):
    run = FakeRun(tmp_path)
    a = run.consumer()
    run.deliver(2)  # delivered, never trained
    for s in [0, 1, 3, 4, 5, 6]:
        a.train(s)
    a.save()
    d0 = run.check().drafters["d0"]
    assert (d0.missing_batches, d0.lost_samples, d0.epochs_complete) == (1, 2, 0)
    assert not d0.ok


def test_checkpoint_without_ledger_id_and_broken_lineage_are_errors(tmp_path):
    run = FakeRun(tmp_path)
    a = run.consumer()
    a.train(0)
    a.save()
    torch.save({"step": 1}, tmp_path / "checkpoints" / "d0" / "step_1" / "trainer_state.pt")
    assert "no ledger id" in run.check().drafters["d0"].errors[0]
    torch.save(
        {"step": 1, "ledger": {"id": "d0:gone:1:1"}}, tmp_path / "checkpoints" / "d0" / "step_1" / "trainer_state.pt"
    )
    assert "lineage broken" in run.check().drafters["d0"].errors[0]


def test_undelivered_seq_and_torn_last_line(tmp_path):
    run = FakeRun(tmp_path)
    a = run.consumer()
    a.trainer.step += 1
    a.since_save.append(0)  # trained without a delivery record
    a.save()
    with open(a.ledger.log.path, "a") as f:
        f.write('{"kind": "step", "dra')  # a kill in the middle of a write
    report = run.check()
    assert report.torn_lines == 1 and report.drafters["d0"].undelivered_batches == 1


def test_joblog_records_are_on_disk_as_soon_as_they_are_made_and_cli_reports_json(tmp_path, capsys):
    log = JobLog(tmp_path, "producer", "n0")
    log.write("batch", {"seq": 1})
    assert [json.loads(li)["kind"] for li in log.path.read_text().splitlines()] == ["batch"]  # no buffer to lose
    log.write("plan", {"node": 0})
    assert [json.loads(li)["kind"] for li in log.path.read_text().splitlines()] == ["batch", "plan"]
    log.close()
    run = FakeRun(tmp_path / "run")
    a = run.consumer()
    for s in range(12):
        a.train(s)
    a.save()
    run.producer.close()
    assert main([str(tmp_path / "run"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["duplicates"] == 0 and doc["drafters"]["d0"]["trained_batches"] == 12


def test_plan_must_match_total(tmp_path):
    with pytest.raises(ValueError, match="the epochs hold 5 batches"):
        DeliveryLedger(tmp_path, 0, 6, [5], range(3))


def test_two_nodes_without_a_shared_folder_are_checked_together(tmp_path):
    node_dirs = [tmp_path / "n0", tmp_path / "n1"]
    for node, d in enumerate(node_dirs):
        p = DeliveryLedger(d, node, 2, [2], [10 * node, 10 * node + 1])
        p.delivered(0, 0, [10 * node], [("d0", 0, 1)])
        p.delivered(1, 0, [10 * node + 1], [("d0", 0, 1)])
        p.close()
    consumer = TrainLedger(node_dirs[0], "d0", 0, 2, base=None, base_step=0)
    consumer.trainer = FakeTrainer(2)
    entry = consumer.checkpoint(consumer.trainer.step, {0: [0, 1], 1: [0, 1]}, [2, 2], [[], []])
    (node_dirs[0] / "checkpoints" / "d0" / "step_2").mkdir(parents=True)
    torch.save(
        {**consumer.trainer.state_dict(), "ledger": entry},
        node_dirs[0] / "checkpoints" / "d0" / "step_2" / "trainer_state.pt",
    )
    (node_dirs[0] / "checkpoints" / "d0" / "latest").write_text("step_2\n")
    consumer.saved(2)
    consumer.close()
    alone = check_run(node_dirs[0]).drafters["d0"]
    assert "node 1: no plan record from its producer (lineage 'main')" in alone.errors
    both = check_run(node_dirs[0], [node_dirs[1]]).drafters["d0"]
    assert both.ok and both.complete and both.epochs_complete == 2 and both.trained_batches == 4


def test_a_plan_grown_by_epochs_is_checked_as_its_longest_version(tmp_path):
    """data.epochs raised 2 → 3 between runs: the first 2 epochs are the same batches, the third is appended;
    before, the checker failed for good with "producer incarnations logged different plans"."""
    run = FakeRun(tmp_path)
    a = run.consumer()
    for s in range(12):
        a.train(s)
    a.save()
    run.producer.close()
    run.producer = DeliveryLedger(tmp_path, 0, 18, [6, 6, 6], range(12))  # the rerun, epochs = 3
    b = run.consumer()
    assert b.same_plan
    for s in range(12, 18):
        b.train(s)
    b.save()
    report = run.check()
    d0 = report.drafters["d0"]
    assert report.ok, (report.errors, d0.errors)
    assert d0.complete and d0.epochs_complete == 3 and d0.trained_batches == 18
    assert [(p.lineage, p.epochs_planned, p.epochs_complete) for p in d0.lineages] == [("main", [2, 3], 3)]
    assert d0.lineages[0].describe() == (
        "lineage 'main': 18 batches, 3 whole epochs verified, plan grew by epochs"
        " 2 → 3 (the epochs they share are equal); complete"
    )


def test_epochs_lowered_after_they_were_trained_stays_exact_and_complete(tmp_path):
    run = FakeRun(tmp_path, epochs=3)
    a = run.consumer()
    for s in range(18):
        a.train(s)
    a.save()
    run.producer.close()
    run.producer = DeliveryLedger(tmp_path, 0, 12, [6, 6], range(12))  # epochs = 2: nothing left to train
    d0 = run.check().drafters["d0"]
    assert d0.ok and d0.complete and d0.epochs_complete == 3
    assert "epochs changed 3 → 2" in d0.lineages[0].describe()


def test_a_changed_plan_resumed_under_the_same_lineage_is_an_error(tmp_path):
    run = FakeRun(tmp_path, fingerprint={"version": 1, "data_xxh3_128": "aa", "data_path": "/d"})
    a = run.consumer()
    for s in range(3):
        a.train(s)
    a.save()
    run.producer.close()
    run.producer = DeliveryLedger(
        tmp_path, 0, 12, [6, 6], range(12), fingerprint={"version": 1, "data_xxh3_128": "bb", "data_path": "/d"}
    )
    report = run.check()
    assert not report.ok and len(report.errors) == 1
    assert "lineage 'main': producer incarnations logged different plans" in report.errors[0]
    assert "data_xxh3_128 changed): a changed plan was resumed" in report.errors[0]


def test_a_new_lineage_starts_at_seq_0_from_the_weights_and_each_lineage_is_checked_alone(tmp_path):
    """Lineage main trained 4 of 12 batches, then lineage "2" (changed data) trains its whole plan: the same seqs
    again, but in another lineage, so no duplicates; lineage main is exact but incomplete, "2" complete."""
    run = FakeRun(tmp_path)
    a = run.consumer()
    for s in range(4):
        a.train(s)
    a.save()
    run.producer.close()
    run.producer = DeliveryLedger(tmp_path, 0, 12, [6, 6], range(12), lineage="2")
    b = run.consumer(lineage="2")
    assert (b.lineages, b.same_plan) == (["main", "2"], False)
    for s in range(12):
        b.train(s)
    b.save()
    report = run.check()
    d0 = report.drafters["d0"]
    assert report.ok, (report.errors, d0.errors)
    assert (d0.trained_batches, d0.duplicate_batches, d0.missing_batches, d0.epochs_complete) == (16, 0, 0, 2)
    assert [(p.lineage, p.trained_batches, p.complete) for p in d0.lineages] == [("main", 4, False), ("2", 12, True)]
    assert d0.complete
    state = torch.load(tmp_path / "checkpoints" / "d0" / "step_16" / "trainer_state.pt")
    assert state["ledger"]["lineages"] == ["main", "2"]
    with pytest.raises(LineageError, match="trained data lineage 'main' and then '2'"):
        resume_lineage(state, "main")
    assert resume_lineage(state, "2") == (["main", "2"], True)
    assert resume_lineage(state, "3") == (["main", "2", "3"], False)
    assert resume_lineage({"step": 1}, "main") == (["main"], True)  # a checkpoint from before lineages


def test_a_lineage_resumed_after_another_is_an_error(tmp_path):
    run = FakeRun(tmp_path)
    a = run.consumer()
    a.train(0)
    a.save()
    b = run.consumer(lineage="2")
    b.train(0)
    b.save()
    c = run.consumer(lineage="2")
    c.ledger.lineage = "main"  # what resume_lineage refuses: written by hand
    c.train(1)
    c.save()
    errors = run.check().drafters["d0"].errors
    assert errors and errors[0].startswith("lineage 'main' resumed after '2'")
