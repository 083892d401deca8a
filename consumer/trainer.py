"""The drafter's training step engine, transport-free: packed batches in, optimizer steps out.

One call per packed batch (hidden [T, n·H], input_ids [T], loss_mask [T], cu_seqlens [nseq+1]).
Gradients accumulate until `tokens_per_step` tokens were seen (0: every batch is a step); the step
divides by the loss's normaliser summed over all its batches and replicas (consumer/loss.py: the valid
anchors under D-PACE, Σw under the decayed CE), clips, and steps the optimizer (consumer/optim.py).

Nothing here synchronises with the device except on log steps: a non-finite loss or gradient is
detected on the device and the fused AdamW skips its update through `found_inf` (the GradScaler
protocol); the skip counters are read, logged and checked against max_nonfinite_steps on log steps.

Sharded (distributed = "fsdp", `shard`): batches wait for the step, which runs them in lockstep with the
group (consumer/fsdp_lockstep.py). A checkpoint's trainer part is `state_dict()`, or under FSDP
`gather_state()`, which every replica calls together (consumer/checkpoint_state.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable

import torch
from torch import Tensor

from common.config import DataConfig, DrafterConfig
from common.host_memory import keep_freed_memory
from common.profile import timed
from consumer.checkpoint_state import cpu_copy
from consumer.dflash2 import DFlash2Drafter, SelectorMetrics, make_drafter, selector_loss
from consumer.dspark import DSparkDrafter, DSparkMetrics, dspark_loss, metric_view, target_rows
from consumer.export.layout import drafter_shape
from consumer.fsdp_lockstep import FsdpLockstep
from consumer.kernels import weighted_ce
from consumer.kernels.flex import CompiledFlex, FlexPlan
from consumer.loss import DraftMetrics, chunked_lm_head_loss, slot_loss
from consumer.mask_token import resolve_mask_token_id
from consumer.model import DrafterArch
from consumer.objective import DraftBatch, anchor_budget, attention_masks, build_draft_batch
from consumer.optim import build_optimizer, check_optimizer_state
from consumer.sliding_rule import serving_caveats
from consumer.target_parts import TargetParts

log = logging.getLogger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class NonFiniteCheckpointError(ValueError):
    """A state to resume from holds non-finite weights (the message names where it came from)."""


def lr_factor(step: int, total_steps: int, warmup_frac: float, min_lr_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to min_lr_ratio at total_steps (flat after)."""
    warmup = round(warmup_frac * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclasses.dataclass(frozen=True)
class SkipCounts:
    """The non-finite skip bookkeeping as read on a log step."""

    skipped: int  # optimizer steps skipped in all
    run: int  # skipped in a row now (0 after a good step)
    longest: int  # the longest run since the last read
    first_seq: int  # seq of the current run's first skipped step
    last_seq: int  # seq of the latest skipped step


class SkipCounters:
    """SkipCounts kept on the device: `update` on every step costs no sync, `read` (log steps) syncs once."""

    def __init__(self, device: torch.device):
        self._counts = torch.zeros(len(dataclasses.fields(SkipCounts)), dtype=torch.int64, device=device)

    def update(self, bad: Tensor, seq: int) -> None:
        """One optimizer step closed with batch `seq`; `bad`: a device bool, whether it was skipped."""
        skipped, run, longest, first_seq, last_seq = self._counts.unbind()
        b = bad.long()
        run = (run + 1) * b  # consecutive skipped steps, 0 after a good one
        self._counts.copy_(
            torch.stack(
                [
                    skipped + b,
                    run,
                    torch.maximum(longest, run),
                    torch.where(run == 1, seq, first_seq),
                    torch.where(bad, seq, last_seq),
                ]
            )
        )

    def read(self) -> SkipCounts:
        """The counts (one device sync); the window's longest run restarts from the current one."""
        counts = SkipCounts(*self._counts.tolist())
        self._counts[2] = counts.run
        return counts

    def skipped(self) -> int:
        """Steps skipped in all (one device sync: for checkpoints)."""
        return int(self._counts[0])

    def restart(self, skipped: int) -> None:
        """As after `skipped` skipped steps and a good one (a resumed run)."""
        self._counts.zero_()
        self._counts[0] = skipped


class Trainer:
    def __init__(
        self,
        cfg: DrafterConfig,
        parts: TargetParts,
        target_layer_ids: list[int],
        device: str | torch.device,
        *,
        job_seed: int = 0,
        prof=None,
        tokens_per_batch: int = DataConfig.model_fields["tokens_per_batch"].default,
    ):
        """tokens_per_batch: the job's data.tokens_per_batch; it sizes the anchor budget (objective.anchor_budget)."""
        self.cfg = cfg
        self.device = torch.device(device)
        if self.device.type == "cpu":
            keep_freed_memory()  # each step's activations reuse the last step's pages (common/host_memory.py)
        self.prof = prof
        self.target_layer_ids = list(target_layer_ids)
        self.seed = cfg.seed if cfg.seed is not None else job_seed
        on_cuda = self.device.type == "cuda"
        # bf16/fp16 autocast on CUDA; float32 (no autocast) on the CPU or when asked for
        self.autocast_dtype = getattr(torch, cfg.dtype) if on_cuda and cfg.dtype != "float32" else None
        attention = cfg.attention if cfg.attention != "auto" else ("flex" if on_cuda else "sdpa")
        if attention == "flex" and not on_cuda:
            raise ValueError(
                f"drafter {cfg.name}: attention='flex' cannot train on {self.device}"
                " (FlexAttention has no CPU backward); use 'sdpa' or 'auto'"
            )
        self.use_flex = attention == "flex"
        self.max_anchors = anchor_budget(tokens_per_batch, cfg.anchors_per_batch, cfg.anchors_per_seq)
        self.mask_token_id = resolve_mask_token_id(parts.path, parts.vocab_size, cfg.mask_token_id)
        frozen_dtype = self.autocast_dtype or torch.float32
        embed = parts.embed_tokens.to(self.device, frozen_dtype)
        lm_head = embed if parts.tie_word_embeddings else parts.lm_head.to(self.device, frozen_dtype)
        self.parts = dataclasses.replace(parts, embed_tokens=embed, lm_head=lm_head)  # no host copies kept
        self.arch = DrafterArch.from_target(parts, cfg, len(self.target_layer_ids))
        for note in serving_caveats(cfg.block_attention, cfg.attention_layers, cfg.sliding_window, cfg.block_size):
            log.warning("drafter %s: %s", cfg.name, note)
        if cfg.arch == "dspark" and parts.num_hidden_layers - 1 in self.target_layer_ids:
            log.warning(
                "drafter %s: target layer ids %s tap the target's last layer %d, which SGLang does not serve for a"
                " DSpark drafter (its DSpark worker accepts taps in [-1, %d]); train with target.layer_ids below it"
                " to serve the export there",
                cfg.name,
                self.target_layer_ids,
                parts.num_hidden_layers - 1,
                parts.num_hidden_layers - 2,
            )
        self.model = make_drafter(cfg, self.arch, embed, lm_head, self.seed).to(self.device)  # drafters.arch
        # flex compiled for this run's one padded shape: the full batch and the anchor budget (kernels/flex.py)
        self.flex = (
            CompiledFlex(
                FlexPlan.for_run(
                    tokens_per_batch, self.max_anchors, cfg.block_size, len(set(self.arch.attention_layers))
                ),
                prof,
            )
            if self.use_flex
            else None
        )
        # DSpark's loss weights are DeepSpec's static exp(-k/γ), normalised by Σw (consumer/dspark.py)
        loss = "decay" if cfg.arch == "dspark" else cfg.loss
        self.slot_loss = slot_loss(loss, cfg.block_size, cfg.dpace_alpha, cfg.dpace_normaliser)
        self._build_optimizer()
        self.fsdp: FsdpLockstep | None = None  # once `shard` ran: parameters are DTensor shards
        self.generator = torch.Generator(device=self.device).manual_seed(self.seed)  # anchor sampling
        self.dspark = isinstance(self.model, DSparkDrafter)
        last = (
            parts.num_hidden_layers - 1
        )  # DSpark's L1 against the target's distribution when its last layer is tapped
        self.dspark_target_block = self.target_layer_ids.index(last) if last in self.target_layer_ids else None
        # DSpark's B slots all predict: read as a DFlash block of B+1 with a label-less anchor (dspark.metric_view)
        self.metrics = DraftMetrics(cfg.block_size + int(self.dspark), self.device)
        self.dspark_metrics = DSparkMetrics(self.device)  # DSpark only
        self.nonfinite = SkipCounters(self.device)  # steps skipped for a non-finite loss or gradient
        self.selector_metrics = SelectorMetrics(self.device)  # DFlash2 only
        self._nonfinite_logged = 0
        self._pending_loss = torch.zeros((), device=self.device)
        self._pending_weight = torch.zeros((), device=self.device)
        self._pending_tokens = 0
        self._grad_norm = torch.zeros((), device=self.device)
        self.step = 0  # optimizer steps taken (skipped ones included: the schedule moves on)
        self.tokens = 0  # tokens in completed steps
        self.last_seq = -1  # seq of the last batch of the last completed step
        self._rng_at_step = self.generator.get_state()
        # (params, Σw, Σw·CE) → summed over the replicas in place, missing grads as zeros (consumer/distributed.py)
        self.grad_sync: Callable[[list[Tensor], Tensor, Tensor], None] | None = None

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        schedule = functools.partial(
            lr_factor, total_steps=cfg.total_steps, warmup_frac=cfg.warmup_frac, min_lr_ratio=cfg.min_lr_ratio
        )
        self.optimizer, self.scheduler = build_optimizer(cfg, self.model.named_parameters(), schedule)

    @property
    def mesh(self):
        """FSDP2's device mesh once `shard` ran, else None."""
        return self.fsdp.mesh if self.fsdp is not None else None

    def shard(self, mesh) -> None:
        """FSDP2 over `mesh` (consumer/fsdp_lockstep.py): a replica holds 1/world of the weights, gradients and
        optimizer state; batches wait for the step, which runs them in lockstep with the group. Call on every
        replica, before any step or state load, with identical weights everywhere."""
        if self.step or self._pending_tokens:
            raise RuntimeError(f"drafter {self.cfg.name}: shard() after training started")
        self.fsdp = FsdpLockstep.shard(
            self.model,
            mesh,
            self.cfg.name,
            block_size=self.cfg.block_size,
            width=self.arch.num_features * self.arch.hidden_size,
            device=self.device,
        )
        self._build_optimizer()

    # ------------------------------------------------------------------------------------------ training
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def warmup(self, triton_cache_dir=None) -> None:
        """Compile/autotune the loss kernels for the training chunk before the first timed step."""
        rows = min(self.cfg.loss_chunk_rows, self.max_anchors * self.cfg.block_size)
        weighted_ce.warmup(self.parts.vocab_size, rows, self.parts.lm_head.dtype, self.device, triton_cache_dir)

    def train_batch(
        self, hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, seq: int
    ) -> dict[str, float] | None:
        """Train on one packed batch; returns the metrics dict on log steps, else None.

        cu_seqlens and loss_mask are read on the host (their values size the step): pass CPU tensors.
        """
        self.accumulate(hidden, input_ids, loss_mask, cu_seqlens, seq)
        if self.cfg.tokens_per_step and self._pending_tokens < self.cfg.tokens_per_step:
            return None
        return self.optimizer_step(seq)

    def accumulate(self, hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, seq: int) -> None:
        """Forward and backward of one packed batch; its gradients add up until `optimizer_step`.
        (Replica groups decide when to step together, so they call the two halves themselves.)

        The tensors are the caller's and may be reused once this returns (consumer/stream.py hands out views
        of its copy-out buffers, valid until the next batch): unsharded, the batch is consumed here; under
        FSDP, whose forward waits for the group's step, the trainer keeps its own copy of what it defers."""
        T = input_ids.numel()
        if hidden.shape != (T, self.arch.num_features * self.arch.hidden_size):
            raise ValueError(
                f"batch seq {seq}: hidden has shape {tuple(hidden.shape)}, expected"
                f" [{T}, {self.arch.num_features} × {self.arch.hidden_size}] (tokens × fused target layers)"
            )
        self._pending_tokens += T
        if self.prof:
            self.prof.count("tokens", T)
            self.prof.count("batches", 1)
        if self.fsdp is not None:  # FSDP: run in lockstep with the group at optimizer_step
            self.fsdp.defer((hidden, input_ids, loss_mask, cu_seqlens))
            return
        self._forward_backward(hidden, input_ids, loss_mask, cu_seqlens)

    def draft_inputs(
        self, hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, generator: torch.Generator
    ) -> tuple[Tensor, DraftBatch, dict]:
        """A packed batch on the device → (context features, its anchors and blocks drawn from `generator`,
        one attention mask per layer kind): what a training step and a validation pass feed the drafter."""
        cfg, dev = self.cfg, self.device
        input_ids = input_ids.to(dev, torch.int64, non_blocking=True)
        hidden = hidden.to(dev, non_blocking=True)
        if self.autocast_dtype is None:
            hidden = hidden.float()
        batch = build_draft_batch(
            input_ids,
            loss_mask,  # host copies, as cu_seqlens: they size the step
            cu_seqlens,
            anchors_per_seq=cfg.anchors_per_seq,
            block_size=cfg.block_size,
            mask_token_id=self.mask_token_id,
            gamma=cfg.loss_gamma,
            generator=generator,
            partial_blocks=cfg.partial_blocks,
            max_anchors=self.max_anchors,
            next_token=cfg.arch == "dspark",  # DSpark slots predict x[p+k+1] (sample_from_anchor)
        )
        masks = attention_masks(
            batch,
            self.arch.attention_layers,
            cfg.sliding_window,
            flex=self.use_flex,
            kernel=self.flex,
            sliding_block_attention=self.arch.sliding_block_attention,
        )
        return hidden, batch, masks

    def _forward_backward(
        self,
        hidden: Tensor,
        input_ids: Tensor,
        loss_mask: Tensor,
        cu_seqlens: Tensor,
        *,
        stand_in: torch.Generator | None = None,
    ) -> None:
        """stand_in: FSDP's zero-weight pass of a replica without a batch, its anchors drawn from this generator."""
        cfg, dev = self.cfg, self.device
        with timed(self.prof, "anchors"):
            hidden, batch, masks = self.draft_inputs(
                hidden, input_ids, loss_mask, cu_seqlens, stand_in if stand_in is not None else self.generator
            )
        with timed(self.prof, "forward"), self._autocast():
            h = self.model(hidden, batch.ctx_pos, batch.block_ids, batch.block_pos, masks)
            dflash2 = isinstance(self.model, DFlash2Drafter)  # the unary top-k from the loss's own logits pass
            cand = torch.empty(h.shape[0], cfg.selector_top_k, dtype=torch.int64, device=dev) if dflash2 else None
            weights = self.slot_loss.base_weights(batch.weights)
            used = torch.empty(weights.shape, dtype=torch.float32, device=dev) if dflash2 else None
            if self.dspark:  # ce·CE + l1·L1 + confidence·BCE with the Markov bias (consumer/dspark.py)
                loss_sum, correct, dspark_stats = dspark_loss(
                    self.model,
                    h,
                    batch.block_ids,
                    batch.labels,
                    weights,
                    cfg.loss_chunk_rows,
                    self.dspark_targets(hidden, batch),
                )
            else:
                loss_sum, correct = chunked_lm_head_loss(
                    h,
                    self.model.lm_head,
                    batch.labels,
                    weights,
                    cfg.loss_chunk_rows,
                    self.slot_loss,
                    cand,
                    used,
                    self.model.shape.selector_vocab_size if dflash2 else None,  # DFlash2's candidates' ids
                )
            if dflash2:  # L = L_unary + α·L_sel, one normaliser (consumer/dflash2.py)
                # the selector's slots weighed as the unary loss weighed them (D-PACE: its weights of this batch)
                sel_sum, sel_stats = selector_loss(self.model, h, batch.labels, used, cfg.loss_chunk_rows, cand)
                loss_sum = loss_sum + cfg.selector_alpha * sel_sum
        with timed(self.prof, "backward"):
            (loss_sum * 0.0 if stand_in is not None else loss_sum).backward()  # a stand-in adds zero everywhere
        if stand_in is not None:
            return
        normaliser = self.slot_loss.normaliser(weights, batch.num_sequences)  # summed over the step's rounds, replicas
        self._pending_loss += loss_sum.detach()
        self._pending_weight += normaliser
        if self.dspark:
            self.metrics.add(loss_sum, *metric_view(correct, weights, cfg.block_size), normaliser)
            self.dspark_metrics.add(dspark_stats)
        else:
            self.metrics.add(loss_sum, correct, weights, normaliser)
        if isinstance(self.model, DFlash2Drafter):
            self.selector_metrics.add(sel_stats)
        if self.prof:
            self.prof.count("anchors", batch.num_anchors)  # host counts (no sync)
            self.prof.count("candidates", batch.num_candidates)

    def dspark_targets(self, hidden: Tensor, batch: DraftBatch) -> Tensor | None:
        """DSpark's target rows [Q, H] (consumer/dspark.py target_rows) when the job taps the target's last layer."""
        if self.dspark_target_block is None:
            return None
        return target_rows(
            hidden, batch.anchor_tok, self.cfg.block_size, self.dspark_target_block, self.arch.hidden_size
        )

    def optimizer_step(self, seq: int) -> dict[str, float] | None:
        """Close the step whose last batch is `seq`; returns the metrics dict on log steps, else None.

        `grad_sync`, when set, sums the gradients, Σw and Σw·CE over the replica group first.
        """
        if self.fsdp is not None:
            self.fsdp.run_passes(self.model, self._forward_backward)
        if self.grad_sync is not None:
            self.grad_sync(self.params, self._pending_weight, self._pending_loss)
        with timed(self.prof, "optimizer"):
            self._optimizer_step(seq)
        return self._read_metrics() if self.step % self.cfg.log_every == 0 else None

    def _optimizer_step(self, seq: int) -> None:
        inv_weight = 1.0 / self._pending_weight.clamp_min(
            1e-12
        )  # Σ w·CE / the step's normaliser (Σw, anchors, sequences)
        grads = [p.grad for p in self.params]
        torch._foreach_mul_(grads, inv_weight)
        self._grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=True)
        if self.fsdp is not None:  # a replicated DTensor: the same global norm on every replica
            self._grad_norm = self._grad_norm.full_tensor()
        bad = ~(torch.isfinite(self._grad_norm) & torch.isfinite(self._pending_loss))
        self.optimizer.found_inf = bad.float()  # fused AdamW skips the whole update when set
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite.update(bad, seq)
        self._pending_loss.zero_()
        self._pending_weight.zero_()
        self.step += 1
        self.tokens += self._pending_tokens
        self._pending_tokens = 0
        self.last_seq = seq
        self._rng_at_step = self.generator.get_state()

    def _read_metrics(self) -> dict[str, float]:
        """Log steps only: the one place that synchronises."""
        counts = self.nonfinite.read()
        skipped = counts.skipped
        if skipped > self._nonfinite_logged:
            log.warning(
                "drafter %s: skipped %d optimizer step(s) with a non-finite loss or gradient since the last"
                " log (%d in all), the latest at batch seq %d",
                self.cfg.name,
                skipped - self._nonfinite_logged,
                skipped,
                counts.last_seq,
            )
            self._nonfinite_logged = skipped
        if counts.longest >= self.cfg.max_nonfinite_steps:
            bad_weights = self.non_finite_params()
            cause = (
                f" The drafter's own weights are non-finite ({', '.join(bad_weights[:3])}), so every step fails"
                " whatever the batches hold."
                if bad_weights
                else " The weights are finite, so the batches are: non-finite hidden states from the producer are"
                " the usual cause; check the target's dtype and the batches at those seqs."
            )
            raise NonFiniteTrainingError(
                f"drafter {self.cfg.name}: {counts.longest} optimizer steps in a row had a non-finite loss or"
                f" gradient (max_nonfinite_steps={self.cfg.max_nonfinite_steps}), from batch seq {counts.first_seq}"
                f" to seq {counts.last_seq}.{cause}"
            )
        out = self.metrics.read()
        if isinstance(self.model, DFlash2Drafter):
            out.update(self.selector_metrics.read())
        if self.dspark:
            out.update(self.dspark_metrics.read())
        out.update(
            lr=self.scheduler.get_last_lr()[0],
            grad_norm=float(self._grad_norm),
            tokens=float(self.tokens),
            steps=float(self.step),
            nonfinite_skipped=float(skipped),
        )
        if self.prof:
            for key in ("loss", "lr", "grad_norm", "tau_est"):
                self.prof.gauge(key, out[key])
        return out

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue bit-for-bit, as of the last completed step
        (batches accumulated since then are not in it: resume replays them from last_seq + 1), on the CPU.
        Unsharded only: under FSDP the full state is gathered by every replica together (`gather_state`)."""
        if self.fsdp is not None:
            raise RuntimeError(
                f"drafter {self.cfg.name}: sharded (FSDP): the full state is gathered with every"
                " replica, by gather_state()"
            )
        return self._state(self.model.state_dict(), self.optimizer.state_dict())

    def shape(self) -> dict:
        """The shape keys a checkpoint of this trainer records (consumer/export/layout.py drafter_shape)."""
        return drafter_shape(self)

    def gather_state(self, keep: bool) -> dict | None:
        """state_dict() for the process that keeps it (`keep`: the checkpoint writer), None for the others.
        Under FSDP a collective that every replica calls together: the full weights and optimizer state, and
        every replica's anchor RNG ("rng_replicas", row r replica r's), gathered to the CPU."""
        if self.fsdp is None:
            return self.state_dict() if keep else None
        gathered = self.fsdp.gather_full_state(self.model, self.optimizer, self._rng_at_step, keep)
        if gathered is None:
            return None
        model, optim, rngs = gathered
        return self._state(model, optim, rng_replicas=rngs)

    def _state(self, model: dict, optim: dict, **extra) -> dict:
        return cpu_copy(
            {
                **extra,
                "model": model,
                "optimizer": optim,
                "scheduler": self.scheduler.state_dict(),
                "rng": self._rng_at_step,
                "last_seq": self.last_seq,
                "step": self.step,
                "tokens": self.tokens,
                "nonfinite_skipped": self.nonfinite.skipped(),
                "block_size": self.cfg.block_size,
                "target_layer_ids": list(self.target_layer_ids),
            }
        )

    def non_finite_params(self) -> list[str]:
        """Names of the parameters holding NaN/Inf (one device sync: for error paths only; under FSDP this
        replica's shards)."""
        local = {name: p.to_local() if self.fsdp is not None else p for name, p in self.model.named_parameters()}
        return [name for name, p in local.items() if not bool(torch.isfinite(p).all())]

    def load_state_dict(self, state: dict, source: str = "the checkpoint") -> None:
        """Load a state_dict() taken earlier; `source` (the checkpoint's path) is named in every error."""
        for key, mine in (("block_size", self.cfg.block_size), ("target_layer_ids", self.target_layer_ids)):
            if state[key] != mine:
                raise ValueError(f"drafter {self.cfg.name}: {source} has {key}={state[key]}, this job has {mine}")
        bad = [k for k, v in state["model"].items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:  # training on would skip every step and then blame the batches: say what is wrong now
            raise NonFiniteCheckpointError(
                f"drafter {self.cfg.name}: the weights loaded from {source} are non-finite"
                f" ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); resume from an earlier checkpoint"
            )
        check_optimizer_state(self.cfg, state["optimizer"], source)
        if self.fsdp is not None:
            self.fsdp.load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(cpu_copy(state["optimizer"]))  # never shares the caller's tensors
        self.scheduler.load_state_dict(state["scheduler"])
        own = self.fsdp.own_rng(state) if self.fsdp is not None else None
        rng = own if own is not None else state["rng"]  # under FSDP, its own anchor stream
        self.generator.set_state(rng)
        self._rng_at_step = rng.clone()
        self.last_seq, self.step, self.tokens = state["last_seq"], state["step"], state["tokens"]
        self.nonfinite.restart(state["nonfinite_skipped"])
        self._nonfinite_logged = state["nonfinite_skipped"]
        self.optimizer.zero_grad(set_to_none=True)
        self._pending_loss.zero_()
        self._pending_weight.zero_()
        self._pending_tokens = 0
        if self.fsdp is not None:
            self.fsdp.deferred.clear()
