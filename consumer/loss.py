"""lm_head + weighted cross-entropy over chunks of query rows: the full [Q, V] logits never exist.

The lm_head is frozen, so the only gradient is d loss / d hidden, and it is produced chunk by chunk
inside the forward pass (as Liger's fused linear cross-entropy does): per chunk of rows,
    logits = h_c·Wᵀ -> kernel: lse, target, max -> kernel overwrites logits with w·(softmax - onehot)
    -> dh_c = g·W
and backward only scales the stored dh [Q, H] by the incoming gradient. That is the same two
[rows × V × H] matmuls an unchunked loss needs (logits forward, dh backward), where recomputing the
logits in backward would add a third (+50% on the dominant cost); memory is one chunk of logits plus
dh, which is the size of the hidden rows themselves.

What weighs each slot's CE and what the step divides by is a `SlotLoss` (dflash.md §2, docs/recipes.md):
`DecayLoss`, the DFlash paper's static exp(-(k-1)/γ) normalised by Σw, or `DPaceLoss` (D-PACE, arXiv
2605.18810), weights from the drafter's own per-slot CE, normalised by the step's count of valid anchors or
of sequences (`dpace_normaliser`).
Both take per-slot CE in and give weights and a normaliser out, so another term (a selector loss) can
reuse the same contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from consumer.kernels.weighted_ce import weighted_ce_

DPaceNormaliser = Literal["anchors", "sequences"]


def dpace_weights(ce: Tensor, mask: Tensor, alpha: float) -> Tensor:
    """D-PACE weights [A, B] from per-slot CE [A, B] and the supervision mask m [A, B] (1 where slot k
    carries loss), in float32 and without gradient (paper Eq. 7-9, recipes.md §1.1):
    q_k = exp(-ℓ_k), q̃_k = (1-α)·q_k + α (1 where m_k = 0: a masked slot is a multiplicative no-op),
    C_k = Π_{i<=k} q̃_i, w_k = m_k · Σ_{j>=k} m_j·C_j. A slot's weight is the credit the rest of its block
    can still earn through it, so early slots and confident prefixes weigh most."""
    with torch.no_grad():
        m = mask.float()
        q_tilde = torch.where(m > 0, (1.0 - alpha) * torch.exp(-ce.detach().float()) + alpha, 1.0)
        credit = m * torch.cumprod(q_tilde, dim=-1)
        suffix = credit.flip(-1).cumsum(-1).flip(-1)
        return m * suffix


@dataclass(frozen=True)
class DecayLoss:
    """DFlash's decayed CE: the static weights of consumer.objective.slot_weights, normalised by Σw."""

    block_size: int
    reweights = False  # the weights do not depend on the CE

    def base_weights(self, weights: Tensor) -> Tensor:
        return weights

    def weights(self, ce: Tensor, base: Tensor) -> Tensor:
        return base

    def normaliser(self, base: Tensor, num_sequences: int) -> Tensor:
        return base.sum()


@dataclass(frozen=True)
class DPaceLoss:
    """D-PACE: per-block weights from the drafter's confidence in the dataset token (hard-label CE).

    Normaliser (`normalise_by`), summed by the trainer over the whole optimizer step (every accumulation
    round, every replica) before it divides: "anchors", the number of valid anchors (anchors with at least
    one supervised slot), or "sequences", the number of packed sequences, as the D-PACE reference code
    divides by its batch size (docs/design.md, "D-PACE's normaliser"). Never Σw, which would cancel the
    credit mass the weights carry (the D-PACE author, SpecForge #828). Both are counts fixed by the batch, so
    each anchor (or sequence) weighs the same whichever batch or replica drew it."""

    block_size: int
    alpha: float
    normalise_by: DPaceNormaliser = "anchors"
    reweights = True

    def base_weights(self, weights: Tensor) -> Tensor:
        """The supervision mask m (1.0 where a slot carries loss) from the batch's static weights."""
        return (weights > 0).float()

    def weights(self, ce: Tensor, base: Tensor) -> Tensor:
        """ce [R], mask [R] with R a whole number of blocks -> D-PACE weights [R]."""
        B = self.block_size
        return dpace_weights(ce.view(-1, B), base.view(-1, B), self.alpha).view(-1)

    def normaliser(self, base: Tensor, num_sequences: int) -> Tensor:
        """mask [A·B] of the batch and its count of packed sequences -> what the step divides by."""
        if self.normalise_by == "sequences":
            return torch.tensor(float(num_sequences), device=base.device)
        return (base.view(-1, self.block_size) > 0).any(dim=1).sum().float()


SlotLoss = DecayLoss | DPaceLoss


def slot_loss(
    loss: str, block_size: int, dpace_alpha: float, dpace_normaliser: DPaceNormaliser = "anchors"
) -> SlotLoss:
    """The drafter's `loss` key (and D-PACE's `dpace_normaliser`) as a SlotLoss."""
    if loss == "dpace":
        return DPaceLoss(block_size, dpace_alpha, dpace_normaliser)
    if loss == "decay":
        return DecayLoss(block_size)
    raise ValueError(f"loss must be 'dpace' or 'decay', got {loss!r}")


class _ChunkedLMHeadCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        lm_head: Tensor,
        labels: Tensor,
        weights: Tensor,
        chunk_rows: int,
        reweight,
        top_k_out: Tensor | None = None,
        top_k_vocab: int | None = None,
    ):
        Q = hidden.shape[0]
        need_grad = ctx.needs_input_grad[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(Q, dtype=torch.bool, device=hidden.device)
        grad_h = torch.empty(Q, hidden.shape[1], dtype=lm_head.dtype, device=hidden.device) if need_grad else None
        extra = {} if reweight is None else {"reweight": reweight}  # (the memory plan's stand-in takes none)
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit here
            h = hidden.to(lm_head.dtype)
            for s in range(0, Q, chunk_rows):
                e = min(s + chunk_rows, Q)
                logits = h[s:e] @ lm_head.T  # [r, V]: the only logits alive
                if top_k_out is not None:  # DFlash2's candidates (consumer/dflash2.py), before the kernel overwrites
                    top_k_out[s:e] = logits[:, :top_k_vocab].topk(top_k_out.shape[1], dim=-1).indices
                lse, tgt, mx = weighted_ce_(logits, labels[s:e], weights[s:e], need_grad, **extra)
                w = weights[s:e]
                loss += torch.where(w != 0, w * (lse - tgt), 0.0).sum()  # rows without loss never add NaN
                correct[s:e] = tgt >= mx
                if need_grad:  # logits now hold w·(softmax - onehot)
                    torch.matmul(logits, lm_head, out=grad_h[s:e])  # [r, H]
                del logits  # before the next chunk's logits exist
        ctx.save_for_backward(grad_h)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_correct):
        (grad_h,) = ctx.saved_tensors
        return (grad_h * grad_loss).to(ctx.hidden_dtype), None, None, None, None, None, None, None


def chunked_lm_head_loss(
    hidden: Tensor,
    lm_head: Tensor,
    labels: Tensor,
    weights: Tensor,
    chunk_rows: int,
    loss: SlotLoss | None = None,
    top_k_out: Tensor | None = None,
    weights_out: Tensor | None = None,
    top_k_vocab: int | None = None,
) -> tuple[Tensor, Tensor]:
    """hidden [Q, H], frozen lm_head [V, H], labels [Q], weights [Q] -> (Σ w·CE as a float32 scalar,
    correct [Q] bool: the argmax is the label). Normalise outside (once per optimizer step: the SlotLoss's
    normaliser summed over the step). With a reweighting `loss` (D-PACE), `weights` is its base (the mask),
    the weights are computed from each chunk's CE, and chunks hold whole blocks (chunk_rows rounded down
    to a multiple of the block size); `weights_out` [Q] float32, when given, receives the weights used.
    top_k_out [Q, k] int64, when given, receives each row's top-k logit indices (no second logits pass), among
    ids < top_k_vocab when given (DFlash2's selector_vocab_size)."""
    if lm_head.requires_grad:
        raise ValueError("chunked_lm_head_loss: the lm_head must be frozen (it gets no gradient here)")
    if loss is None or not loss.reweights:
        if weights_out is not None:
            weights_out.copy_(weights)
        return _ChunkedLMHeadCE.apply(
            hidden, lm_head, labels, weights.float(), chunk_rows, None, top_k_out, top_k_vocab
        )
    B = loss.block_size
    if hidden.shape[0] % B:
        raise ValueError(f"chunked_lm_head_loss: {hidden.shape[0]} rows are not whole blocks of {B}")
    # overwritten chunk by chunk by the weights used: the caller's stays the mask
    w = weights.float().clone() if weights_out is None else weights_out.copy_(weights)
    rows = max(B, chunk_rows // B * B)
    return _ChunkedLMHeadCE.apply(hidden, lm_head, labels, w, rows, loss.weights, top_k_out, top_k_vocab)


def full_logits_loss(
    hidden: Tensor, lm_head: Tensor, labels: Tensor, weights: Tensor, loss: SlotLoss | None = None
) -> tuple[Tensor, Tensor]:
    """The unchunked reference (materialises [Q, V] logits): tests and the benchmark compare against it."""
    logits = F.linear(hidden.to(lm_head.dtype), lm_head).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    w = weights.float() if loss is None else loss.weights(ce, weights.float())
    return (ce * w).sum(), (logits.argmax(dim=-1) == labels).detach()


class DraftMetrics:
    """Running sums for logging, kept on the device; read() is the only synchronising call.

    acc_slot_k: share of valid slot-k predictions whose argmax is the label;
    tau_est: 1 + mean over anchors of the number of leading correct slots 1..B-1,
    stopping at the first wrong or label-less slot (the acceptance length a block would get).
    """

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.sums = torch.zeros(2 * block_size + 4, dtype=torch.float64, device=device)

    def add(self, loss_sum: Tensor, correct: Tensor, weights: Tensor, normaliser: Tensor | None = None) -> None:
        """One batch: correct/weights [A·B] (every anchor is a real one: consumer.objective); normaliser:
        what the step divides this batch's loss sum by (the SlotLoss's; default Σ weights)."""
        B = self.block_size
        has_label = (weights > 0).view(-1, B)  # [A, B]
        ok = correct.view(-1, B) & has_label
        leading = ok[:, 1:].long().cumprod(dim=1).sum(dim=1)  # [A]
        self.sums += torch.cat(
            [
                ok.sum(0).double(),
                has_label.sum(0).double(),
                torch.stack(
                    [
                        loss_sum.detach().double(),
                        (weights.sum() if normaliser is None else normaliser).double(),
                        leading.sum().double(),
                        torch.tensor(float(has_label.shape[0]), dtype=torch.float64, device=leading.device),
                    ]
                ),
            ]
        )

    def read(self) -> dict[str, float]:
        """Synchronises once, returns plain floats and resets the window."""
        s = self.sums.tolist()
        self.sums.zero_()
        B = self.block_size
        correct, count = s[:B], s[B : 2 * B]
        loss_sum, weight_sum, leading, anchors = s[2 * B :]
        out = {"loss": loss_sum / weight_sum if weight_sum > 0 else float("nan")}
        for k in range(1, B):
            out[f"acc_slot_{k}"] = correct[k] / count[k] if count[k] > 0 else float("nan")
        out["tau_est"] = 1.0 + leading / anchors if anchors > 0 else float("nan")
        return out
