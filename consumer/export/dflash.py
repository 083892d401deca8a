"""DFlash drafter for transformers: the modeling file shipped inside every exported checkpoint.

    model = AutoModel.from_pretrained(ckpt_dir, trust_remote_code=True, local_files_only=True)

Self-contained (torch + transformers only). The drafter owns neither the token embedding nor the
lm_head: like SGLang and vLLM, pass the target's. One draft step for a sequence of S committed tokens:

    ctx = concat(target hidden_states[l + 1] for l in model.target_layer_ids)     # [1, S, n·H]
    block = [last committed token, mask_token_id × (block_size - 1)]              # positions S..S+B-1
    h = model(noise_embedding=target_embed(block), target_hidden=ctx)            # [1, B, H]
    draft = target_lm_head(h)[:, 1:].argmax(-1)                                  # B-1 draft tokens

Layers are Qwen3 layers whose keys/values also carry the fused target context (context rows skip
the input norm, Q, O and MLP); attention is non-causal; RoPE uses absolute positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rope(x, cos, sin):
    """x [b, heads, L, d]; cos/sin [b, 1, L, d]."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h, self.hk = config.num_attention_heads, config.num_key_value_heads
        self.d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        H = config.hidden_size
        self.q_proj = nn.Linear(H, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(H, self.hk * self.d, bias=False)
        self.v_proj = nn.Linear(H, self.hk * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, H, bias=False)
        self.q_norm = DFlashRMSNorm(self.d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.d, config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, attention_mask=None):
        b, q_len, S = x.shape[0], x.shape[1], ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.h, self.d)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)  # [b, S+q, H]: shared W_k/W_v for context and block
        k = self.k_norm(self.k_proj(kv_in).view(b, S + q_len, self.hk, self.d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, S + q_len, self.hk, self.d).transpose(1, 2)
        q = _rope(q, cos[:, :, -q_len:], sin[:, :, -q_len:])  # queries take the last q_len positions
        k = _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, q_len, self.h * self.d))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        H, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x, ctx, cos, sin, attention_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ("DFlashDecoderLayer",)

    def __init__(self, config):
        super().__init__(config)
        dflash = config.dflash_config
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.mask_token_id = dflash["mask_token_id"]
        self.block_size = config.block_size
        H = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.post_init()

    def _cos_sin(self, position_ids):
        """position_ids [b, L] -> cos, sin [b, 1, L, d] (float32; computed here, not a buffer)."""
        attn = self.layers[0].self_attn
        rope = getattr(self.config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(self.config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, attn.d, 2, dtype=torch.float32, device=position_ids.device) / attn.d)
        )
        freqs = position_ids.float()[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]

    def forward(self, noise_embedding, target_hidden, position_ids=None, attention_mask=None, **kwargs):
        """noise_embedding [b, q, H] (target-embedded block), target_hidden [b, S, n·H] (the context's
        target features), position_ids [b, S+q] (default 0..S+q-1), attention_mask: optional boolean
        [b, 1, q, S+q] (None: the block sees every context row and itself) -> normed hidden [b, q, H]."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        b, S, q_len = ctx.shape[0], ctx.shape[1], noise_embedding.shape[1]
        if position_ids is None:
            position_ids = torch.arange(S + q_len, device=ctx.device).expand(b, -1)
        cos, sin = self._cos_sin(position_ids)
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, attention_mask)
        return self.norm(x)
