"""The drafter's training step engine, transport-free: packed batches in, optimizer steps out.

One call per packed batch (hidden [T, n·H], input_ids [T], loss_mask [T], cu_seqlens [nseq+1]).
Gradients accumulate until `tokens_per_step` tokens were seen (0: every batch is a step); the step
divides by the loss's normaliser summed over all its batches and replicas (consumer/loss.py: the valid
anchors under D-PACE, Σw under the decayed CE), clips, and steps the optimizer (consumer/optim.py).

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

from common.config import DataConfig, DrafterConfig
from common.host_memory import keep_freed_memory
from consumer.distributed import GroupError
from consumer.kernels import weighted_ce
from consumer.kernels.flex import CompiledFlex, FlexPlan
from consumer.loss import DraftMetrics, chunked_lm_head_loss, slot_loss
from consumer.mask_token import resolve_mask_token_id
from consumer.model import DFlashDrafter, DrafterArch
from consumer.objective import anchor_budget, attention_masks, build_draft_batch
from consumer.optim import build_optimizer, check_optimizer_state
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
        self.model = DFlashDrafter(self.arch, embed, lm_head, init_seed=self.seed).to(self.device)
        # flex compiled for this run's one padded shape: the full batch and the anchor budget (kernels/flex.py)
        self.flex = CompiledFlex(FlexPlan.for_run(tokens_per_batch, self.max_anchors, cfg.block_size,
                                                  len(set(self.arch.attention_layers))), prof) if self.use_flex else None
        self.slot_loss = slot_loss(cfg.loss, cfg.block_size, cfg.dpace_alpha)
        self._build_optimizer()
        self.mesh = None  # FSDP2's device mesh once `shard` ran: parameters are DTensor shards
        self._deferred: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # FSDP: batches of the open step
        self._full_state: tuple[int, dict, dict, Tensor] | None = None  # FSDP: (step, model, optim, rngs)
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

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        schedule = functools.partial(
            lr_factor, total_steps=cfg.total_steps, warmup_frac=cfg.warmup_frac, min_lr_ratio=cfg.min_lr_ratio
        )
        self.optimizer, self.scheduler = build_optimizer(cfg, self.model.named_parameters(), schedule)

    # ------------------------------------------------------------------------------------------ FSDP2
    def shard(self, mesh) -> None:
        """FSDP2 (`fully_shard`) over `mesh`: each decoder layer and the root are sharded units, so a replica
        holds 1/world of the weights, gradients and Adam moments. Call on every replica, before any step or
        state load, with identical weights everywhere (the group broadcasts them first).

        The step keeps its meaning: reduce-scatter SUMS the gradients (divide factor 1; the step divides by
        the group's Σw as without sharding), clipping sees the global norm, the checkpoint holds full tensors
        in the unsharded format. What changes: FSDP's forward is collective, so a replica cannot run a batch
        when it arrives; `accumulate` keeps it and `optimizer_step` runs the step's batches in lockstep, a
        replica with fewer batches running zero-weight stand-ins (see `_run_deferred`)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.step or self._pending_tokens:
            raise RuntimeError(f"drafter {self.cfg.name}: shard() after training started")
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # a sum, as the unsharded group's all-reduce,
                module.set_force_sum_reduction_for_comms(True)  # as a plain SUM (gloo has no PREMUL_SUM)
        self.mesh = mesh
        self._dummy_generator = torch.Generator(device=self.device)
        self._build_optimizer()

    def _collective(self, what: str, fn: Callable[[], object]):
        try:
            return fn()
        except RuntimeError as err:
            raise GroupError(f"drafter {self.cfg.name}: the replica group failed during {what} (a replica died"
                             f" or timed out): {str(err).splitlines()[0][:300]}") from err

    def _run_deferred(self) -> None:
        """FSDP: forward + backward of this replica's batches of the step, in lockstep with the group. Every
        replica runs as many passes as the one with the most batches; the missing ones are stand-ins of
        zero weight (their own generator: the anchor RNG stays what it is without sharding). Gradients are
        reduce-scattered once, after the last pass."""
        import torch.distributed as dist

        count = torch.tensor([len(self._deferred)], dtype=torch.int64)
        self._collective("the batch-count all-reduce",
                         lambda: dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.mesh.get_group()))
        passes = int(count)
        for i in range(passes):
            self.model.set_requires_gradient_sync(i == passes - 1)
            if i < len(self._deferred):
                self._collective("an FSDP forward/backward", lambda i=i: self._forward_backward(*self._deferred[i]))
            else:
                self._collective("an FSDP forward/backward", self._stand_in_pass)
        self._deferred.clear()

    def _stand_in_pass(self) -> None:
        T = 2 * self.cfg.block_size
        hidden = torch.zeros(T, self.arch.num_features * self.arch.hidden_size, device=self.device)
        ids = torch.zeros(T, dtype=torch.int64, device=self.device)
        self._forward_backward(hidden, ids, torch.ones(T, dtype=torch.uint8),
                               torch.tensor([0, T], dtype=torch.int32), stand_in=True)

    def gather_full_state(self) -> None:
        """FSDP: every replica calls this together before a checkpoint (ReplicaGroup.gather_trained does):
        the full weights and Adam moments, gathered tensor by tensor to the CPU, in the unsharded format, and
        every replica's anchor RNG (each drew for its own batches: a bit-exact resume needs them all).
        Only rank 0 (the writer) keeps the result, until `state_dict` hands it over once."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        keep = self.mesh.get_local_rank() == 0

        def full(t):
            t = t.full_tensor() if isinstance(t, DTensor) else t  # collective: every replica takes part
            return _cpu_copy(t) if keep else None

        def gather():
            model = {k: full(v) for k, v in self.model.state_dict().items()}
            optim = self.optimizer.state_dict()
            optim = {**optim, "state": {i: {k: full(v) for k, v in st.items()} for i, st in optim["state"].items()}}
            rngs = [torch.empty_like(self._rng_at_step) for _ in range(self.mesh.size())]
            dist.all_gather(rngs, self._rng_at_step, group=self.mesh.get_group())
            return model, _cpu_copy(optim), torch.stack(rngs)

        gathered = self._collective("the checkpoint gather", gather)
        self._full_state = (self.step, *gathered) if keep else None

    def _load_sharded(self, model: dict, optim: dict) -> None:
        """FSDP: cut this replica's shards out of full tensors (every replica holds the same full state)."""
        from torch.distributed.tensor import distribute_tensor

        def shard_like(full: Tensor, p) -> Tensor:
            return distribute_tensor(full.to(self.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None)

        names = dict(self.model.named_parameters())
        if set(names) != set(model):
            raise ValueError(f"drafter {self.cfg.name}: checkpoint weights {sorted(set(model) ^ set(names))[:4]}"
                             " do not match this drafter's")
        with torch.no_grad():
            for name, p in names.items():
                p.copy_(shard_like(model[name], p))
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {i: {k: shard_like(v, params[i]) if torch.is_tensor(v) and v.shape == params[i].shape and v.ndim
                     else v for k, v in st.items()} for i, st in optim["state"].items()}
        self.optimizer.load_state_dict({**optim, "state": state})

    # ------------------------------------------------------------------------------------------ training
    def _timer(self, name: str):
        return self.prof.timer(name) if self.prof else contextlib.nullcontext()

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def warmup(self, triton_cache_dir=None) -> None:
        """Compile/autotune the loss kernels for the training chunk before the first timed step."""
        rows = min(self.cfg.loss_chunk_rows, self.max_anchors * self.cfg.block_size)
        weighted_ce.warmup(
            self.parts.vocab_size, rows, self.parts.lm_head.dtype, self.device, triton_cache_dir
        )

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
        if self.mesh is not None:  # FSDP: run in lockstep with the group at optimizer_step
            self._deferred.append((hidden.clone(), input_ids.clone(), loss_mask.clone(), cu_seqlens.clone()))
            return
        self._forward_backward(hidden, input_ids, loss_mask, cu_seqlens)

    def _forward_backward(self, hidden: Tensor, input_ids: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, *,
                          stand_in: bool = False) -> None:
        cfg, dev = self.cfg, self.device
        with self._timer("anchors"):
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
                generator=self._dummy_generator.manual_seed(0) if stand_in else self.generator,
                partial_blocks=cfg.partial_blocks,
                max_anchors=self.max_anchors,
            )
            masks = attention_masks(batch, self.arch.attention_layers, cfg.sliding_window, flex=self.use_flex,
                                    kernel=self.flex)
        with self._timer("forward"), self._autocast():
            h = self.model(hidden, batch.ctx_pos, batch.block_ids, batch.block_pos, masks)
            weights = self.slot_loss.base_weights(batch.weights)
            loss_sum, correct = chunked_lm_head_loss(
                h, self.model.lm_head, batch.labels, weights, cfg.loss_chunk_rows, self.slot_loss
            )
        with self._timer("backward"):
            (loss_sum * 0.0 if stand_in else loss_sum).backward()  # a stand-in adds zero to every gradient
        if stand_in:
            return
        normaliser = self.slot_loss.normaliser(weights)  # summed over the step's rounds and replicas
        self._pending_loss += loss_sum.detach()
        self._pending_weight += normaliser
        self.metrics.add(loss_sum, correct, weights, normaliser)
        if self.prof:
            self.prof.count("anchors", batch.num_anchors)  # a host count (no sync)

    def optimizer_step(self, seq: int) -> dict[str, float] | None:
        """Close the step whose last batch is `seq`; returns the metrics dict on log steps, else None.

        `grad_sync`, when set, sums the gradients, Σw and Σw·CE over the replica group first.
        """
        if self.mesh is not None:
            self._run_deferred()
        if self.grad_sync is not None:
            self.grad_sync(self.params, self._pending_weight, self._pending_loss)
        with self._timer("optimizer"):
            self._optimizer_step(seq)
        return self._read_metrics() if self.step % self.cfg.log_every == 0 else None

    def _optimizer_step(self, seq: int) -> None:
        inv_weight = 1.0 / self._pending_weight.clamp_min(1e-12)  # Σ w·CE / the step's normaliser (Σw, anchors)
        grads = [p.grad for p in self.params]
        torch._foreach_mul_(grads, inv_weight)
        self._grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=True)
        if self.mesh is not None:  # a replicated DTensor: the same global norm on every replica
            self._grad_norm = self._grad_norm.full_tensor()
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
        (batches accumulated since then are not in it: resume replays them from last_seq + 1).
        Under FSDP: the full state `gather_full_state` took at this step (gathering is collective)."""
        sharded = {}
        if self.mesh is None:
            model, optim = self.model.state_dict(), self.optimizer.state_dict()
        elif self._full_state is None or self._full_state[0] != self.step:
            raise RuntimeError(f"drafter {self.cfg.name}: no full FSDP state gathered at step {self.step}: every"
                               " replica calls gather_full_state() before a checkpoint, and rank 0 takes it once")
        else:
            _, model, optim, rngs = self._full_state
            self._full_state = None  # handed over: a full copy of the state is not kept between checkpoints
            sharded = {"rng_replicas": rngs}  # [world, n]: replica r's anchor RNG in row r
        return _cpu_copy(
            {
                **sharded,
                "model": model,
                "optimizer": optim,
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
        """Names of the parameters holding NaN/Inf (one device sync: for error paths only; under FSDP this
        replica's shards)."""
        local = {name: p.to_local() if self.mesh is not None else p for name, p in self.model.named_parameters()}
        return [name for name, p in local.items() if not bool(torch.isfinite(p).all())]

    def load_state_dict(self, state: dict, source: str = "the checkpoint") -> None:
        """Load a state_dict() taken earlier; `source` (the checkpoint's path) is named in every error."""
        for key, mine in (("block_size", self.cfg.block_size), ("target_layer_ids", self.target_layer_ids)):
            if state[key] != mine:
                raise ValueError(
                    f"drafter {self.cfg.name}: {source} has {key}={state[key]}, this job has {mine}"
                )
        bad = [k for k, v in state["model"].items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:  # training on would skip every step and then blame the batches: say what is wrong now
            raise NonFiniteCheckpointError(
                f"drafter {self.cfg.name}: the weights loaded from {source} are non-finite"
                f" ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); resume from an earlier checkpoint"
            )
        check_optimizer_state(self.cfg, state["optimizer"], source)
        if self.mesh is not None:
            self._load_sharded(state["model"], state["optimizer"])
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(_cpu_copy(state["optimizer"]))  # never shares the caller's tensors
        self.scheduler.load_state_dict(state["scheduler"])
        rng = state["rng"]
        if self.mesh is not None and len(state.get("rng_replicas", ())) == self.mesh.size():
            rng = state["rng_replicas"][self.mesh.get_local_rank()].clone()  # its own anchor stream (a copy:
            # set_state on a row view of the stacked tensor crashed the process)
        self.generator.set_state(rng)
        self._rng_at_step = rng.clone()
        self.last_seq, self.step, self.tokens = state["last_seq"], state["step"], state["tokens"]
        self._nonfinite.zero_()
        self._nonfinite[0] = state["nonfinite_skipped"]
        self._nonfinite_logged = state["nonfinite_skipped"]
        self.optimizer.zero_grad(set_to_none=True)
        self._pending_loss.zero_()
        self._pending_weight.zero_()
        self._pending_tokens = 0
        self._deferred.clear()
