"""The consumer's main loop (consumer/service.py), in-process, built by consumer/build.py with stand-ins (a
scripted stream, a counting trainer) and a real replica group of one: each way it ends, its exit status,
what it saved and whether it said bye."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from common.accounting import TrainLedger, read_job_log
from common.config import parse_job
from common.protocol import DATA_EXHAUSTED
from common.supervisor import STOP_SIGNALS
from consumer.build import build_service
from consumer.distributed import GroupEnv, GroupError, ReplicaGroup
from consumer.group_cursor import GroupCursor
from consumer.service import (
    EXIT_FAILED,
    EXIT_GROUP_LOST,
    EXIT_OK,
    EXIT_PRODUCER_LOST,
    EXIT_REJECTED,
    StopSignal,
)
from consumer.stream import ConsumerRejected, ProducerLost, ReceivedBatch, StreamEnd
from consumer.trainer import NonFiniteTrainingError

TOKENS = 8


class CountingTrainer:
    """What the loop reads of a trainer; `fail_at_step`: that optimizer step raises the non-finite error."""

    def __init__(self, cfg, fail_at_step: int | None = None):
        self.cfg, self.fail_at_step = cfg, fail_at_step
        self.step, self.last_seq, self.tokens, self.params = 0, -1, 0, []
        self.trained: list[int] = []

    def accumulate(self, hidden, input_ids, loss_mask, cu_seqlens, seq: int) -> None:
        self.trained.append(seq)
        self.tokens += int(input_ids.numel())
        self.last_seq = max(self.last_seq, seq)

    def optimizer_step(self, last_seq: int):
        if self.step + 1 == self.fail_at_step:
            raise NonFiniteTrainingError(f"step {self.step + 1}: 3 non-finite steps in a row")
        self.step += 1
        return None

    def state_dict(self) -> dict:
        return {"step": self.step}

    def gather_state(self, keep: bool) -> dict | None:
        return self.state_dict() if keep else None

    def shape(self) -> dict:
        return {}


def batch(seq: int) -> ReceivedBatch:
    return ReceivedBatch(
        seq,
        0,
        [seq],
        torch.zeros(TOKENS, dtype=torch.int64),
        torch.ones(TOKENS, dtype=torch.uint8),
        torch.tensor([0, TOKENS], dtype=torch.int32),
        hidden=torch.zeros(TOKENS, 4),
    )


class ScriptedStream:
    """Hands out `script` in order (an exception is raised, a callable is called and gives the next item)."""

    def __init__(self, script: list):
        self.script = list(script)
        self.last_copy_s = 0.0
        self.connected = self.closed = False
        self.byes: list[tuple[str, int]] = []

    def connect(self) -> None:
        self.connected = True

    def next(self, timeout_s: float):
        item = self.script.pop(0) if self.script else None
        if callable(item):
            item = item()
        if isinstance(item, BaseException):
            raise item
        return item

    def bye(self, reason: str, trained_seq: int) -> None:
        self.byes.append((reason, trained_seq))

    def close(self) -> None:
        self.closed = True


class FailingGroup(ReplicaGroup):
    """A world of one whose `fail_round`-th round's all-reduce loses the group."""

    def __init__(self, env: GroupEnv, fail_round: int):
        super().__init__(env, torch.device("cpu"))
        self.rounds, self.fail_round = 0, fail_round

    def sync_round(self, mine):
        self.rounds += 1
        if self.rounds == self.fail_round:
            raise GroupError("rank 1 of 2 did not join the round within 60 s")
        return super().sync_round(mine)


@pytest.fixture
def restore_signals():
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture
def job(tmp_path):
    return parse_job(
        {
            "job": {"name": "loop", "run_dir": str(tmp_path / "run")},
            "target": {"path": "unused", "dtype": "float32"},
            "data": {"path": "unused", "max_length": 64, "tokens_per_batch": 64},
            "transport": {"heartbeat_interval_s": 0.05},
            "drafters": [{"name": "d0", "checkpoint_every": 1000}],
        }
    )


def run_loop(job, script, *, trainer=None, group=None, stop=None, ledger=None):
    """(exit status, trainer, stream, saved checkpoints as (step, the cursor's next seq of producer 0 after the run))."""
    cfg = job.drafters[0]
    env = GroupEnv.resolve({}, replica=0, replicas=1, node_rank=0, nnodes=1)
    trainer = trainer or CountingTrainer(cfg)
    stream, saved = ScriptedStream(script), []
    service = build_service(
        job,
        cfg,
        env,
        group or ReplicaGroup(env, torch.device("cpu")),
        torch.device("cpu"),
        trainer,
        GroupCursor.fresh(1, 1),
        stream=stream,
        save=lambda what: saved.append(trainer.step),
        stop=stop or StopSignal(),
        ledger=ledger,
    )
    status = service.run()
    return status, trainer, stream, [(step, service.cursor.cursors[0][0]) for step in saved]


def test_end_of_stream_trains_everything_saves_once_and_says_bye(job, restore_signals):
    status, trainer, stream, saved = run_loop(job, [batch(0), batch(1), batch(2), StreamEnd("data exhausted", 2)])
    assert status == EXIT_OK
    assert trainer.trained == [0, 1, 2] and trainer.step == 3
    assert saved == [(3, 3)]  # the final checkpoint resumes at seq 3
    assert stream.byes == [("data exhausted", 2)] and stream.closed


@pytest.mark.parametrize(
    ("end", "steps", "resume_at"),
    [(StreamEnd(DATA_EXHAUSTED, 2), 2, 3), (StreamEnd("stopped by SIGTERM", 2), 1, 2)],
)
def test_the_last_partial_step_is_trained_when_the_data_is_exhausted_only(job, restore_signals, end, steps, resume_at):
    """tokens_per_step = 2 batches, 3 batches: the plan's end trains the third alone as the last step (a stopped
    producer's end leaves it to the resumed run, which is sent it again); the job log says how it ended."""
    two = job.model_copy(update={"drafters": [job.drafters[0].model_copy(update={"tokens_per_step": 2 * TOKENS})]})
    ledger = TrainLedger(job.run_paths.root, "d0", 0, 1, base=None, base_step=0)
    status, trainer, stream, saved = run_loop(two, [batch(0), batch(1), batch(2), end], ledger=ledger)
    assert status == EXIT_OK and trainer.trained == [0, 1, 2] and stream.byes == [(end.reason, 2)]
    assert trainer.step == steps and saved == [(steps, resume_at)]
    records, torn = read_job_log(ledger.log.path)
    assert not torn and [r["seqs"] for r in records if r["kind"] == "step"] == [[0, 1], [2]][:steps]
    ends = [(r["reason"], r["status"], r["step"], r["finished"]) for r in records if r["kind"] == "end"]
    assert ends == [(end.reason, 0, steps, end.reason == DATA_EXHAUSTED)]


def test_a_stop_signal_finishes_the_round_checkpoints_and_exits_cleanly(job, restore_signals):
    def sigterm_then_batch():
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the StopSignal handler before kill returns
        return batch(1)

    status, trainer, stream, saved = run_loop(job, [batch(0), sigterm_then_batch, batch(2)])
    assert status == EXIT_OK
    assert trainer.trained == [0, 1] and saved == [(2, 2)]
    assert stream.byes == [("stopped by SIGTERM", 1)]


def test_a_lost_producer_saves_what_was_trained_and_exits_3_without_a_bye(job, restore_signals):
    status, trainer, stream, saved = run_loop(job, [batch(0), batch(1), ProducerLost("no heartbeat for 2.0 s")])
    assert status == EXIT_PRODUCER_LOST
    assert trainer.trained == [0, 1] and saved == [(2, 2)] and stream.byes == [] and stream.closed


def test_a_rejected_consumer_exits_4_saving_nothing(job, restore_signals):
    status, trainer, stream, saved = run_loop(job, [batch(0), ConsumerRejected("rejected: no drafter 'd0'")])
    assert status == EXIT_REJECTED
    assert trainer.step == 1 and saved == [] and stream.byes == []


def test_a_lost_group_exits_5_and_keeps_the_last_checkpoint(job, restore_signals):
    env = GroupEnv.resolve({}, replica=0, replicas=1, node_rank=0, nnodes=1)
    status, trainer, stream, saved = run_loop(job, [batch(0), batch(1), batch(2)], group=FailingGroup(env, 3))
    assert status == EXIT_GROUP_LOST
    assert trainer.step == 2 and saved == [] and stream.closed  # nothing more saved: the last one stays intact
    assert stream.byes == [("replica group lost", 2)]  # the producer is told (batch 2 was accumulated)


def test_non_finite_training_exits_1_saving_nothing(job, restore_signals):
    trainer = CountingTrainer(job.drafters[0], fail_at_step=2)
    status, trainer, stream, saved = run_loop(job, [batch(0), batch(1), batch(2)], trainer=trainer)
    assert status == EXIT_FAILED
    assert trainer.step == 1 and saved == [] and stream.byes == [("non-finite training", 1)]


def test_the_built_streams_ask_the_resume_points_the_loop_advances(job, restore_signals):
    """No stream refers to a service that does not exist yet: both share the ResumePoints the builder made."""
    job.run_paths.make()
    two = job.model_copy(update={"target": job.target.model_copy(update={"replicas": 2})})
    cfg = two.drafters[0]
    env = GroupEnv.resolve({}, replica=0, replicas=1, node_rank=0, nnodes=1)
    cursor = GroupCursor(2, ((6, 5),), (((8,), ()),))
    service = build_service(
        two,
        cfg,
        env,
        ReplicaGroup(env, torch.device("cpu")),
        torch.device("cpu"),
        CountingTrainer(cfg),
        cursor,
        stop=StopSignal(),
    )
    try:
        streams = service.stream.streams
        assert [s.resume_seq() for s in streams] == [6, 5] and [s.producer for s in streams] == [0, 1]
        service.resume.saw(9)  # trained seq 9 from producer 1: its re-attachment asks past it
        assert [s.resume_seq() for s in streams] == [6, 10]
    finally:
        service.stream.close()
