"""The DFlash drafter (dflash.md §1): Qwen3 layers whose K/V also carry the fused target context.

H hidden, h/hk query/kv heads of size d, n fused target layers, V vocab, T context rows, Q block rows.

    ctx = hidden_norm(fc(concat target features))                    [T, n·H] -> [T, H], once
    per layer, block stream x [Q, H] only (context rows skip norm, Q, O and MLP):
        q = rope(q_norm(W_q·norm(x)))                                    [Q, h, d]
        k = [rope(k_norm(W_k·ctx)) ‖ rope(k_norm(W_k·norm(x)))]          [T+Q, hk, d]
        v = [W_v·ctx ‖ W_v·norm(x)]                                      [T+Q, hk, d]
        x = x + W_o·attend(q, k, v, mask);  x = x + mlp(norm(x))
    logits = lm_head(norm(x))                                            frozen target lm_head

Parameter names are the export keys of dflash.md §3; the frozen embedding and lm_head are
non-persistent buffers, so state_dict() holds exactly what is trained and exported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

from common.config import DrafterConfig
from consumer.kernels.flex import FlexMask
from consumer.objective import DenseMask
from consumer.target_parts import TargetParts


@dataclass(frozen=True)
class DrafterArch:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    num_features: int  # n: target layers fused by fc
    rms_norm_eps: float
    rope_theta: float  # the drafter's own RoPE base (a drafter setting, not the target's)
    rope_scaling: dict | None = None  # transformers rope parameters without rope_theta, e.g. {"rope_type": "yarn", ...}
    layer_types: tuple[str, ...] | None = None  # None: every layer "full_attention"
    sliding_window: int | None = None
    max_position_embeddings: int = 32768
    sliding_block_attention: str = "causal"  # in sliding layers: "causal" (slot k sees slots <= k) or "bidirectional"

    @classmethod
    def from_target(cls, parts: TargetParts, cfg: DrafterConfig, num_features: int) -> DrafterArch:
        """Per-layer dims are the target's (its text config); RoPE and layer kinds are the drafter's own."""
        return cls(
            hidden_size=parts.hidden_size,
            num_heads=parts.num_attention_heads,
            num_kv_heads=parts.num_key_value_heads,
            head_dim=parts.head_dim,
            intermediate_size=parts.intermediate_size,
            num_layers=cfg.num_layers,
            num_features=num_features,
            rms_norm_eps=parts.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            rope_scaling=dict(cfg.rope_scaling) if cfg.rope_scaling else None,
            layer_types=tuple(cfg.attention_layers),
            sliding_window=cfg.sliding_window,
            max_position_embeddings=parts.max_position_embeddings,
            sliding_block_attention=cfg.block_attention,
        )

    @property
    def attention_layers(self) -> tuple[str, ...]:
        return self.layer_types if self.layer_types is not None else ("full_attention",) * self.num_layers

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.attention_layers[i] == "sliding_attention" else None

    @property
    def rope_parameters(self) -> dict:
        """transformers' form of the drafter's RoPE ({"rope_type", "rope_theta", ...scaling keys})."""
        scaling = dict(self.rope_scaling or {})
        kind = scaling.pop("rope_type", scaling.pop("type", "default"))
        return {"rope_type": kind, "rope_theta": self.rope_theta, **scaling}

    @property
    def rope_positions(self) -> int:
        """The positions the drafter's RoPE is made for: yarn's original_max_position_embeddings × factor (what
        vLLM derives for a yarn drafter and SpecForge exports; transformers warns when the config says another
        length), else max_position_embeddings."""
        p = self.rope_parameters
        if p["rope_type"] == "yarn":
            return int(p["original_max_position_embeddings"] * p["factor"])
        return self.max_position_embeddings


def rope_frequencies(arch: DrafterArch) -> tuple[Tensor, float]:
    """inv_freq [d/2] and the attention scaling cos/sin are multiplied by (yarn's mscale; 1 otherwise),
    computed by transformers' own rope functions for scaled types."""
    params, d = arch.rope_parameters, arch.head_dim
    if params["rope_type"] == "default":
        return 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3Config(
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        head_dim=d,
        max_position_embeddings=arch.rope_positions,
        rope_parameters=params,
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    return inv_freq.float(), float(scale)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalised in float32 and returned in x's dtype, as Qwen3 does (its `weight * x.to(input_dtype)`
        with the weight in the model's dtype): under bf16 autocast the float32 master weight is cast too, so
        the projections that follow get one bf16 input to save, not a float32 one each casts and saves again."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * xf.to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [L, heads, d]; cos/sin [L, 1, d] (float32, cast to x's dtype as HF does)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _eager_flex(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask) -> Tensor:
    """Uncompiled flex (it materialises the scores: CPU tests and small inputs only)."""
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


def _dense_attend(q: Tensor, k: Tensor, v: Tensor, key_index: Tensor, allowed: Tensor) -> Tensor:
    """q [Q, h, d]; k/v [T+Q, hk, d]; key_index [A, C+B]; allowed [A, 1, 1, C+B] -> [Q, h, d]."""
    (Q, h, d), (A, K), hk = q.shape, key_index.shape, k.shape[1]
    idx = key_index.reshape(-1)
    kb = k.index_select(0, idx).view(A, K, hk, d).transpose(1, 2)  # [A, hk, C+B, d]
    vb = v.index_select(0, idx).view(A, K, hk, d).transpose(1, 2)
    qb = q.view(A, Q // max(A, 1), h, d).transpose(1, 2)  # [A, h, B, d] (a batch may have no anchor: A = Q = 0)
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, enable_gqa=True)
    return o.transpose(1, 2).reshape(Q, h, d)


Mask = DenseMask | FlexMask | BlockMask | Tensor | None


def _pad_rows(x: Tensor, n: int) -> Tensor:
    return x if x.shape[0] == n else torch.cat([x, x.new_zeros(n - x.shape[0], *x.shape[1:])])


def attend(q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, mask: Mask) -> Tensor:
    """q [Q, h, d]; k/v_ctx [T, hk, d]; k/v_blk [Q, hk, d] -> [Q, h, d].

    mask: a DenseMask (SDPA per block); a FlexMask (a BlockMask over the padded grid [Qp, Tp+Qp] of
    consumer.objective.flex_mask and the compiled kernel for it; q, k and v are zero-padded to it here)
    or a bare BlockMask (the same, eager flex: tests, small inputs); a boolean
    [Q, T+Q] tensor over the full key axis (drafting with a window); or None (drafting: one block that
    sees every context row and itself).
    """
    dtype = v_ctx.dtype  # flex needs one dtype (the norms return their input's: q and k are already v's)
    Q = q.shape[0]
    q = q.to(dtype)
    if isinstance(mask, (FlexMask, BlockMask)):
        block_mask, run = (mask.block_mask, mask.kernel) if isinstance(mask, FlexMask) else (mask, _eager_flex)
        Qp, KVp = block_mask.seq_lengths
        Tp = KVp - Qp
        k = torch.cat([_pad_rows(k_ctx.to(dtype), Tp), _pad_rows(k_blk.to(dtype), Qp)])
        v = torch.cat([_pad_rows(v_ctx, Tp), _pad_rows(v_blk, Qp)])
        k, v, qh = k.transpose(0, 1)[None], v.transpose(0, 1)[None], _pad_rows(q, Qp).transpose(0, 1)[None]
        o = run(qh, k, v, block_mask)
        return o[0, :, :Q].transpose(0, 1)
    k = torch.cat([k_ctx, k_blk]).to(dtype)  # [T+Q, hk, d]: the full key axis
    v = torch.cat([v_ctx, v_blk])
    if isinstance(mask, DenseMask):
        # each block's keys are gathered ([A, C+B] rows: far more than T+Q); recomputing the gather
        # in backward keeps that copy out of the saved activations
        return checkpoint(_dense_attend, q, k, v, mask.key_index, mask.allowed, use_reentrant=False)
    k, v, qh = k.transpose(0, 1)[None], v.transpose(0, 1)[None], q.transpose(0, 1)[None]  # [1, heads, L, d]
    o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1)


class Attention(nn.Module):
    def __init__(self, a: DrafterArch):
        super().__init__()
        self.h, self.hk, self.d = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, rope_ctx, rope_blk, mask) -> Tensor:
        Q, T = x.shape[0], ctx.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(Q, self.h, self.d)), *rope_blk)
        k_ctx = apply_rope(self.k_norm(self.k_proj(ctx).view(T, self.hk, self.d)), *rope_ctx)
        k_blk = apply_rope(self.k_norm(self.k_proj(x).view(Q, self.hk, self.d)), *rope_blk)
        v_ctx = self.v_proj(ctx).view(T, self.hk, self.d)
        v_blk = self.v_proj(x).view(Q, self.hk, self.d)
        o = attend(q, k_ctx, v_ctx, k_blk, v_blk, mask)  # [Q, h, d]
        return self.o_proj(o.reshape(Q, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, a: DrafterArch):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, a: DrafterArch):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)

    def forward(self, x: Tensor, ctx: Tensor, rope_ctx, rope_blk, mask) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_ctx, rope_blk, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, arch: DrafterArch, embed_tokens: Tensor, lm_head: Tensor, init_seed: int = 0):
        super().__init__()
        self.arch = arch
        H = arch.hidden_size
        self.layers = nn.ModuleList(self._make_layer(arch) for _ in range(arch.num_layers))
        self.fc = nn.Linear(arch.num_features * H, H, bias=False)  # [H, n·H]
        self.hidden_norm = RMSNorm(H, arch.rms_norm_eps)
        self.norm = RMSNorm(H, arch.rms_norm_eps)
        # frozen, owned by the target: never trained, never saved (non-persistent)
        self.register_buffer("embed_tokens", embed_tokens.detach(), persistent=False)  # [V, H]
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)  # [V, H]
        inv_freq, self.rope_scale = rope_frequencies(arch)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [d/2]
        gen = torch.Generator().manual_seed(init_seed)
        for m in self.modules():
            if isinstance(m, nn.Linear):  # Qwen3's initializer_range
                with torch.no_grad():
                    m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * 0.02)

    def _make_layer(self, arch: DrafterArch) -> nn.Module:
        return DecoderLayer(arch)  # consumer/dflash2.py builds its own

    def fsdp_units(self) -> list[nn.Module]:
        """The modules FSDP2 shards as units of their own (the root holds the rest)."""
        return list(self.layers)

    def rope(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Absolute positions [L] -> cos, sin [L, 1, d] in float32."""
        freqs = pos.float()[:, None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.rope_scale)[:, None], (emb.sin() * self.rope_scale)[:, None]

    def forward(
        self, features: Tensor, ctx_pos: Tensor, block_ids: Tensor, block_pos: Tensor, masks: Mask | dict[str, Mask]
    ) -> Tensor:
        """features [T, n·H], ctx_pos [T], block_ids/block_pos [Q] -> final-normed block states [Q, H].

        masks: {layer kind: mask} (consumer.objective.attention_masks), or one mask for every layer
        of a drafter without sliding layers."""
        kinds = self.arch.attention_layers
        if not isinstance(masks, dict):
            if "sliding_attention" in kinds:
                raise ValueError("this drafter has sliding-window layers: pass one mask per layer kind")
            masks = {"full_attention": masks}
        ctx = self.hidden_norm(self.fc(features))  # [T, H], one context for every layer
        x = F.embedding(block_ids, self.embed_tokens)  # [Q, H]
        rope_ctx, rope_blk = self.rope(ctx_pos), self.rope(block_pos)
        for layer, kind in zip(self.layers, kinds, strict=True):
            x = layer(x, ctx, rope_ctx, rope_blk, masks[kind])
        return self.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        """[*, H] -> [*, V] through the frozen lm_head (small inputs only: training uses consumer.loss)."""
        return F.linear(hidden.to(self.lm_head.dtype), self.lm_head)

    @torch.no_grad()
    def draft(self, context_features: Tensor, block_ids: Tensor) -> Tensor:
        """One sequence: context_features [S, n·H] of positions 0..S-1, block_ids [B] =
        [last committed token, MASK × (B-1)] at positions S..S+B-1 -> logits [B, V] (slot 0 included;
        argmax of slots 1..B-1 are the draft tokens)."""
        return self.logits(self.draft_hidden(context_features, block_ids))

    @torch.no_grad()
    def draft_hidden(self, context_features: Tensor, block_ids: Tensor) -> Tensor:
        """As `draft`, the final-normed block states [B, H] (DFlash2 walks its selector over them)."""
        S, B = context_features.shape[0], block_ids.shape[0]
        pos = torch.arange(S + B, device=block_ids.device)
        masks: dict[str, Mask] = {"full_attention": None}
        if self.arch.sliding_window is not None:  # |query position - key position| < W
            near = (pos[S:, None] - pos[None, :]).abs() < self.arch.sliding_window
            causal = self.arch.sliding_block_attention == "causal"
            masks["sliding_attention"] = near & (pos[S:, None] >= pos[None, :]) if causal else near
        return self(context_features, pos[:S], block_ids, pos[S:], masks)
