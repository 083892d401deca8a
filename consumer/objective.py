"""The DFlash training objective on a packed batch (dflash.md §2): anchors, blocks, mask, labels, weights.

Shapes: T packed tokens in `nseq` sequences (cu_seqlens); A anchors (only real ones: no padding anchor
exists), B block size, Q = A·B query rows. Anchors are grouped by sequence, sorted.
Keys are laid out as [T context rows ‖ Q block rows]; one predicate, `DraftBatch.allowed`, decides
every (query row, key) pair, and both attention paths evaluate that same predicate:
  - flex: a FlexAttention BlockMask over the full [Q, T+Q] grid, padded to planned shapes (GPU training, sparse);
  - dense: a boolean SDPA mask per anchor over the only keys a block can ever see,
    [its sequence's first C context rows ‖ its own B rows] (C = longest sequence); every other key
    of the full grid is forbidden, so the two are the same mask.

Sliding-window layers (`window` W) add one condition to the same predicate, in sequence positions:
a query row at position p+k (slot k of anchor p) sees a key at position j only if |p+k - j| < W.
For context keys (j < p) that is j > p+k-W: slot k sees context positions max(0, p+k-W+1)..p-1 (the
anchor's row W-1 of them at most, each later row one fewer); for its own block's keys at p+k' it is
|k-k'| < W (every slot when B <= W). `causal` (the drafter's sliding_block_attention = "causal") adds
k' <= k for the block's keys of sliding layers: what SGLang and vLLM serve for an export without
`is_causal` (docs/design.md, "Sliding layers"); full layers always see their whole block. This is the mask a
sliding layer of the exported drafter applies when drafting at position p (consumer/export/dflash.py), so
training and serving agree.

Candidates: a position p is a candidate anchor if loss_mask is 1 at p and at p+1 (inside its sequence);
its block may run past the sequence end, and the slots there carry no loss (SpecForge's rule: the ends of
answers, their end-of-turn token included, are labels too). `partial_blocks=False` keeps the older rule: a
whole block inside the sequence (p + B <= S), without the p+1 condition.

Anchors of a batch (`_sample_anchors`): each sequence draws min(N, its candidates) of its candidates
uniformly without replacement (N = anchors_per_seq, SpecForge's rule); when the batch's total passes the
budget M (`anchor_budget`), a uniform M of those draws are kept. Why cut the draws and not sample M
anywhere among the batch's candidates: every candidate keeps the inclusion probability it has without a
budget, scaled by one factor for the whole batch, so the weighted loss Σ w·CE / Σ w estimates the same
objective (long and short sequences keep their relative shares) and a batch under the budget is exactly
the unbudgeted objective. The counts come from host copies of cu_seqlens and loss_mask: no device sync.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from consumer.kernels.flex import FLEX_TILE, CompiledFlex, FlexMask, FlexPlan, flex_bucket


@dataclass(frozen=True)
class DenseMask:
    """SDPA form of the block mask: block a attends to keys key_index[a] of the full [T+Q] key axis,
    [C context rows of its sequence ‖ its own B block rows], where `allowed` says."""

    key_index: Tensor  # [A, C+B] int64 rows of the full key axis gathered for each anchor
    allowed: Tensor  # [A, 1, 1 or B, C+B] bool; one row for the whole block unless a window makes rows differ


def _allowed(
    q_idx: Tensor,
    kv_idx: Tensor,
    *,
    num_ctx: int,
    block_size: int,
    token_seq: Tensor,
    ctx_pos: Tensor,
    anchor_seq: Tensor,
    anchor_tok: Tensor,
    anchor_valid: Tensor | None,
    block_pos: Tensor,
    window: int | None,
    causal: bool,
) -> Tensor:
    """The one mask predicate (module docstring). Keys: [0, num_ctx) context rows, then block rows;
    `causal` (sliding layers only): a block slot sees its own block's slots up to itself."""
    T, B = num_ctx, block_size
    a = q_idx // B
    is_ctx = kv_idx < T
    j = kv_idx.clamp(0, T - 1)
    # context: same sequence and strictly before the anchor (its own hidden state is not known yet)
    ctx_ok = is_ctx & (token_seq[j] == anchor_seq[a]) & (kv_idx < anchor_tok[a])
    own_block = ~is_ctx & ((kv_idx - T) // B == a)
    ok = ctx_ok | own_block
    if anchor_valid is not None:  # the padded grid of flex_mask: padding anchors see nothing
        ok = ok & anchor_valid[a]
    if window is not None:
        key_pos = torch.where(is_ctx, ctx_pos[j], block_pos[(kv_idx - T).clamp(0, block_pos.numel() - 1)])
        ok = ok & ((block_pos[q_idx] - key_pos).abs() < window)
        if causal:  # context keys are before the anchor, so only block keys can come after the query
            ok = ok & (is_ctx | (key_pos <= block_pos[q_idx]))
    return ok


@dataclass(frozen=True)
class DraftBatch:
    """Everything one training step derives from a packed batch; all tensors on the training device."""

    block_size: int
    num_tokens: int  # T
    max_seqlen: int  # longest sequence, from the host copy of cu_seqlens
    token_seq: Tensor  # [T] sequence of each packed token
    ctx_pos: Tensor  # [T] in-sequence position of each token (its RoPE position)
    seq_start: Tensor  # [nseq] packed index of each sequence's first token
    anchor_tok: Tensor  # [A] packed index of each anchor p
    anchor_seq: Tensor  # [A]
    block_ids: Tensor  # [Q] [x_p, MASK × (B-1)] per anchor
    block_pos: Tensor  # [Q] p+k (in-sequence positions)
    labels: Tensor  # [Q] x[p+k]: NOT shifted; slot k predicts the token at p+k (next_token: x[p+k+1])
    weights: Tensor  # [Q] float32 w_k where slot k carries loss, else 0
    num_candidates: int  # candidate anchor positions of the batch (host count), whatever was drawn

    @property
    def num_anchors(self) -> int:
        return self.anchor_tok.numel()

    @property
    def num_sequences(self) -> int:
        return self.seq_start.numel()

    def allowed(self, q_idx: Tensor, kv_idx: Tensor, window: int | None = None, causal: bool = False) -> Tensor:
        """May query row q_idx see key kv_idx (in a layer with this sliding window, None: full; `causal`:
        the sliding layer's block is causal)? Keys: [0, T) context rows, [T, T+Q) block rows."""
        return _allowed(
            q_idx,
            kv_idx,
            num_ctx=self.num_tokens,
            block_size=self.block_size,
            token_seq=self.token_seq,
            ctx_pos=self.ctx_pos,
            anchor_seq=self.anchor_seq,
            anchor_tok=self.anchor_tok,
            anchor_valid=None,
            block_pos=self.block_pos,
            window=window,
            causal=causal,
        )


def slot_weights(block_size: int, gamma: float, device: torch.device | str = "cpu", next_token: bool = False) -> Tensor:
    """[B] w_0 = 0 (the anchor is given), w_k = exp(-(k-1)/γ) for k ≥ 1; next_token (DSpark: slot k predicts
    x[p+k+1], the anchor's slot too): w_k = exp(-k/γ) for every k (DeepSpec's loss weights)."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    if next_token:
        return torch.exp(-k / gamma)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


# default budget: one anchor per 8 tokens of a full batch (Q = 2 · tokens_per_batch at block 16). One per 4
# (SpecForge's density) plans the Qwen3.6-27B example's b16 step at 139 of an H200's 139.7 GiB (docs/gpu.md)
ANCHORS_PER_BATCH_TOKENS = 8


def anchor_budget(tokens_per_batch: int, anchors_per_batch: int | None, anchors_per_seq: int) -> int:
    """The most anchors one batch runs through the drafter (its query rows: that × block_size).

    `anchors_per_batch` when set; else tokens_per_batch // 8, so Q = 2 · tokens_per_batch · B/16 at most
    (half SpecForge's density of 512 anchors on a 2,048-token sequence, so that the 27B example's drafter
    step fits its GPU), where a constant per sequence made Q = nseq · 512 · B (2.9M rows on a batch of 355
    short chats). Never below one sequence's
    `anchors_per_seq`, so a batch of one long sequence keeps all its anchors."""
    if anchors_per_batch is not None:
        return anchors_per_batch
    return max(anchors_per_seq, tokens_per_batch // ANCHORS_PER_BATCH_TOKENS)


def _on_device(values: list[int] | Tensor, device: torch.device) -> Tensor:
    """Host values on the device without a stream sync (a pinned, non-blocking copy on CUDA)."""
    t = values if torch.is_tensor(values) else torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _host_cu_seqlens(cu_seqlens: Tensor, num_tokens: int) -> list[int]:
    cu = [int(x) for x in cu_seqlens.tolist()]  # a host tensor: no device sync
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != num_tokens or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(
            f"cu_seqlens must rise from 0 to the token count {num_tokens} with at least one sequence;"
            f" got {cu[:8]}{'...' if len(cu) > 8 else ''} ({len(cu) - 1} sequences)"
        )
    return cu


def _host(name: str, t: Tensor) -> Tensor:
    if t.device.type != "cpu":
        raise ValueError(
            f"build_draft_batch: {name} must be a host (CPU) tensor: its values size the step, and reading"
            f" them from {t.device} would synchronise the device on every batch"
        )
    return t


def _candidates(
    loss_mask: Tensor, lengths: Tensor, token_seq: Tensor, pos: Tensor, block_size: int, partial_blocks: bool
) -> Tensor:
    """[T] bool: may p anchor a block (module docstring)? The same rule on the host and the device."""
    T = loss_mask.numel()
    if partial_blocks:
        nxt = loss_mask[(torch.arange(T, device=loss_mask.device) + 1).clamp(max=T - 1)]
        return (loss_mask != 0) & (pos + 1 < lengths[token_seq]) & (nxt != 0)
    return (loss_mask != 0) & (pos + block_size <= lengths[token_seq])


def _sample_anchors(
    candidate: Tensor,
    cu: Tensor,
    token_seq: Tensor,
    per_seq: Tensor,
    budget: int,
    generator: torch.Generator,
) -> Tensor:
    """The packed indices [A] of the batch's anchors, sorted (so grouped by sequence): per_seq[s] =
    min(N, candidates of s) drawn uniformly without replacement in each sequence, then, when they pass
    `budget`, a uniform `budget` of them (module docstring). `per_seq` is a HOST tensor: A is known on the
    host and every shape below is too (no sync). One random key per token, a stable sort by sequence; a
    second draw only when the budget binds, so a batch under it draws exactly what it did without one."""
    T, device = candidate.numel(), candidate.device
    drawn = int(per_seq.sum())
    keys = torch.rand(T, generator=generator, device=device)
    keys = torch.where(candidate, keys, 2.0)  # non-candidates sort last within their sequence
    order = torch.argsort(keys, stable=True)
    order = order[torch.argsort(token_seq[order], stable=True)]  # grouped by sequence, random within
    # the first per_seq[s] entries of sequence s's segment of `order` (its first cu[s] .. cu[s]+per_seq[s]-1)
    first = cu[:-1] - _on_device(torch.cumsum(per_seq, 0) - per_seq, device)  # [nseq] segment start - offset
    seg = torch.repeat_interleave(
        torch.arange(per_seq.numel(), device=device), _on_device(per_seq, device), output_size=drawn
    )
    pick = order[first[seg] + torch.arange(drawn, device=device)]  # [drawn]
    if drawn > budget:
        pick = pick[torch.rand(drawn, generator=generator, device=device).argsort()[:budget]]
    return pick.sort().values


def build_draft_batch(
    input_ids: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    *,
    anchors_per_seq: int,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    generator: torch.Generator,
    partial_blocks: bool = True,
    max_anchors: int | None = None,
    next_token: bool = False,
) -> DraftBatch:
    """Anchors (resampled from `generator` at every call), block inputs, positions, labels and weights
    of one packed batch: input_ids [T] on the training device; loss_mask [T] and cu_seqlens [nseq+1] as
    HOST tensors (they size the step). max_anchors: the batch's budget (`anchor_budget`), None: none.
    next_token (DSpark, sample_from_anchor): slot k's label is x[p+k+1] (slot 0, the anchor's, predicts
    too), supervised while x[p+k+1] is in the sequence with loss_mask 1 and every earlier slot was (DeepSpec's
    contiguous eval_mask); the same anchors, block inputs, positions and mask as DFlash's."""
    device, T, B = input_ids.device, input_ids.numel(), block_size
    cu_host = _host_cu_seqlens(_host("cu_seqlens", cu_seqlens), T)
    loss_mask_host = _host("loss_mask", loss_mask)
    if loss_mask_host.numel() != T:
        raise ValueError(f"build_draft_batch: loss_mask has {loss_mask_host.numel()} tokens, input_ids {T}")
    nseq = len(cu_host) - 1
    # host side: the candidates' count per sequence sizes the step
    cu_h = torch.tensor(cu_host, dtype=torch.int64)
    lengths_h = cu_h[1:] - cu_h[:-1]
    token_seq_h = torch.repeat_interleave(torch.arange(nseq), lengths_h, output_size=T)
    cand_h = _candidates(loss_mask_host, lengths_h, token_seq_h, torch.arange(T) - cu_h[token_seq_h], B, partial_blocks)
    count_h = torch.bincount(token_seq_h[cand_h], minlength=nseq)
    per_seq = count_h.clamp(max=anchors_per_seq)
    budget = int(per_seq.sum()) if max_anchors is None else max_anchors
    # device side
    cu = _on_device(cu_h, device)
    loss_mask = _on_device(loss_mask_host, device)
    lengths = cu[1:] - cu[:-1]
    token_seq = torch.repeat_interleave(torch.arange(nseq, device=device), lengths, output_size=T)
    ctx_pos = torch.arange(T, device=device) - cu[token_seq]  # [T] position in its sequence
    candidate = _candidates(loss_mask, lengths, token_seq, ctx_pos, B, partial_blocks)
    anchor_tok = _sample_anchors(candidate, cu, token_seq, per_seq, budget, generator)  # [A]

    anchor_seq = token_seq[anchor_tok]
    k = torch.arange(B, device=device)
    block_pos = ctx_pos[anchor_tok][:, None] + k  # [A, B] positions p+k
    shift = int(next_token)
    label_tok = (anchor_tok[:, None] + k + shift).clamp(max=T - 1)  # [A, B] packed index of x[p+k] (x[p+k+1])
    in_seq = block_pos + shift < lengths[anchor_seq][:, None]
    has_loss = (k >= 1 - shift) & in_seq & (loss_mask[label_tok] != 0)
    if next_token:
        has_loss = has_loss.int().cumprod(dim=1).bool()
    weights = slot_weights(B, gamma, device, next_token) * has_loss

    block_ids = torch.full((anchor_tok.numel(), B), mask_token_id, dtype=input_ids.dtype, device=device)
    block_ids[:, 0] = input_ids[anchor_tok]
    return DraftBatch(
        block_size=B,
        num_tokens=T,
        max_seqlen=max(b - a for a, b in itertools.pairwise(cu_host)),
        token_seq=token_seq,
        ctx_pos=ctx_pos,
        seq_start=cu[:-1],
        anchor_tok=anchor_tok,
        anchor_seq=anchor_seq,
        block_ids=block_ids.reshape(-1),
        block_pos=block_pos.reshape(-1),
        labels=input_ids[label_tok].reshape(-1),
        weights=weights.reshape(-1),
        num_candidates=int(count_h.sum()),
    )


def dense_mask(batch: DraftBatch, window: int | None = None, causal: bool = False) -> DenseMask:
    """The block mask for SDPA over each block's reachable keys (see the module docstring).

    Full layers gather the first C = longest-sequence context rows of the anchor's sequence; sliding
    layers only the W-1 rows before the anchor (no row of the block sees further back); `causal`: the
    sliding layer's block is causal."""
    device, T, B, A = batch.anchor_tok.device, batch.num_tokens, batch.block_size, batch.num_anchors
    p = batch.anchor_tok[:, None]
    start = batch.seq_start[batch.anchor_seq][:, None]
    if window is None:
        c = torch.arange(batch.max_seqlen, device=device)
        # context column c of anchor a is row start+c; columns at or past p fold onto p itself (j == p: forbidden)
        ctx_index = torch.minimum(start + c, p)
    else:
        span = min(batch.max_seqlen, window - 1)
        j = p - span + torch.arange(span, device=device)  # the W-1 rows before p; those before start fold onto p
        ctx_index = torch.where(j >= start, j, p)
    block_keys = T + torch.arange(A, device=device)[:, None] * B + torch.arange(B, device=device)
    kv = torch.cat([ctx_index, block_keys], dim=1)  # [A, C+B] key indices in the full grid
    rows = 1 if window is None else B  # without a window every row of a block sees the same keys
    q = torch.arange(A, device=device)[:, None, None] * B + torch.arange(rows, device=device)[:, None]
    return DenseMask(key_index=kv, allowed=batch.allowed(q, kv[:, None, :], window, causal)[:, None])


def flex_mask(
    batch: DraftBatch,
    window: int | None = None,
    block: int = FLEX_TILE,
    plan: FlexPlan | None = None,
    causal: bool = False,
) -> BlockMask:
    """The block mask as a FlexAttention BlockMask over the padded grid [Qp, Tp + Qp]: context rows
    padded to Tp, block rows to Qp (padding rows see nothing and are seen by nobody), the plan's one
    shape when the batch fits it (consumer/kernels/flex.py), else length buckets (flex_bucket). The mask
    function closes over tensors of those padded sizes and constants only, so a compiled kernel reuses one
    graph per (shape, window, causal) whatever the batch (consumer/model.py pads q, k and v the same way)."""
    device, T, B = batch.anchor_tok.device, batch.num_tokens, batch.block_size
    Q = batch.num_anchors * B
    Tp, Qp = plan.padded(T, Q) if plan is not None else (flex_bucket(T), flex_bucket(Q))
    Ap = -(-Qp // B)

    def pad(t: Tensor, n: int, value) -> Tensor:
        return torch.cat([t, t.new_full((n - t.numel(),), value)])

    token_seq, ctx_pos = pad(batch.token_seq, Tp, -1), pad(batch.ctx_pos, Tp, 0)
    anchor_seq, anchor_tok = pad(batch.anchor_seq, Ap, -2), pad(batch.anchor_tok, Ap, 0)
    anchor_valid = torch.arange(Ap, device=device) < batch.num_anchors
    block_pos = pad(batch.block_pos, Qp, 0)

    def mask_mod(b, h, q_idx, kv_idx):
        return _allowed(
            q_idx,
            kv_idx,
            num_ctx=Tp,
            block_size=B,
            token_seq=token_seq,
            ctx_pos=ctx_pos,
            anchor_seq=anchor_seq,
            anchor_tok=anchor_tok,
            anchor_valid=anchor_valid,
            block_pos=block_pos,
            window=window,
            causal=causal,
        )

    return create_block_mask(
        mask_mod,
        None,
        None,
        Qp,
        Tp + Qp,
        device=device,
        BLOCK_SIZE=block,
        _compile=device.type == "cuda",  # a compiled builder never holds the dense [Q, T+Q] grid
    )


def attention_masks(
    batch: DraftBatch,
    layer_types: list[str] | tuple[str, ...],
    window: int | None,
    flex: bool,
    kernel: CompiledFlex | None = None,
    sliding_block_attention: str = "causal",
):
    """One mask per attention kind the drafter's layers use: {"full_attention": ..., "sliding_attention": ...}.
    flex with a `kernel`: FlexMasks on its plan's grid, run by it (compiled); flex alone: BlockMasks (eager).
    sliding_block_attention: the drafter's in-block rule of sliding layers ("causal" or "bidirectional")."""
    if sliding_block_attention not in ("causal", "bidirectional"):
        raise ValueError(
            f"sliding_block_attention must be 'causal' or 'bidirectional', got {sliding_block_attention!r}"
        )

    def build(w: int | None):
        causal = w is not None and sliding_block_attention == "causal"
        if not flex:
            return dense_mask(batch, w, causal)
        if kernel is None:
            return flex_mask(batch, w, causal=causal)
        return FlexMask(flex_mask(batch, w, plan=kernel.plan, causal=causal), kernel)

    return {kind: build(window if kind == "sliding_attention" else None) for kind in set(layer_types)}
