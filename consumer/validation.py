"""Evaluation passes on the consumer: held-out batches (producer/validation.py) run forward only.

A validation batch is evaluated as it arrives, with the weights of the last completed optimizer step:
no gradient, no optimizer step, and anchors drawn from a generator of its own, seeded from the drafter's
seed and the batch's index in the pass, so every pass draws the same anchors (the curve compares like with
like) and the training generator, the gradients and the metrics of training batches are untouched: a run
with validation trains the weights it trains without. When the pass's last batch is in, its metrics
(`DraftMetrics`: loss, acc_slot_k, tau_est) are read once (one device sync per pass) and returned.
A pass missing a batch (the stream re-attached meanwhile) is dropped whole, logged, and never counted.

A group evaluates a batch in the round it arrives (consumer/service.py): the replica holding it runs `add`,
the others `stand_in`. Unsharded, a stand-in is nothing; under FSDP, whose forward is collective, it is one
forward of the trainer's zero-weight stand-in batch, so every replica runs exactly one forward that round
(`add` runs one too when it drops a batch).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from consumer.best_checkpoint import BestCheckpoint, Candidate
from consumer.distributed import collective
from consumer.dspark import dspark_loss, metric_view
from consumer.loss import DraftMetrics, chunked_lm_head_loss

log = logging.getLogger("consumer")

ANCHOR_STREAM = 0xE7A1  # the validation anchors' seed offset: apart from the training generator's seed


@dataclass(frozen=True)
class PassResult:
    pass_: int
    step: int  # the optimizer step whose weights were evaluated
    metrics: dict[str, float]  # loss, acc_slot_1.., tau_est (consumer/loss.py DraftMetrics)
    samples: list[int]  # the records evaluated, in arrival order
    tokens: int


class Evaluator:
    """Accumulates one evaluation pass of a trainer (consumer/trainer.py), batch by batch."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.metrics = DraftMetrics(trainer.cfg.block_size + int(trainer.dspark), trainer.device)
        self._pass = 0
        self._seen = 0
        self._samples: list[int] = []
        self._tokens = 0

    def add(
        self,
        hidden: Tensor,
        input_ids: Tensor,
        loss_mask: Tensor,
        cu_seqlens: Tensor,
        sample_ids,
        validation: tuple[int, int, int],
    ) -> PassResult | None:
        """Evaluate batch `index` of `count` of pass `pass_` (= `validation`); the result once the pass is whole."""
        pass_, index, count = validation
        if (pass_, index) != (self._pass, self._seen):
            if self._seen:
                log.warning(
                    "validation pass %d: got batch %d of pass %d after %d of %d batches; the pass is dropped",
                    self._pass,
                    index,
                    pass_,
                    self._seen,
                    count,
                )
            self._reset(pass_)
            if index != 0:  # joined a pass in the middle: wait for the next one
                self.stand_in()
                return None
        self._in_lockstep(lambda: self._add(hidden, input_ids, loss_mask, cu_seqlens, index))
        self._seen += 1
        self._samples.extend(int(s) for s in sample_ids)
        self._tokens += int(input_ids.numel())
        if self._seen < count:
            return None
        result = PassResult(pass_, self.trainer.step, self.metrics.read(), self._samples, self._tokens)
        self._reset(0)
        return result

    def _reset(self, pass_: int) -> None:
        self.metrics.sums.zero_()
        self._pass, self._seen, self._samples, self._tokens = pass_, 0, [], 0

    def stand_in(self) -> None:
        """This replica's part of a round in which another evaluates: under FSDP one forward of the stand-in
        batch (its weight and figures discarded), unsharded nothing."""
        fsdp = self.trainer.fsdp
        if fsdp is not None:
            self._in_lockstep(lambda: self._loss(*fsdp.stand_in, fsdp.generator.manual_seed(0)))

    def _in_lockstep(self, forward) -> None:
        """Under FSDP the forward is a collective: a failed one is the group's GroupError, named."""
        if self.trainer.fsdp is None:
            forward()
        else:
            collective(f"drafter {self.trainer.cfg.name}", "a validation forward", forward)

    def _add(self, hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, index: int) -> None:
        tr = self.trainer
        generator = torch.Generator(device=tr.device).manual_seed((tr.seed * 1_000_003 + ANCHOR_STREAM + index) % 2**63)
        self.metrics.add(*self._loss(hidden, input_ids, loss_mask, cu_seqlens, generator))  # val_loss reads as loss

    def _loss(
        self, hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, generator: torch.Generator
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(Σ w·CE, correct, weights, normaliser) of one batch under the drafter's objective, no gradient."""
        tr, cfg = self.trainer, self.trainer.cfg
        autocast = (
            torch.autocast(tr.device.type, dtype=tr.autocast_dtype)
            if tr.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with torch.no_grad():
            h, batch, masks = tr.draft_inputs(hidden, input_ids, loss_mask, cu_seqlens, generator)
            with autocast:
                out = tr.model(h, batch.ctx_pos, batch.block_ids, batch.block_pos, masks)
                weights = tr.slot_loss.base_weights(batch.weights)  # the training objective's (D-PACE: the mask)
                if tr.dspark:  # its own loss; slots read as a DFlash block with the anchor first (consumer/dspark.py)
                    loss_sum, correct, _ = dspark_loss(
                        tr.model,
                        out,
                        batch.block_ids,
                        batch.labels,
                        weights,
                        cfg.loss_chunk_rows,
                        tr.dspark_targets(h, batch),
                    )
                    return (
                        loss_sum,
                        *metric_view(correct, weights, cfg.block_size),
                        tr.slot_loss.normaliser(weights, batch.num_sequences),
                    )
                loss_sum, correct = chunked_lm_head_loss(
                    out, tr.model.lm_head, batch.labels, weights, cfg.loss_chunk_rows, tr.slot_loss
                )
            return loss_sum, correct, weights, tr.slot_loss.normaliser(weights, batch.num_sequences)


def candidate(result: PassResult) -> Candidate:
    """What the group decides `best` on (consumer/best_checkpoint.py)."""
    return Candidate(result.pass_, result.step, result.metrics["tau_est"], result.metrics["loss"])


def val_metrics(result: PassResult) -> dict[str, float]:
    """The pass's figures under their published names (W&B, metrics.jsonl): val_loss, val_tau_est, ..."""
    return {f"val_{k}": v for k, v in result.metrics.items()}


def job_validation(job, trainer, is_writer: bool, ckpt_root) -> tuple[Evaluator | None, BestCheckpoint | None]:
    """The evaluator and best-checkpoint record of a drafter process of `job` (both None without validation).
    Every replica evaluates (the one a pass's batches reach; the others stand in, consumer/service.py); the
    checkpoint writer (`is_writer`, global rank 0) alone holds the record."""
    if job.data.validation is None or not job.data.eval_every:
        return None, None
    if not is_writer:
        return Evaluator(trainer), None
    best = BestCheckpoint(ckpt_root)
    if best.best is not None:
        log.info(
            "drafter %s: best held-out τ so far %.3f (step %d, %s)",
            trainer.cfg.name,
            best.best.tau,
            best.best.step,
            best.best.checkpoint,
        )
    return Evaluator(trainer), best
