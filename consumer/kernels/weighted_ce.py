"""Fused weighted cross-entropy over one chunk of logits [R, V], Triton with a torch fallback.

forward:  lse, target logit and max logit of each row, streaming V in tiles (one read of the chunk);
backward: g = w·(softmax - onehot), written in place over the logits (no second buffer).
The two run back to back on each chunk (consumer.loss computes d loss / d hidden inside its forward);
between them an optional `reweight` turns the chunk's per-row CE into the weights the backward uses
(D-PACE's weights depend on the CE of every slot of a block: consumer.loss aligns chunks to blocks).
The loss of a row is lse - target; `target logit >= max logit` is the (tie-tolerant) argmax check
used for accuracy metrics. Triton runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1
(tests); anything else takes the torch path, which computes the same in float32.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # platforms without a triton wheel: the torch path only
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _configs():
    if INTERPRET:  # the interpreter cannot benchmark: exactly one config
        return [triton.Config({"BLOCK_R": 64, "BLOCK_V": 1024})]
    return [
        triton.Config({"BLOCK_R": 1, "BLOCK_V": 4096}, num_warps=8),
        triton.Config({"BLOCK_R": 1, "BLOCK_V": 8192}, num_warps=16),
        triton.Config({"BLOCK_R": 4, "BLOCK_V": 1024}, num_warps=4),
        triton.Config({"BLOCK_R": 8, "BLOCK_V": 1024}, num_warps=8),
    ]


if triton is not None:

    @triton.autotune(configs=_configs(), key=["V"], cache_results=not INTERPRET)
    @triton.jit
    def _ce_fwd_kernel(
        x_ptr,
        labels_ptr,
        lse_ptr,
        tgt_ptr,
        max_ptr,
        R,
        V,
        stride_x,
        BLOCK_R: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        row_off = rows.to(tl.int64) * stride_x
        m = tl.full([BLOCK_R], -1e30, tl.float32)  # finite: rows past R never compute inf - inf
        s = tl.zeros([BLOCK_R], tl.float32)
        for v0 in range(0, V, BLOCK_V):  # online logsumexp over vocabulary tiles
            cols = v0 + tl.arange(0, BLOCK_V)
            ok = row_ok[:, None] & (cols[None, :] < V)
            x = tl.load(x_ptr + row_off[:, None] + cols[None, :], mask=ok, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
            m = m_new
        label = tl.load(labels_ptr + rows, mask=row_ok, other=0)
        tgt = tl.load(x_ptr + row_off + label, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(lse_ptr + rows, m + tl.log(tl.where(row_ok, s, 1.0)), mask=row_ok)
        tl.store(tgt_ptr + rows, tgt, mask=row_ok)
        tl.store(max_ptr + rows, m, mask=row_ok)

    @triton.autotune(configs=_configs(), key=["V"], restore_value=["x_ptr"], cache_results=not INTERPRET)
    @triton.jit
    def _ce_bwd_kernel(
        x_ptr,
        g_ptr,
        labels_ptr,
        lse_ptr,
        w_ptr,
        R,
        V,
        stride_x,
        stride_g,
        BLOCK_R: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
        label = tl.load(labels_ptr + rows, mask=row_ok, other=0)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            ok = row_ok[:, None] & (cols[None, :] < V)
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
            p = tl.exp(x.to(tl.float32) - lse[:, None])
            g = (p - tl.where(cols[None, :] == label[:, None], 1.0, 0.0)) * w[:, None]
            g = tl.where(w[:, None] == 0.0, 0.0, g)  # rows without loss are exactly zero
            tl.store(
                g_ptr + rows.to(tl.int64)[:, None] * stride_g + cols[None, :],
                g.to(g_ptr.dtype.element_ty),
                mask=ok,
            )


def _use_triton(x: Tensor) -> bool:
    return triton is not None and (x.is_cuda or INTERPRET)


def _grid(R: int):
    return lambda meta: (triton.cdiv(R, meta["BLOCK_R"]),)


def weighted_ce_(
    logits: Tensor,
    labels: Tensor,
    weights: Tensor,
    need_grad: bool = True,
    reweight: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """logits [R, V] (rows contiguous), labels [R], weights [R] -> lse, target logit, max logit ([R] float32).

    With need_grad the logits are overwritten by d(Σ w·(lse - target))/d logits = w·(softmax - onehot)
    (exactly 0 on rows with w == 0): the chunk's one buffer serves forward and backward.
    reweight(ce [R] float32, weights) -> [R]: the weights to use instead, from the rows' CE, computed after
    the forward pass and written into `weights` (then a float32 tensor) before the gradient is.
    """
    if reweight is not None and weights.dtype != torch.float32:
        raise TypeError(f"weighted_ce_: with reweight the weights are overwritten: float32, not {weights.dtype}")
    if not _use_triton(logits):
        return _weighted_ce_torch_(logits, labels, weights.float(), need_grad, reweight)
    R, V = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    lse, tgt, mx = (torch.empty(R, dtype=torch.float32, device=logits.device) for _ in range(3))
    _ce_fwd_kernel[_grid(R)](logits, labels, lse, tgt, mx, R, V, logits.stride(0))
    if reweight is not None:
        weights.copy_(reweight(lse - tgt, weights))
    if need_grad:
        w = weights.float()
        _ce_bwd_kernel[_grid(R)](logits, logits, labels, lse, w, R, V, logits.stride(0), logits.stride(0))
    return lse, tgt, mx


def _weighted_ce_torch_(
    logits: Tensor,
    labels: Tensor,
    weights: Tensor,
    need_grad: bool,
    reweight: Callable[[Tensor, Tensor], Tensor] | None = None,
):
    """The same in torch, in place: five passes over the chunk and no temporary of its size (float32)."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    x = logits if logits.dtype == torch.float32 else logits.float()
    tgt = x[rows, labels]
    mx = x.amax(dim=-1)
    e = x if need_grad else x.clone()
    e.sub_(mx[:, None]).exp_()  # exp(x - max)
    s = e.sum(dim=-1)
    lse = mx + s.log()
    if reweight is not None:
        weights.copy_(reweight(lse - tgt, weights))
    if need_grad:
        e.mul_((weights / s)[:, None])  # w·softmax
        e[rows, labels] -= weights
        e[weights == 0] = 0.0  # exactly zero even where the logits were not finite
        if e is not logits:
            logits.copy_(e)
    return lse, tgt, mx


def warmup(vocab_size: int, rows: int, dtype: torch.dtype, device: torch.device, cache_dir: Path | None) -> None:
    """Compile and autotune both kernels for the training chunk shape before the first timed step,
    with the Triton cache in `cache_dir` (the run folder) so restarts reuse it. No-op off CUDA."""
    if device.type != "cuda" or triton is None:
        return
    if cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = str(cache_dir)  # read lazily by triton.knobs.cache.dir
    logits = torch.randn(rows, vocab_size, dtype=dtype, device=device)
    labels = torch.randint(0, vocab_size, (rows,), device=device)
    weighted_ce_(logits, labels, torch.ones(rows, device=device))
    torch.cuda.synchronize(device)
