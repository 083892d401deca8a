"""The drafter steps bench.drafter times, wired as consumer/trainer.py `_forward_backward` and `_optimizer_step`
wire a training step: the same loss calls with the same arguments, the same normaliser, clip and skip.

A step: forward; the loss sum (chunked_lm_head_loss with the job's SlotLoss, the DFlash2 unary top-k and the
weights used taken from its logits pass, plus selector_alpha × selector_loss for DFlash2); backward of the
sum; gradients × 1 / the SlotLoss's normaliser; clip to grad_clip; fused AdamW (skipping a non-finite step
through found_inf). The baseline swaps only the loss call for full_logits_loss. Knobs the bench does not
vary (D-PACE α, selector α, k, rank, conv taps, clip) are DrafterConfig's defaults.
"""

from __future__ import annotations

import dataclasses

import torch

from bench.drafter_memory import StepKind
from common.config import DrafterConfig
from consumer.dflash2 import DFlash2Shape, selector_loss
from consumer.loss import chunked_lm_head_loss, full_logits_loss, slot_loss

DEFAULTS = {name: field.default for name, field in DrafterConfig.model_fields.items()}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One step the bench times: which drafter, which `loss` key, and how the loss is computed."""

    name: str
    about: str
    drafter: str  # drafters.arch: "dflash1" | "dflash2"
    loss: str  # drafters.loss: "decay" | "dpace"
    full_logits: bool = False  # the baseline: full_logits_loss instead of the chunked loss
    selector: bool = False  # DFlash2's selector loss (and the unary top-k it needs)

    @property
    def memory(self) -> StepKind:
        return StepKind(full_logits=self.full_logits, dflash2=self.drafter == "dflash2", selector=self.selector)


# in run order: the first profiled step of each drafter creates its Adam state (bench/drafter.py)
VARIANTS = {
    v.name: v
    for v in (
        Variant("chunked", "DFlash1, chunked loss, decayed CE", "dflash1", "decay"),
        Variant("naive", "DFlash1, full logits, decayed CE (the baseline)", "dflash1", "decay", full_logits=True),
        Variant("dpace", "DFlash1, chunked loss, D-PACE", "dflash1", "dpace"),
        Variant("dflash2", "DFlash2, chunked unary loss + selector loss, D-PACE", "dflash2", "dpace", selector=True),
        Variant("dflash2_unary", "DFlash2 without the selector loss (its cost split)", "dflash2", "dpace"),
    )
}


def dflash2_shape(block: int) -> DFlash2Shape:
    """DFlash2's shape keys at DrafterConfig's defaults."""
    keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    return DFlash2Shape(block, *(DEFAULTS[k] for k in keys))


def loss_sum(model, h, labels, weights, slot, variant: Variant, chunk_rows: int):
    """Σ w·CE of one batch as the trainer's _forward_backward computes it (its lines, this variant's branch)."""
    if variant.full_logits:
        return full_logits_loss(h, model.lm_head, labels, weights, slot)[0]
    cand = used = None
    if variant.selector:  # the unary top-k from the loss's own logits pass
        cand = torch.empty(h.shape[0], model.candidate_selector.top_k, dtype=torch.int64, device=h.device)
        used = torch.empty(weights.shape, dtype=torch.float32, device=h.device)
    total, _correct = chunked_lm_head_loss(h, model.lm_head, labels, weights, chunk_rows, slot, cand, used)
    if variant.selector:  # L = L_unary + α·L_sel, the selector's slots weighed as the unary loss weighed them
        sel_sum, _stats = selector_loss(model, h, labels, used, chunk_rows, cand)
        total = total + DEFAULTS["selector_alpha"] * sel_sum
    return total


def make_step(model, batch, mask, features, variant: Variant, opt, chunk_rows: int):
    """One training step of `variant` on `batch` (a closure: the bench calls it again and again)."""
    slot = slot_loss(variant.loss, batch.block_size, DEFAULTS["dpace_alpha"])
    weights = slot.base_weights(batch.weights)
    inv_normaliser = 1.0 / slot.normaliser(weights, batch.num_sequences).clamp_min(1e-12)
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        h = model(features, batch.ctx_pos, batch.block_ids, batch.block_pos, mask)
        loss_sum(model, h, batch.labels, weights, slot, variant, chunk_rows).backward()
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], inv_normaliser)
        norm = torch.nn.utils.clip_grad_norm_(params, DEFAULTS["grad_clip"], foreach=True)
        opt.found_inf = (~torch.isfinite(norm)).float()  # fused AdamW skips the update when set
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step
