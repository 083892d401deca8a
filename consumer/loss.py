"""lm_head + weighted cross-entropy over chunks of query rows: the full [Q, V] logits never exist.

The lm_head is frozen, so the only gradient is d loss / d hidden, and it is produced chunk by chunk
inside the forward pass (as Liger's fused linear cross-entropy does): per chunk of rows,
    logits = h_c·Wᵀ -> kernel: lse, target, max -> kernel overwrites logits with w·(softmax - onehot)
    -> dh_c = g·W
and backward only scales the stored dh [Q, H] by the incoming gradient. That is the same two
[rows × V × H] matmuls an unchunked loss needs (logits forward, dh backward), where recomputing the
logits in backward would add a third (+50% on the dominant cost); memory is one chunk of logits plus
dh, which is the size of the hidden rows themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from consumer.kernels.weighted_ce import weighted_ce_


class _ChunkedLMHeadCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, lm_head: Tensor, labels: Tensor, weights: Tensor, chunk_rows: int,
                top_k_out: Tensor | None = None):
        Q = hidden.shape[0]
        need_grad = ctx.needs_input_grad[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(Q, dtype=torch.bool, device=hidden.device)
        grad_h = (
            torch.empty(Q, hidden.shape[1], dtype=lm_head.dtype, device=hidden.device) if need_grad else None
        )
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit here
            h = hidden.to(lm_head.dtype)
            for s in range(0, Q, chunk_rows):
                e = min(s + chunk_rows, Q)
                logits = h[s:e] @ lm_head.T  # [r, V]: the only logits alive
                if top_k_out is not None:  # DFlash2's candidates (consumer/dflash2.py), before the kernel overwrites
                    top_k_out[s:e] = logits.topk(top_k_out.shape[1], dim=-1).indices
                lse, tgt, mx = weighted_ce_(logits, labels[s:e], weights[s:e], need_grad)
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
        return (grad_h * grad_loss).to(ctx.hidden_dtype), None, None, None, None, None


def chunked_lm_head_loss(
    hidden: Tensor, lm_head: Tensor, labels: Tensor, weights: Tensor, chunk_rows: int,
    top_k_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """hidden [Q, H], frozen lm_head [V, H], labels [Q], weights [Q] -> (Σ w·CE as a float32 scalar,
    correct [Q] bool: the argmax is the label). Normalise by Σ w outside (once per optimizer step).
    top_k_out [Q, k] int64, when given, receives each row's top-k logit indices (no second logits pass)."""
    if lm_head.requires_grad:
        raise ValueError("chunked_lm_head_loss: the lm_head must be frozen (it gets no gradient here)")
    return _ChunkedLMHeadCE.apply(hidden, lm_head, labels, weights.float(), chunk_rows, top_k_out)


def full_logits_loss(
    hidden: Tensor, lm_head: Tensor, labels: Tensor, weights: Tensor
) -> tuple[Tensor, Tensor]:
    """The unchunked reference (materialises [Q, V] logits): tests and the benchmark compare against it."""
    logits = F.linear(hidden.to(lm_head.dtype), lm_head).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * weights.float()).sum(), (logits.argmax(dim=-1) == labels).detach()


class DraftMetrics:
    """Running sums for logging, kept on the device; read() is the only synchronising call.

    acc_slot_k: share of valid slot-k predictions whose argmax is the label;
    tau_est: 1 + mean over anchors of the number of leading correct slots 1..B-1,
    stopping at the first wrong or label-less slot (the acceptance length a block would get).
    """

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.sums = torch.zeros(2 * block_size + 4, dtype=torch.float64, device=device)

    def add(self, loss_sum: Tensor, correct: Tensor, weights: Tensor) -> None:
        """One batch: correct/weights [A·B] (every anchor is a real one: consumer.objective)."""
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
                        weights.sum().double(),
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
