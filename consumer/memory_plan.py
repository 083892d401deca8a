"""The consumer's GPU memory at the job's real shapes, planned without a GPU (common/memory_plan.py says how).

Per drafter replica, MemTracker's peak over two training steps of the real drafter (consumer/model.py, the real
anchors of consumer/objective.py, the real chunked loss, the trainer's own optimizer from consumer/optim.py),
run on fake tensors at a batch of tokens_per_batch tokens: the fp32 weights, gradients and optimizer state
(fused AdamW's two moments; or Muon's momentum, its skip's one-matrix copies and Newton-Schulz temporaries,
with AdamW's moments for the rest), the frozen embedding and LM head, every
activation the backward keeps and the temporaries between. A CUDA step is planned
as the trainer runs it on CUDA (bf16 autocast, frozen parts in bf16, FlexAttention over bucket-padded q/k/v);
what has no CPU form is stood in by its memory: FlexAttention's fused kernels (output and log-sum-exp forward;
dq, dk, dv backward; the block mask's index tensors) and the Triton cross-entropy (in place, three [rows]
vectors). A CPU step runs everything as the CPU trainer does (tests check it against measured CPU peaks).

The batch's features are not part of the step's peak: they are the copy-out's buffers (consumer/copy_out.py),
planned apart as `copy_out`: two sets of device fields at tokens_per_batch rows, one per consumer whatever
the number of producers feeding it.

FSDP (distributed = "fsdp") keeps 1/world of the weights and optimizer state per replica plus the unsharded
working set of its units (the layer being run, the one prefetched, one layer's gradients before the
reduce-scatter): applied to the measured peak, gradients conservatively left whole.
Each consumer also opens a CUDA context on every ring's GPU it reads (target replicas' rank 0 devices).
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch
from torch import Tensor

from common.config import DrafterConfig, JobConfig
from common.memory_plan import CUDA_CONTEXT_BYTES, ProcessMemory, tracked_peak
from common.packed_batch import ITEM_BYTES
from common.role_plans import PlanInputError, plan_command
from consumer.copy_out import copy_out_rows, planned_device_bytes
from consumer.objective import anchor_budget

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _FlexStandIn(torch.autograd.Function):
    """FlexAttention's memory without its kernels: forward writes out [1, h, Qp, d] and lse [1, h, Qp] (fp32)
    and keeps q, k, v, out, lse; backward writes delta [1, h, Qp] (fp32), dq, dk, dv."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, _out, lse = ctx.saved_tensors
        _delta = torch.empty_like(lse)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flex_stand_in(q: Tensor, k: Tensor, v: Tensor, *, block_mask=None, enable_gqa: bool = False) -> Tensor:
    return _FlexStandIn.apply(q, k, v)


def _triton_ce_stand_in(logits: Tensor, labels: Tensor, weights: Tensor, need_grad: bool = True):
    """consumer.kernels.weighted_ce_ on CUDA: the gradient overwrites the logits; three fp32 [R] outputs."""
    if need_grad:
        weights.float()
    return tuple(torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device) for _ in range(3))


@contextlib.contextmanager
def _kernels_stood_in(cuda: bool):
    """The kernels a fake tensor cannot run, replaced by their memory stand-ins for the duration of a fake step:
    FlexAttention on CUDA, and the Triton cross-entropy wherever the real step would run it (CUDA, or the
    interpreter under TRITON_INTERPRET=1); the torch fallback of the CPU runs as it is."""
    from consumer import loss, model
    from consumer.kernels import weighted_ce

    saved = model._eager_flex, loss.weighted_ce_
    if cuda:  # the masks below are bare BlockMasks on the plan's grid, which model.attend runs with _eager_flex
        model._eager_flex = lambda q, k, v, block_mask: _flex_stand_in(q, k, v, block_mask=block_mask)
    if cuda or (weighted_ce.triton is not None and weighted_ce.INTERPRET):
        loss.weighted_ce_ = _triton_ce_stand_in
    try:
        yield
    finally:
        model._eager_flex, loss.weighted_ce_ = saved


def _block_masks(batch, kinds: set[str], tokens_per_batch: int, anchors: int) -> dict:
    """A BlockMask per layer kind with the real one's grid (the run's FlexPlan: every batch is padded to
    tokens_per_batch context and anchor budget × B block rows, consumer/kernels/flex.py) and index tensors."""
    from torch.nn.attention.flex_attention import BlockMask

    from consumer.kernels.flex import FLEX_TILE, FlexPlan

    plan = FlexPlan.for_run(tokens_per_batch, anchors, batch.block_size, len(kinds))
    Tp, Qp = plan.padded(batch.num_tokens, batch.num_anchors * batch.block_size)
    nq, nk = Qp // FLEX_TILE, (Tp + Qp) // FLEX_TILE

    def blocks(rows: int, cols: int) -> tuple[Tensor, Tensor]:
        return torch.zeros(1, 1, rows, dtype=torch.int32), torch.zeros(1, 1, rows, cols, dtype=torch.int32)

    def one() -> BlockMask:
        (kvn, kvi), (fkvn, fkvi), (qn, qi), (fqn, fqi) = blocks(nq, nk), blocks(nq, nk), blocks(nk, nq), blocks(nk, nq)
        return BlockMask((Qp, Tp + Qp), kvn, kvi, fkvn, fkvi, qn, qi, fqn, fqi, (FLEX_TILE, FLEX_TILE))

    return {kind: one() for kind in kinds}


def step_peak(
    arch,
    cfg: DrafterConfig,
    vocab: int,
    tied: bool,
    tokens: int,
    max_length: int,
    feature_dtype: str,
    cuda: bool,
    anchors: int | None = None,
    features_outside: bool = False,
) -> dict[str, int]:
    """Peak bytes of the drafter's training (two steps: the second has Adam's moments) at `tokens` tokens per
    batch in sequences of `max_length`, and the parts of it that are state; fake tensors throughout.
    `features_outside`: the batch's features are the copy-out's buffers, planned apart (not in the peak)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from consumer.dflash2 import DFlash2Drafter, make_drafter
    from consumer.dspark import DSparkDrafter
    from consumer.loss import chunked_lm_head_loss
    from consumer.objective import attention_masks, build_draft_batch
    from consumer.optim import build_optimizer

    nseq = math.ceil(tokens / max_length)
    lengths = [tokens // nseq + (i < tokens % nseq) for i in range(nseq)]
    if anchors is None:
        anchors = anchor_budget(tokens, cfg.anchors_per_batch, cfg.anchors_per_seq)  # the most a batch runs
    per_seq = max(1, math.ceil(anchors / nseq))
    autocast = DTYPES[cfg.dtype] if cuda and cfg.dtype != "float32" else None
    frozen = autocast or torch.float32
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)  # real: the step reads it on the host
    # the anchors are drawn from host copies of loss_mask and cu_seqlens (data-dependent: no fake tensor can),
    # so the batch is built for real once, outside the fake mode; its int tensors are a few MB at real shapes
    ids, mask = torch.zeros(tokens, dtype=torch.int64), torch.ones(tokens, dtype=torch.uint8)
    batch = build_draft_batch(
        ids,
        mask,
        cu,
        anchors_per_seq=per_seq,
        block_size=cfg.block_size,
        mask_token_id=0,
        gamma=cfg.loss_gamma,
        generator=torch.Generator().manual_seed(0),
        partial_blocks=cfg.partial_blocks,
        max_anchors=anchors,
    )
    with FakeTensorMode(allow_non_fake_inputs=True), _kernels_stood_in(cuda):
        embed = torch.empty(vocab, arch.hidden_size, dtype=frozen)
        model = make_drafter(cfg, arch, embed, embed if tied else torch.empty(vocab, arch.hidden_size, dtype=frozen), 0)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer, _ = build_optimizer(cfg, model.named_parameters(), lambda step: 1.0)  # the trainer's own
        torch_optimizers = list(optimizer.torch_optimizers().values()) if cfg.optimizer == "muon" else [optimizer]

        def features() -> Tensor:
            hidden = torch.empty(tokens, arch.num_features * arch.hidden_size, dtype=DTYPES[feature_dtype])
            return hidden if autocast else hidden.float()

        copied_out = features() if features_outside else None  # made before the tracker: not in its peak

        def one_step():
            hidden = copied_out if copied_out is not None else features()
            kinds = set(arch.attention_layers)
            masks = (
                _block_masks(batch, kinds, tokens, anchors)
                if cuda
                else attention_masks(batch, arch.attention_layers, cfg.sliding_window, flex=False)
            )
            with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
                h = model(hidden, batch.ctx_pos, batch.block_ids, batch.block_pos, masks)
                loss_sum, _correct = chunked_lm_head_loss(
                    h, model.lm_head, batch.labels, batch.weights, cfg.loss_chunk_rows
                )
                if isinstance(model, DFlash2Drafter):
                    # its weights, gradients and moments are planned; the selector loss's activations (one chunk
                    # at a time, recomputed in backward) are not: MemTracker refuses a module called per chunk
                    loss_sum = loss_sum + 0.0 * sum(p.sum() for p in model.candidate_selector.parameters())
                if isinstance(model, DSparkDrafter):  # the same for DSpark's Markov and confidence heads
                    heads = (*model.markov_head.parameters(), *model.confidence_head.parameters())
                    loss_sum = loss_sum + 0.0 * sum(p.sum() for p in heads)
            loss_sum.backward()
            weight = batch.weights.sum()
            torch._foreach_mul_([p.grad for p in params], 1.0 / weight.clamp_min(1e-12))
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=True)
            optimizer.found_inf = (~torch.isfinite(norm)).float()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        one_step()  # creates the optimizer's state; MemTracker follows one iteration, the second (steady) step
        peak = tracked_peak(one_step, [model], torch_optimizers)
        n_params = sum(p.numel() for p in params)
        state_bytes = sum(
            t.untyped_storage().nbytes()
            for o in torch_optimizers
            for st in o.state.values()
            for t in st.values()
            if isinstance(t, Tensor) and t.ndim > 0
        )
        unit = max(sum(p.numel() for p in layer.parameters()) for layer in model.layers)
        root = n_params - sum(p.numel() for p in model.layers.parameters())
        frozen_bytes = sum(
            b.untyped_storage().nbytes() for b in {id(b): b for b in (model.embed_tokens, model.lm_head)}.values()
        )
    return {
        "peak": peak,
        "params": n_params,
        "optimizer_state": state_bytes,
        "largest_unit": max(unit, root),
        "frozen": frozen_bytes,
    }


def fsdp_peak(step: dict[str, int], world: int) -> int:
    """The step's peak with the fp32 weights (4 bytes a parameter) and the optimizer's state (AdamW's two moments,
    Muon's momentum) sharded over `world`, plus the unsharded working set of three of its largest units (run,
    prefetched, gradients before the reduce-scatter)."""
    if world == 1:
        return step["peak"]
    sharded = 4 * step["params"] + step["optimizer_state"]
    return int(step["peak"] - sharded * (1 - 1 / world) + 3 * 4 * step["largest_unit"])


def copy_out_bytes(job: JobConfig, feature_width: int, cuda: bool = True) -> int:
    """A consumer's copy-out buffers on its device (consumer/copy_out.py): one CopyOut for all the producers
    feeding it (consumer/build.py build_stream), so the number of producers does not enter."""
    return planned_device_bytes(copy_out_rows(job), feature_width, ITEM_BYTES[job.target.dtype], cuda)


def plan_drafters(job: JobConfig, config) -> list[ProcessMemory]:
    """One entry per consumer on a CUDA device, plus its context on each ring GPU it reads."""
    from consumer.model import DrafterArch
    from consumer.target_parts import TargetParts, _dims

    text = config.get_text_config()
    dims = _dims(text, job.target.path)
    tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))
    parts = TargetParts(path=job.target.path, tie_word_embeddings=tied, embed_tokens=None, lm_head=None, **dims)
    n = len(job.target.layer_ids) if job.target.layer_ids else job.target.num_features
    rings = (
        sorted({job.target.devices_of(r)[0] for r in range(job.target.replicas)})
        if job.transport_kind == "cuda"
        else []
    )
    out = []
    for d in job.drafters:
        cuda = [r for r in range(d.replicas) if d.device_of(r).startswith("cuda")]
        if not cuda:
            continue
        arch = DrafterArch.from_target(parts, d, n)
        step = step_peak(
            arch,
            d,
            dims["vocab_size"],
            tied,
            job.data.tokens_per_batch,
            job.data.max_length,
            job.target.dtype,
            cuda=True,
            features_outside=True,
        )
        peak = fsdp_peak(step, d.replicas) if d.distributed == "fsdp" else step["peak"]
        copy_out = copy_out_bytes(job, n * arch.hidden_size)
        for r in cuda:
            dev, name = d.device_of(r), f"consumer-{d.name}-r{r}"
            out.append(
                ProcessMemory(
                    name,
                    dev,
                    {
                        "frozen_embed_head": step["frozen"],
                        "copy_out": copy_out,
                        "train_step": peak - step["frozen"],
                        "cuda_context": CUDA_CONTEXT_BYTES,
                    },
                )
            )
            out += [ProcessMemory(name, ring, {"cuda_context": CUDA_CONTEXT_BYTES}) for ring in rings if ring != dev]
    return out


DESCRIPTION = (
    "the drafter replicas' planned GPU memory (common/memory_plan.py), one JSON line per process and device with --json"
)


def read_config(job: JobConfig, folder: str):
    """The plan commands' input reader (common/role_plans.py): the target's config, as plan_drafters reads it."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise PlanInputError(
            f"{folder}/config.json: cannot read the target's config ({err}); pass"
            " --target-config DIR where the model is not on this machine"
        ) from None


def main(argv: list[str]) -> int:
    """`python -m consumer memory-plan JOB [--target-config DIR] [--json]`: one line per process and device."""
    return plan_command("consumer", "memory-plan", argv, DESCRIPTION, read_config, memory=plan_drafters)
