"""The consumer loop: batches from the producer's ring → drafter training steps → checkpoints.

Reads top to bottom in `run()`. The stream owns the transport (sessions, fencing, copy-out), the trainer
owns the step, the replica group owns the collectives; this loop decides when to step, checkpoint and stop.

It runs in rounds (consumer/distributed.py says why): poll for one batch and train it (forward +
backward), then one all-reduce of flags tells every replica of the drafter whether the round is complete,
whether the group steps (tokens_per_step over the whole group; 0: every complete round), stops or fails.
With one replica the flags are local and a round is one batch: the loop is the plain one.

Validation batches (data.validation) are no training batches: a replica that receives one says so in its
flags, and the group evaluates it that round, before the round closes (its holder runs it, the others stand
in: FSDP's forward is collective); when it is its pass's last, one all-gather shares the pass and every
replica takes the same decision on `best` (consumer/best_checkpoint.py), whose save is the usual collective
one, of the weights just evaluated (no step has been taken since).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable

from common.accounting import TrainLedger
from common.profile import ProfileStats
from common.protocol import DATA_EXHAUSTED
from common.startup import StartupBeat
from common.stats import StatsSink
from common.supervisor import STOP_SIGNALS, stop_reason
from consumer.best_checkpoint import BestCheckpoint, decide, vote_row
from consumer.checkpoint_state import checkpoint_state
from consumer.distributed import GroupError, ReplicaGroup, RoundFlags, StepTrace
from consumer.group_cursor import GroupCursor
from consumer.resume_points import ResumePoints
from consumer.stream import (
    BatchStream,
    ConsumerRejected,
    ProducerLost,
    ReceivedBatch,
    StopRequested,
    StreamEnd,
)
from consumer.trainer import NonFiniteTrainingError, Trainer
from consumer.validation import Evaluator, PassResult, candidate, val_metrics

log = logging.getLogger("consumer")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_PRODUCER_LOST = 3
EXIT_REJECTED = 4
EXIT_GROUP_LOST = 5


class StopSignal:
    """SIGTERM/SIGINT/SIGHUP (and launch.sh's death, common/supervisor.py) become a reason the loop polls.
    Installed when the process starts, so that loading, warm-up and the wait for the producer honour a stop
    too (the loop finishes its round and checkpoints)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._stop)

    def requested(self) -> bool:
        """Polled by the streams while they wait for the producer."""
        return self.reason is not None

    def _stop(self, signum, _frame) -> None:
        if self.reason is None:  # the first signal says why (launch.sh's SIGTERM follows a SIGHUP to the group)
            self.reason = stop_reason(signum)


class ConsumerService:
    def __init__(
        self,
        trainer: Trainer,
        stream: BatchStream,
        save_checkpoint: Callable[[dict], None],
        *,
        group: ReplicaGroup,
        resume: ResumePoints,
        checkpoint_every: int,
        idle_timeout_s: float,
        prof: ProfileStats | None = None,
        stats: StatsSink | None = None,
        name: str = "consumer",
        trace: StepTrace | None = None,
        ledger: TrainLedger | None = None,
        stop: StopSignal | None = None,
        beat: StartupBeat | None = None,
        evaluator: Evaluator | None = None,
        best: BestCheckpoint | None = None,
    ):
        """`evaluator`: runs the validation batches (consumer/validation.py; None: they are ignored, counted);
        `best`: the best-checkpoint record a whole pass may update (consumer/best_checkpoint.py; the writer's
        only, None on the other replicas).
        `save_checkpoint(state)` writes a checkpoint_state dict atomically; the caller binds where.
        `resume` holds where the group resumes (its cursor, from its checkpoint or fresh, one per producer of each
        node: `cursor.producers` target replicas feed this stream (consumer/fanin.py), producer p the seqs ≡ p);
        the stream asks it for the seq of each HELLO, this loop advances it."""
        self.trainer = trainer
        self.stream = stream
        self.save_checkpoint = save_checkpoint
        self.group = group
        self.resume = resume
        self.checkpoint_every = checkpoint_every
        self.idle_timeout_s = idle_timeout_s
        self.prof = prof
        self.stats = stats
        self.name = name
        self.trace = trace
        self.ledger = ledger  # the job log of steps and checkpoints (common/accounting.py)
        self.node = resume.node
        self._stop = stop
        self._saved_step = trainer.step
        self._connected = False
        # this replica in the current round / step
        self._round: ReceivedBatch | None = None  # trained (forward + backward), round not closed yet
        self._round_tokens = 0
        self._ended: StreamEnd | None = None
        self._plan_done = False  # every replica's stream ended on "data exhausted": the job is finished
        self._fault: tuple[str, str] | None = None  # ("producer_lost" | "rejected", message)
        self._waiting_since = time.monotonic()
        self._step_seqs: list[int] = []  # this replica's batches in the step being accumulated
        self._step_samples: list[int] = []
        self._group_tokens = 0  # the group's tokens in the step being accumulated
        self._trained: list[int] = []  # seqs of completed steps since the last checkpoint
        self._skip = resume.cursor.above(self.node)  # trained before the checkpoint we resumed from
        self.producers = resume.cursor.producers
        self.beat = beat
        self._startup: contextlib.ExitStack | None = None  # the "first batch" phase, until the first step
        self.evaluator = evaluator
        self.best = best
        self._val_item: ReceivedBatch | None = None  # a validation batch, evaluated when its round syncs

    @property
    def cursor(self) -> GroupCursor:
        return self.resume.cursor

    def resume_seq(self, producer: int = 0) -> int:
        """The seq this replica asks `producer` for in HELLO (consumer/resume_points.py)."""
        return self.resume.seq(producer)

    @property
    def _stop_reason(self) -> str | None:
        return self._stop.reason if self._stop else None

    def run(self) -> int:
        if self._stop is None:
            self._stop = StopSignal()
        if self.beat:
            self._startup = contextlib.ExitStack()
            self._startup.enter_context(self.beat.phase("first batch", "waiting for it, then training it"))
        try:
            while True:
                if self._round is None and self._ended is None and self._fault is None:
                    self._poll()
                total = self.group.sync_round(self._flags())
                if total.producer_lost or total.rejected:
                    return self._fail(total)
                if total.val_batch:
                    result = self._evaluate()  # before the round may step: the weights its pass reports
                    if total.val_pass_ends:
                        self._keep_best(result)
                if total.complete(self.group.world_size):
                    self._close_round(total)
                if total.stop:
                    reason = self._stop_reason or "a replica of the group was stopped"
                    log.info(
                        "%s: %s at step %d; %s",
                        self.name,
                        reason,
                        self.trainer.step,
                        "checkpointing and exiting" if self.trainer.step > 0 else "nothing trained, exiting",
                    )
                    return self._finish(EXIT_OK, reason)
                if total.ended == self.group.world_size:
                    reason = self._ended.reason if self._ended else "end of stream"
                    self._plan_done = total.exhausted == self.group.world_size
                    if self._plan_done and self._group_tokens:
                        self._last_partial_step()
                    log.info("%s: end of stream (%s); trained through seq %d", self.name, reason, self.trainer.last_seq)
                    return self._finish(EXIT_OK, reason)
        except GroupError as err:
            log.error(
                "%s: %s. Nothing more is saved: the last checkpoint (step %d) is intact and the group"
                " resumes from it when restarted",
                self.name,
                err,
                self._saved_step,
            )
            return self._finish(EXIT_GROUP_LOST, "replica group lost", save=False)
        except NonFiniteTrainingError as err:
            log.error("%s: %s", self.name, err)
            return self._finish(EXIT_FAILED, "non-finite training", save=False)
        except OSError as err:  # a periodic checkpoint could not be written (disk full, read-only, ...)
            log.error("%s: %s", self.name, err)
            return self._finish(EXIT_FAILED, "checkpoint write failed", save=False)
        finally:
            self._end_startup()
            self.stream.close()
            if self.trace:
                self.trace.close()
            if self.ledger:
                self.ledger.close()

    # ------------------------------------------------------------------------------------ one round
    def _poll(self) -> None:
        """Wait up to idle_timeout_s for this replica's batch of the round and train it; transport
        failures become flags, so the whole group learns of them at the round's all-reduce."""
        start = time.perf_counter()
        self.stream.last_copy_s = 0.0
        try:
            if not self._connected:
                self.stream.connect()
                self._connected = True
                start = time.perf_counter()
            item = self.stream.next(timeout_s=self.idle_timeout_s)
        except ProducerLost as err:
            self._fault = ("producer_lost", str(err))
            return
        except ConsumerRejected as err:
            self._fault = ("rejected", str(err))
            return
        except StopRequested:  # the stop flag is set: this round's flags end the loop
            return
        finally:
            if self.prof:
                self.prof.add("wait_batch", time.perf_counter() - start - self.stream.last_copy_s)
        if isinstance(item, StreamEnd):
            self._ended = item
        elif isinstance(item, ReceivedBatch):
            if item.validation is not None:  # evaluated this round, never trained: no step, no cursor
                if self.evaluator is not None:
                    self._val_item = item
                elif self.prof:
                    self.prof.count("val_ignored")
                return
            if item.seq in self._skip:  # a resumed producer replays from the cursor: these were trained
                self._skip.discard(item.seq)
                if self.prof:
                    self.prof.count("skipped_trained")
                return
            self.trainer.accumulate(item.hidden, item.input_ids, item.loss_mask, item.cu_seqlens, item.seq)
            self._round = item
            self._round_tokens = item.input_ids.numel()
            self.resume.saw(item.seq)

    def _flags(self) -> RoundFlags:
        starved = self._round is None and time.monotonic() - self._waiting_since >= self.idle_timeout_s
        val = self._val_item.validation if self._val_item is not None else None  # (pass, index, count)
        return RoundFlags(
            has_batch=int(self._round is not None),
            ended=int(self._ended is not None),
            exhausted=int(self._ended is not None and self._ended.reason == DATA_EXHAUSTED),
            starved=int(starved and self._ended is None),
            tokens=self._round_tokens if self._round is not None else 0,
            stop=int(self._stop_reason is not None),
            producer_lost=int(self._fault is not None and self._fault[0] == "producer_lost"),
            rejected=int(self._fault is not None and self._fault[0] == "rejected"),
            val_batch=int(val is not None),
            val_pass_ends=int(val is not None and val[1] == val[2] - 1),
        )

    def _close_round(self, total: RoundFlags) -> None:
        if self._round is not None:
            self._step_seqs.append(self._round.seq)
            self._step_samples.extend(self._round.sample_ids)
            self._round = None
            self._waiting_since = time.monotonic()
        elif self.prof:
            self.prof.count("idle_rounds")  # joined the round with zero gradient and zero weight
        self._group_tokens += total.tokens
        tokens_per_step = self.trainer.cfg.tokens_per_step
        if not tokens_per_step or self._group_tokens >= tokens_per_step:
            self._step()

    def _last_partial_step(self) -> None:
        """The whole plan was delivered and the group holds batches short of tokens_per_step: they make the last
        step, normalised by what they hold as every step is (no batch of the plan is left untrained). Every
        replica takes it: the flags that decide it are the group's sums."""
        log.info(
            "%s: the plan's last %d token(s) make a partial last step (tokens_per_step = %d)",
            self.name,
            self._group_tokens,
            self.trainer.cfg.tokens_per_step,
        )
        self._step()

    def _end_startup(self) -> None:
        """Leave the start-up phase (its beat thread stops publishing) before this thread publishes."""
        if self._startup is not None:
            self._startup.close()
            self._startup = None
            self.beat.running(self.trainer.step)

    def _step(self) -> None:
        seqs, samples = self._step_seqs, self._step_samples
        tokens_before = self.trainer.tokens
        metrics = self.trainer.optimizer_step(max(seqs, default=self.trainer.last_seq))
        self._trained.extend(seqs)
        self._step_seqs, self._step_samples, self._group_tokens = [], [], 0
        if self.ledger:
            self.ledger.stepped(self.trainer.step, seqs)
        if self.prof:
            self.prof.count("steps")
        if self.trace:
            self.trace.write(self.trainer.step, seqs, samples, self.trainer.tokens - tokens_before, self.trainer.params)
        if metrics is not None:
            log.info(
                "%s step %d seq %s: loss %.4f tau_est %.3f acc_slot_1 %.3f lr %.2e grad_norm %.3f",
                self.name,
                self.trainer.step,
                seqs[-1] if seqs else "-",
                metrics["loss"],
                metrics["tau_est"],
                metrics.get("acc_slot_1", 0.0),
                metrics["lr"],
                metrics["grad_norm"],
            )
            if self.prof:
                for key, value in metrics.items():
                    if key.startswith("acc_slot_"):
                        self.prof.gauge(key, value)
        if self.trainer.step - self._saved_step >= self.checkpoint_every:
            self._save("periodic")
        self._end_startup()
        if self.stats:
            self.stats.maybe_publish(step=self.trainer.step)

    # ------------------------------------------------------------------------------------ validation
    def _evaluate(self) -> PassResult | None:
        """The round's validation batch: forward only (consumer/validation.py), or a stand-in for the replica
        that holds it; a whole pass is logged, published and written to the job log by its evaluator."""
        item, self._val_item = self._val_item, None
        if self.evaluator is None:  # passes ignored here (none configured): nothing to stand in for
            return None
        if item is None:
            self.evaluator.stand_in()
            return None
        start = time.perf_counter()
        result = self.evaluator.add(
            item.hidden, item.input_ids, item.loss_mask, item.cu_seqlens, item.sample_ids, item.validation
        )
        if self.prof:
            self.prof.add("eval", time.perf_counter() - start)
            self.prof.count("val_batches")
            self.prof.count("val_tokens", item.input_ids.numel())
        if result is None:
            return None
        m = result.metrics
        log.info(
            "%s validation pass %d at step %d: val_loss %.4f val_tau_est %.3f val_acc_slot_1 %.3f (%d records,"
            " %d tokens)",
            self.name,
            result.pass_,
            result.step,
            m["loss"],
            m["tau_est"],
            m.get("acc_slot_1", 0.0),
            len(result.samples),
            result.tokens,
        )
        if self.prof:
            for key, value in val_metrics(result).items():
                self.prof.gauge(key, value)
            self.prof.gauge("val_step", float(result.step))
            self.prof.gauge("val_pass", float(result.pass_))
        if self.ledger:
            self.ledger.evaluated(result.pass_, result.step, result.samples, m["tau_est"])
        if self.stats:
            self.stats.maybe_publish(step=self.trainer.step)
        return result

    def _keep_best(self, result: PassResult | None) -> None:
        """Collective: the round's whole pass (`result` on the replica that evaluated it, None elsewhere) is
        shared with the group; one that beats the best held-out τ has its weights (this step's) saved and
        `best` moved by the writer. Every replica takes the same decision from the same rows."""
        step = self.trainer.step
        on_disk = self.best is not None and self._saved_step == step and (self.best.root / f"step_{step}").is_dir()
        rows = self.group.gather_rows(
            vote_row(candidate(result) if result else None, self.best.best if self.best else None, on_disk)
        )
        decision = decide(rows)
        if decision is None:
            return
        won, save = decision
        if won.step != step:  # a pass shares in the round it ends, before any step: never expected
            log.warning("%s: pass %d evaluated step %d, not %d: no best from it", self.name, won.pass_, won.step, step)
            return
        if save:
            self._save("best held-out τ")  # the weights evaluated: the same step's
        if self.best is not None:
            self.best.record(f"step_{step}", step, won.tau, won.loss, won.pass_)
            log.info(
                "%s: best held-out τ %.3f (pass %d, step %d): %s",
                self.name,
                won.tau,
                won.pass_,
                step,
                self.best.root / "best",
            )

    # ------------------------------------------------------------------------------------ checkpoints, end
    def _save(self, reason: str) -> None:
        """Collective: every replica reports what it trained and (under FSDP) gathers the full state; global
        rank 0 alone writes."""
        start = time.perf_counter()
        trained = self.group.gather_trained(self._trained)
        trainer_state = self.trainer.gather_state(keep=self.group.is_writer)  # collective under FSDP
        self.resume.cursor = self.cursor.advance(trained)
        self._trained = []
        self._saved_step = self.trainer.step
        if self.group.is_writer:
            entry = None
            if self.ledger:  # logs the seqs this checkpoint adds; the checkpoint carries the record's id
                cursor = self.cursor.to_state()
                entry = self.ledger.checkpoint(
                    self.trainer.step,
                    trained,
                    cursor["cursors"],
                    cursor["trained_above"],
                    producers=self.cursor.producers,
                )
            self.save_checkpoint(
                checkpoint_state(
                    trainer_state,
                    shape=self.trainer.shape(),
                    cursor=self.cursor,
                    world_size=self.group.world_size,
                    ledger=entry,
                )
            )
            log.info(
                "%s: checkpoint at step %d (resume at seqs %s per node and producer, %s) in %.2f s",
                self.name,
                self.trainer.step,
                [list(c) for c in self.cursor.cursors],
                reason,
                time.perf_counter() - start,
            )
        if self.ledger:
            self.ledger.saved(self.trainer.step)

    def _fail(self, total: RoundFlags) -> int:
        if total.rejected:
            msg = self._fault[1] if self._fault else f"{total.rejected} replica(s) of the group were rejected"
            log.error("%s: %s", self.name, msg)
            return self._finish(EXIT_REJECTED, "rejected", save=False, say_bye=self._fault is None)
        if self._fault:
            log.error("%s: the producer was lost (%s); saving a checkpoint and exiting", self.name, self._fault[1])
        else:
            log.error(
                "%s: %d replica(s) of the group lost their producer; saving a checkpoint and exiting",
                self.name,
                total.producer_lost,
            )
        return self._finish(EXIT_PRODUCER_LOST, "producer lost", say_bye=self._fault is None)

    def _finish(self, status: int, reason: str, *, say_bye: bool = True, save: bool = True) -> int:
        """Save is collective (every replica reaches it on the same round); a failed write keeps the old one."""
        if save and self.trainer.step > 0:
            try:
                self._save(reason)
            except OSError as err:
                log.error("%s: could not save the final checkpoint: %s (the previous one is intact)", self.name, err)
                status = status or EXIT_FAILED
            except GroupError as err:
                log.error("%s: no final checkpoint, %s (the previous one is intact)", self.name, err)
                status = status or EXIT_GROUP_LOST
        if self.ledger:
            try:
                self.ledger.ended(reason, status, self.trainer.step, finished=self._plan_done)
            except OSError as err:  # a full disk: the checkpoint above is what counts, say why this is missing
                log.error("%s: could not log the end in the job log: %s", self.name, err)
        if say_bye and self._connected:
            self.stream.bye(reason, self.trainer.last_seq)
        return status
