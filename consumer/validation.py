"""Evaluation passes on the consumer: held-out batches (producer/validation.py) run forward only.

A validation batch is evaluated as it arrives, with the weights of the last completed optimizer step:
no gradient, no optimizer step, and anchors drawn from a generator of its own, seeded from the drafter's
seed and the batch's index in the pass, so every pass draws the same anchors (the curve compares like with
like) and the training generator, the gradients and the metrics of training batches are untouched: a run
with validation trains the weights it trains without. When the pass's last batch is in, its metrics
(`DraftMetrics`: loss, acc_slot_k, tau_est) are read once (one device sync per pass) and returned.
A pass missing a batch (the stream re-attached meanwhile) is dropped whole, logged, and never counted.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from consumer.best_checkpoint import BestCheckpoint
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
        self.metrics = DraftMetrics(trainer.cfg.block_size, trainer.device)
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
            if index != 0:
                return None  # joined a pass in the middle: wait for the next one
        self._forward(hidden, input_ids, loss_mask, cu_seqlens, index)
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

    def _forward(self, hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, index: int) -> None:
        tr, cfg = self.trainer, self.trainer.cfg
        generator = torch.Generator(device=tr.device).manual_seed((tr.seed * 1_000_003 + ANCHOR_STREAM + index) % 2**63)
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
                loss_sum, correct = chunked_lm_head_loss(
                    out, tr.model.lm_head, batch.labels, weights, cfg.loss_chunk_rows, tr.slot_loss
                )
            self.metrics.add(loss_sum, correct, weights, tr.slot_loss.normaliser(weights))  # val_loss reads as loss


def val_metrics(result: PassResult) -> dict[str, float]:
    """The pass's figures under their published names (W&B, metrics.jsonl): val_loss, val_tau_est, ..."""
    return {f"val_{k}": v for k, v in result.metrics.items()}


def job_validation(job, trainer, world_size: int, ckpt_root) -> tuple[Evaluator | None, BestCheckpoint | None]:
    """The evaluator and best-checkpoint record of a drafter process of `job` (both None without validation)."""
    if job.data.validation is None or not job.data.eval_every:
        return None, None
    if trainer.mesh is not None:
        log.warning(
            'drafter %s: validation batches are ignored under distributed = "fsdp" (its forward is'
            " collective, and only one replica receives them)",
            trainer.cfg.name,
        )
        return None, None
    if world_size > 1:
        log.warning(
            "drafter %s: its lowest live replica evaluates the validation passes and logs them; a best"
            " checkpoint is kept for single-replica drafters only",
            trainer.cfg.name,
        )
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
