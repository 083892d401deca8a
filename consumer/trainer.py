"""The drafter's training step engine, transport-free: packed batches in, optimizer steps out.

One call per packed batch (hidden [T, n·H], input_ids [T], loss_mask [T], cu_seqlens [nseq+1]).
Gradients accumulate until `tokens_per_step` tokens were seen (0: every batch is a step); the step
normalises by Σw over all its batches (dflash.md §2: Σ w·CE / Σ w), clips, and runs fused AdamW.

Nothing here synchronises with the device except on log steps: a non-finite loss or gradient is
detected on the device and the fused AdamW skips its update through `found_inf` (the GradScaler
protocol); the skip counters are read, logged and checked against max_nonfinite_steps on log steps.
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

from common.config import DrafterConfig
from consumer.kernels import weighted_ce
from consumer.loss import DraftMetrics, chunked_lm_head_loss
from consumer.model import DFlashDrafter, DrafterArch
from consumer.objective import attention_masks, build_draft_batch
from consumer.mask_token import resolve_mask_token_id
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


def _cpu_copy(obj):
    """A snapshot: every tensor copied to the CPU, so training on never changes a state already taken."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


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
    ):
        self.cfg = cfg
        self.device = torch.device(device)
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
        self.mask_token_id = resolve_mask_token_id(parts.path, parts.vocab_size, cfg.mask_token_id)
        frozen_dtype = self.autocast_dtype or torch.float32
        embed = parts.embed_tokens.to(self.device, frozen_dtype)
        lm_head = embed if parts.tie_word_embeddings else parts.lm_head.to(self.device, frozen_dtype)
        self.parts = dataclasses.replace(parts, embed_tokens=embed, lm_head=lm_head)  # no host copies kept
        self.arch = DrafterArch.from_target(parts, cfg, len(self.target_layer_ids))
        self.model = DFlashDrafter(self.arch, embed, lm_head, init_seed=self.seed).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in self.params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in self.params if p.ndim < 2], "weight_decay": 0.0},  # norm scales
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            functools.partial(
                lr_factor,
                total_steps=cfg.total_steps,
                warmup_frac=cfg.warmup_frac,
                min_lr_ratio=cfg.min_lr_ratio,
            ),
        )
        self.generator = torch.Generator(device=self.device).manual_seed(self.seed)  # anchor sampling
        self.metrics = DraftMetrics(cfg.block_size, self.device)
        # device-side skip bookkeeping: [skipped total, current run, longest run since read, run's first seq, last seq]
        self._nonfinite = torch.zeros(5, dtype=torch.int64, device=self.device)
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

    def _timer(self, name: str):
        return self.prof.timer(name) if self.prof else contextlib.nullcontext()

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def warmup(self, triton_cache_dir=None) -> None:
        """Compile/autotune the loss kernels for the training chunk before the first timed step."""
        rows = min(self.cfg.loss_chunk_rows, self.cfg.anchors_per_seq * self.cfg.block_size)
        weighted_ce.warmup(
            self.parts.vocab_size, rows, self.parts.lm_head.dtype, self.device, triton_cache_dir
        )

    def train_batch(
        self, hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, seq: int
    ) -> dict[str, float] | None:
        """Train on one packed batch; returns the metrics dict on log steps, else None.

        cu_seqlens is read on the host (its values size the step): pass a CPU tensor.
        """
        self.accumulate(hidden, input_ids, loss_mask, cu_seqlens, seq)
        if self.cfg.tokens_per_step and self._pending_tokens < self.cfg.tokens_per_step:
            return None
        return self.optimizer_step(seq)

    def accumulate(self, hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, seq: int) -> None:
        """Forward and backward of one packed batch; its gradients add up until `optimizer_step`.
        (Replica groups decide when to step together, so they call the two halves themselves.)"""
        cfg, dev = self.cfg, self.device
        T = input_ids.numel()
        if hidden.shape != (T, self.arch.num_features * self.arch.hidden_size):
            raise ValueError(
                f"batch seq {seq}: hidden has shape {tuple(hidden.shape)}, expected"
                f" [{T}, {self.arch.num_features} × {self.arch.hidden_size}] (tokens × fused target layers)"
            )
        with self._timer("anchors"):
            input_ids = input_ids.to(dev, torch.int64, non_blocking=True)
            loss_mask = loss_mask.to(dev, non_blocking=True)
            hidden = hidden.to(dev, non_blocking=True)
            if self.autocast_dtype is None:
                hidden = hidden.float()
            batch = build_draft_batch(
                input_ids,
                loss_mask,
                cu_seqlens.cpu(),
                anchors_per_seq=cfg.anchors_per_seq,
                block_size=cfg.block_size,
                mask_token_id=self.mask_token_id,
                gamma=cfg.loss_gamma,
                generator=self.generator,
                partial_blocks=cfg.partial_blocks,
            )
            masks = attention_masks(batch, self.arch.attention_layers, cfg.sliding_window, flex=self.use_flex)
        with self._timer("forward"), self._autocast():
            h = self.model(hidden, batch.ctx_pos, batch.block_ids, batch.block_pos, masks)
            loss_sum, correct = chunked_lm_head_loss(
                h, self.model.lm_head, batch.labels, batch.weights, cfg.loss_chunk_rows
            )
        with self._timer("backward"):
            loss_sum.backward()
        self._pending_loss += loss_sum.detach()
        self._pending_weight += batch.weights.sum()
        self.metrics.add(loss_sum, correct, batch.weights, batch.anchor_valid)
        self._pending_tokens += T
        if self.prof:
            self.prof.count("tokens", T)
            self.prof.count("anchors", batch.num_anchors)  # anchor slots, padding included (no sync)
            self.prof.count("batches", 1)

    def optimizer_step(self, seq: int) -> dict[str, float] | None:
        """Close the step whose last batch is `seq`; returns the metrics dict on log steps, else None.

        `grad_sync`, when set, sums the gradients, Σw and Σw·CE over the replica group first.
        """
        if self.grad_sync is not None:
            self.grad_sync(self.params, self._pending_weight, self._pending_loss)
        with self._timer("optimizer"):
            self._optimizer_step(seq)
        return self._read_metrics() if self.step % self.cfg.log_every == 0 else None

    def _optimizer_step(self, seq: int) -> None:
        inv_weight = 1.0 / self._pending_weight.clamp_min(1e-12)  # Σ w·CE / Σ w over the whole step
        grads = [p.grad for p in self.params]
        torch._foreach_mul_(grads, inv_weight)
        self._grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=True)
        bad = ~(torch.isfinite(self._grad_norm) & torch.isfinite(self._pending_loss))
        self.optimizer.found_inf = bad.float()  # fused AdamW skips the whole update when set
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        nf, b = self._nonfinite, bad.long()
        run = (nf[1] + 1) * b  # consecutive skipped steps, 0 after a good one
        self._nonfinite.copy_(
            torch.stack(
                [
                    nf[0] + b,
                    run,
                    torch.maximum(nf[2], run),
                    torch.where(run == 1, seq, nf[3]),  # first seq of the current run
                    torch.where(bad, seq, nf[4]),  # latest skipped seq
                ]
            )
        )
        self._pending_loss.zero_()
        self._pending_weight.zero_()
        self.step += 1
        self.tokens += self._pending_tokens
        self._pending_tokens = 0
        self.last_seq = seq
        self._rng_at_step = self.generator.get_state()

    def _read_metrics(self) -> dict[str, float]:
        """Log steps only: the one place that synchronises."""
        skipped, run, longest, first_bad, last_bad = self._nonfinite.tolist()
        self._nonfinite[2] = run  # the window's longest run restarts from the current one
        if skipped > self._nonfinite_logged:
            log.warning(
                "drafter %s: skipped %d optimizer step(s) with a non-finite loss or gradient since the last"
                " log (%d in all), the latest at batch seq %d",
                self.cfg.name,
                skipped - self._nonfinite_logged,
                skipped,
                last_bad,
            )
            self._nonfinite_logged = skipped
        if longest >= self.cfg.max_nonfinite_steps:
            bad_weights = self.non_finite_params()
            cause = (
                f" The drafter's own weights are non-finite ({', '.join(bad_weights[:3])}), so every step fails"
                " whatever the batches hold." if bad_weights else
                " The weights are finite, so the batches are: non-finite hidden states from the producer are"
                " the usual cause; check the target's dtype and the batches at those seqs."
            )
            raise NonFiniteTrainingError(
                f"drafter {self.cfg.name}: {longest} optimizer steps in a row had a non-finite loss or"
                f" gradient (max_nonfinite_steps={self.cfg.max_nonfinite_steps}), from batch seq {first_bad}"
                f" to seq {last_bad}.{cause}"
            )
        out = self.metrics.read()
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
        (batches accumulated since then are not in it: resume replays them from last_seq + 1)."""
        return _cpu_copy(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": self._rng_at_step,
                "last_seq": self.last_seq,
                "step": self.step,
                "tokens": self.tokens,
                "nonfinite_skipped": int(self._nonfinite[0]),
                "block_size": self.cfg.block_size,
                "target_layer_ids": list(self.target_layer_ids),
            }
        )

    def non_finite_params(self) -> list[str]:
        """Names of the parameters holding NaN/Inf (one device sync: for load time and error paths only)."""
        return [name for name, p in self.model.named_parameters() if not bool(torch.isfinite(p).all())]

    def load_state_dict(self, state: dict, source: str = "the checkpoint") -> None:
        """Load a state_dict() taken earlier; `source` (the checkpoint's path) is named in every error."""
        for key, mine in (("block_size", self.cfg.block_size), ("target_layer_ids", self.target_layer_ids)):
            if state[key] != mine:
                raise ValueError(
                    f"drafter {self.cfg.name}: {source} has {key}={state[key]}, this job has {mine}"
                )
        self.model.load_state_dict(state["model"])
        bad = self.non_finite_params()
        if bad:  # training on would skip every step and then blame the batches: say what is wrong now
            raise NonFiniteCheckpointError(
                f"drafter {self.cfg.name}: the weights loaded from {source} are non-finite"
                f" ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); resume from an earlier checkpoint"
            )
        self.optimizer.load_state_dict(_cpu_copy(state["optimizer"]))  # never shares the caller's tensors
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["rng"])
        self._rng_at_step = state["rng"].clone()
        self.last_seq, self.step, self.tokens = state["last_seq"], state["step"], state["tokens"]
        self._nonfinite.zero_()
        self._nonfinite[0] = state["nonfinite_skipped"]
        self._nonfinite_logged = state["nonfinite_skipped"]
        self.optimizer.zero_grad(set_to_none=True)
        self._pending_loss.zero_()
        self._pending_weight.zero_()
        self._pending_tokens = 0
