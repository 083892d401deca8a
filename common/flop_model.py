"""Matmul FLOPs and memory-bound bytes of one batch, from the shapes the memory plan builds (the throughput plan's
arithmetic; common/throughput_plan.py turns it into time).

Counted: every matrix multiply of the real code at its real shapes, 2 FLOP per multiply-add. Attention
scores and values count the keys a query actually sees (4·heads·head_dim per query and key: QKᵀ and PV).
Not counted: element-wise work (norms, RoPE, activations, softmax), which the achievable fraction of peak
(MFU) absorbs, as it does in torchtitan's and SpecForge's MFU figures. The drafter's optimizer is the
exception: its element-wise passes over the fp32 state are memory-bound and counted as bytes.

Backward = 2 × forward for a trained matmul (input and weight gradients) and 1 × for one whose weight is
frozen (the LM head) or whose input needs no gradient (the fc fusion over the target's features).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

LINEAR_CHUNK = 64  # the chunk of the chunked gated delta rule (transformers' torch path and fla's kernels)
# fused AdamW reads p, g, m, v and writes p, m, v (7 × 4 B); the step also scales the gradients by 1/Σw
# (read + write), clips them (a read) and zeroes them: ≈ 40 B per trainable parameter, Muon's momentum alike
ELEMENTWISE_BYTES_PER_PARAM = 40


def visible_keys(seq_len: int, window: int | None) -> float:
    """Mean keys a causal query sees in a sequence of `seq_len` tokens: (L + 1) / 2, or under a window W
    (the query and the W − 1 before it) the mean of min(p + 1, W) over positions p."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def anchor_context_keys(seq_len: int, window: int | None) -> float:
    """Mean context keys a drafter block sees: positions before its anchor p (p uniform over 0..L − 2), at
    most W of them in a sliding layer."""
    positions = max(1, seq_len - 1)
    w = window if window is not None else seq_len
    return sum(min(p, w) for p in range(positions)) / positions


@dataclass(frozen=True)
class TargetLayerShapes:
    """One decoder layer of the target rank as built (after the cut and the TP/EP shard)."""

    kind: str  # "full_attention", "sliding_attention", "linear_attention"
    linear_params: int  # weights of its nn.Linear matmuls (every token runs them all)
    expert_params: int  # weights of its routed experts (a token runs top_k of num_experts)
    experts_active: float  # top_k / num_experts (0 without experts)
    heads: int  # attention heads (value heads of a linear-attention layer)
    head_dim: int  # qk head dim (value dim of a linear-attention layer: value_dim)
    key_dim: int = 0  # linear attention's key head dim
    window: int | None = None


def expert_counts(text) -> tuple[int, int]:
    """(routed experts per MoE layer, experts a token runs); (0, 0) for a dense model."""
    keys = ("num_experts", "num_local_experts", "n_routed_experts")
    experts = next((v for k in keys if isinstance(v := getattr(text, k, None), int)), 0)
    return experts, (getattr(text, "num_experts_per_tok", 0) or 0) if experts else 0


def target_layer_shapes(model, text, routed_fraction: float | None = None) -> list[TargetLayerShapes]:
    """The layers of a transformers base model (built on the meta device from the config `text`): each layer's
    Linear weights and routed-expert weights, read off the module itself, and its attention shape.
    routed_fraction: top_k / num_experts of the whole model where `text` is an expert-parallel rank's shard
    (its tokens run k/ep of their experts on average there, so k/E of the rank's E/ep experts' weights)."""
    import torch.nn as nn

    kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    experts = next(
        (
            v
            for k in ("num_experts", "num_local_experts", "n_routed_experts")
            if isinstance(v := getattr(text, k, None), int)
        ),
        0,
    )
    top_k = getattr(text, "num_experts_per_tok", 0) or 0
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    out = []
    for layer, kind in zip(model.layers, kinds, strict=True):
        linear = routed = 0
        for name, p in layer.named_parameters():
            if "experts" in name and "shared" not in name and p.ndim == 3:
                routed += p.numel()  # grouped experts [E, out, in]
        for name, m in layer.named_modules():
            if isinstance(m, nn.Linear):
                if "experts." in name and "shared" not in name:
                    routed += m.weight.numel()  # one Linear per expert
                else:
                    linear += m.weight.numel()
        if kind == "linear_attention":
            heads, hd, kd = text.linear_num_value_heads, text.linear_value_head_dim, text.linear_key_head_dim
        else:
            heads, hd, kd = text.num_attention_heads, head_dim, 0
        window = getattr(text, "sliding_window", None) if kind == "sliding_attention" else None
        active = routed_fraction if routed_fraction is not None else (top_k / experts if experts else 0.0)
        out.append(TargetLayerShapes(kind, linear, routed, active, heads, hd, kd, window))
    return out


def target_forward_flops(layers: Iterable[TargetLayerShapes], tokens: int, seq_len: int) -> float:
    """One packed forward of `tokens` tokens in sequences of `seq_len` through these layers."""
    total = 0.0
    for s in layers:
        total += 2 * tokens * (s.linear_params + s.expert_params * s.experts_active)
        if s.kind == "linear_attention":  # per value head: q·S, kᵀv into S, k·S (delta) + the intra-chunk terms
            total += tokens * s.heads * (6 * s.key_dim * s.head_dim + 2 * LINEAR_CHUNK * (s.key_dim + s.head_dim))
        else:
            total += 4 * tokens * s.heads * s.head_dim * visible_keys(min(seq_len, tokens), s.window)
    return total


@dataclass(frozen=True)
class DrafterShapes:
    """The drafter's dims (consumer/model.py's DrafterArch) and its batch: what its matmuls run on."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    num_features: int
    vocab: int
    block_size: int
    layer_windows: tuple[int | None, ...]  # one per layer: None (full attention) or the sliding window


@dataclass(frozen=True)
class DrafterBatch:
    tokens: int  # context tokens (the target's features)
    anchors: int  # blocks; query rows Q = anchors × block_size
    seq_len: int  # the samples' length, for the context a block sees


def drafter_flops(d: DrafterShapes, b: DrafterBatch) -> dict[str, float]:
    """{"forward", "backward"} FLOPs of one training batch (consumer/model.py's forward, the chunked LM-head
    loss, their backward)."""
    T, Q, H = b.tokens, b.anchors * d.block_size, d.hidden
    q_dim, kv_dim = d.heads * d.head_dim, d.kv_heads * d.head_dim
    fc = 2 * T * d.num_features * H * H
    layers = 0.0
    for window in d.layer_windows:
        layers += 2 * Q * H * q_dim * 2  # q_proj, o_proj on the block rows
        layers += 2 * (T + Q) * H * kv_dim * 2  # k_proj, v_proj on the context and the block rows
        layers += 2 * Q * H * d.intermediate * 3  # gate, up, down
        layers += 4 * Q * q_dim * (anchor_context_keys(b.seq_len, window) + d.block_size)
    head = 2 * Q * H * d.vocab
    return {"forward": fc + layers + head, "backward": fc + 2 * layers + head}


def newton_schulz_flops(shapes: Iterable[tuple[int, int]], steps: int) -> float:
    """Muon's orthogonalisation: per matrix m × n (m ≤ n) and iteration, A = XXᵀ (2m²n), A·A (2m³), (…)X
    (2m²n)."""
    total = 0.0
    for a, b in shapes:
        m, n = min(a, b), max(a, b)
        total += steps * (4 * m * m * n + 2 * m**3)
    return total


def ring_allreduce_bytes(nbytes: float, world: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `nbytes`: 2 (world − 1) / world of it."""
    return 2 * (world - 1) / world * nbytes if world > 1 else 0.0


def batch_anchors(budget: int, tokens: int, seq_len: int, anchors_per_seq: int) -> int:
    """Anchors one batch runs: each of its tokens / seq_len samples draws up to anchors_per_seq (at most one per
    position but the last), the batch keeps at most `budget` (consumer/objective.py's anchor_budget)."""
    per_seq = min(anchors_per_seq, max(1, seq_len - 1))
    return min(budget, math.ceil(tokens / seq_len * per_seq))
