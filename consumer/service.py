"""The consumer loop: batches from the producer's ring → drafter training steps → checkpoints.

Reads top to bottom in `run()`. The stream owns the transport (sessions, fencing, copy-out), the trainer
owns the step; this loop decides when to checkpoint and when to stop.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Protocol

from common.profile import ProfileStats
from consumer.stream import BatchStream, ConsumerRejected, ProducerLost, ReceivedBatch, StreamEnd
from consumer.trainer import NonFiniteTrainingError, Trainer

log = logging.getLogger("consumer")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_PRODUCER_LOST = 3
EXIT_REJECTED = 4


class StatsSink(Protocol):
    def maybe_publish(self, step: int | None = None, extra_gauges: dict | None = None) -> bool: ...


class ConsumerService:
    def __init__(
        self,
        trainer: Trainer,
        stream: BatchStream,
        save_checkpoint: Callable[[str], None],
        *,
        checkpoint_every: int,
        idle_timeout_s: float,
        prof: ProfileStats | None = None,
        stats: StatsSink | None = None,
        name: str = "consumer",
    ):
        """`save_checkpoint(reason)` writes the trainer's state atomically (the caller binds where)."""
        self.trainer = trainer
        self.stream = stream
        self.save_checkpoint = save_checkpoint
        self.checkpoint_every = checkpoint_every
        self.idle_timeout_s = idle_timeout_s
        self.prof = prof
        self.stats = stats
        self.name = name
        self._stop_reason: str | None = None
        self._saved_step = trainer.step

    def run(self) -> int:
        self._install_signal_handlers()
        try:
            self.stream.connect()
            while self._stop_reason is None:
                item = self._next_item()
                if item is None:
                    continue  # the producer is alive but has nothing for us yet (heartbeats say so)
                if isinstance(item, StreamEnd):
                    log.info("%s: end of stream (%s) after seq %d", self.name, item.reason, self.trainer.last_seq)
                    self._stop_reason = item.reason
                    break
                self._train(item)
            return self._finish(EXIT_OK, self._stop_reason or "stopped")
        except ProducerLost as err:
            log.error("%s: the producer was lost (%s); saving a checkpoint and exiting", self.name, err)
            return self._finish(EXIT_PRODUCER_LOST, "producer lost", say_bye=False)
        except ConsumerRejected as err:
            log.error("%s: %s", self.name, err)
            return self._finish(EXIT_REJECTED, "rejected", say_bye=False, save=False)
        except NonFiniteTrainingError as err:
            log.error("%s: %s", self.name, err)
            return self._finish(EXIT_FAILED, "non-finite training", save=False)
        finally:
            self.stream.close()

    def _next_item(self) -> ReceivedBatch | StreamEnd | None:
        start = time.perf_counter()
        self.stream.last_copy_s = 0.0
        item = self.stream.next(timeout_s=self.idle_timeout_s)
        if self.prof:
            self.prof.add("wait_batch", time.perf_counter() - start - self.stream.last_copy_s)
        return item

    def _train(self, batch: ReceivedBatch) -> None:
        step_before = self.trainer.step
        metrics = self.trainer.train_batch(batch.hidden, batch.input_ids, batch.loss_mask, batch.cu_seqlens, batch.seq)
        if self.trainer.step != step_before and self.prof:
            self.prof.count("steps")
        if metrics is not None:
            log.info("%s step %d seq %d: loss %.4f tau_est %.3f acc_slot_1 %.3f lr %.2e grad_norm %.3f", self.name,
                     self.trainer.step, batch.seq, metrics["loss"], metrics["tau_est"], metrics.get("acc_slot_1", 0.0),
                     metrics["lr"], metrics["grad_norm"])
            if self.prof:
                for key, value in metrics.items():
                    if key.startswith("acc_slot_"):
                        self.prof.gauge(key, value)
        if self.trainer.step - self._saved_step >= self.checkpoint_every:
            self._save("periodic")
        if self.stats:
            self.stats.maybe_publish(step=self.trainer.step)

    def _save(self, reason: str) -> None:
        start = time.perf_counter()
        self.save_checkpoint(reason)
        self._saved_step = self.trainer.step
        log.info("%s: checkpoint at step %d (seq %d, %s) in %.2f s", self.name, self.trainer.step,
                 self.trainer.last_seq, reason, time.perf_counter() - start)

    def _finish(self, status: int, reason: str, *, say_bye: bool = True, save: bool = True) -> int:
        if save and self.trainer.step > 0:
            try:
                self._save(reason)
            except OSError as err:
                log.error("%s: could not save the final checkpoint: %s (the previous one is intact)", self.name, err)
                status = status or EXIT_FAILED
        if say_bye:
            self.stream.bye(reason, self.trainer.last_seq)
        return status

    def _install_signal_handlers(self) -> None:
        def stop(signum, _frame):
            # finish the step in progress, checkpoint, then exit 0
            self._stop_reason = f"stopped by {signal.Signals(signum).name}"

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
