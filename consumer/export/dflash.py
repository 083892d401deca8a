"""DFlash drafter for transformers: the modeling file shipped inside every exported checkpoint.

    draft = AutoModel.from_pretrained(ckpt_dir, trust_remote_code=True, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    out = draft.spec_generate(input_ids=ids, max_new_tokens=256, temperature=0.0, target=target,
                              stop_token_ids=[eos])                     # [1, prompt + new] token ids

Self-contained (torch + transformers only). The drafter owns neither the token embedding nor the
lm_head: like SGLang and vLLM it uses the target's. One draft step at anchor position p (the last
committed token), given the target features of the context positions not yet in the draft cache:

    ctx = concat(target hidden_states[l + 1] for l in model.target_layer_ids)     # [1, S_new, n·H]
    block = [last committed token, mask_token_id × (block_size - 1)]              # positions p..p+B-1
    h = model(noise_embedding=target_embed(block), target_hidden=ctx,
              past_key_values=cache, use_cache=True)                             # [1, B, H]
    draft = target_lm_head(h)[:, 1:].argmax(-1)                                  # B-1 draft tokens
                                                   # (temperature > 0: sampled, then speculative sampling)

Layers are Qwen3 layers whose keys/values also carry the fused target context (context rows skip
the input norm, Q, O and MLP); RoPE uses absolute positions and the drafter's own base/scaling
(config.rope_parameters). A sliding layer (config.layer_types) lets a query at position i see a key at
position j only when |i - j| < sliding_window, as in training (consumer/objective.py). Which layers are
causal inside the block is read as SGLang and vLLM read it (`layer_is_causal`): config.is_causal when
set (every layer), else dflash_config.causal, else sliding layers causal and full layers not. The draft KV
cache holds context rows only: each step feeds just the newly accepted positions' features; the block's
own keys are recomputed every step and never cached.
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding


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


def layer_is_causal(config, layer_idx: int) -> bool:
    """Is layer `layer_idx` causal inside the block? The rule of vLLM's qwen3_dflash.py and SGLang's
    models/dflash.py: an explicit is_causal for every layer, else (vLLM) dflash_config.causal, else
    causal exactly in sliding layers."""
    explicit = getattr(config, "is_causal", None)
    if explicit is None:
        explicit = (getattr(config, "dflash_config", None) or {}).get("causal")
    if explicit is not None:
        return bool(explicit)
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return kinds[layer_idx] == "sliding_attention"


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.h, self.hk = config.num_attention_heads, config.num_key_value_heads
        self.d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        H = config.hidden_size
        self.q_proj = nn.Linear(H, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(H, self.hk * self.d, bias=False)
        self.v_proj = nn.Linear(H, self.hk * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, H, bias=False)
        self.q_norm = DFlashRMSNorm(self.d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.d, config.rms_norm_eps)
        kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.window = config.sliding_window if kinds[layer_idx] == "sliding_attention" else None
        self.causal = layer_is_causal(config, layer_idx)

    def forward(self, x, ctx, cos, sin, key_pos, attention_mask=None, past_key_values=None):
        """x [b, q, H] block rows; ctx [b, S_new, H] new context rows; cos/sin [b, 1, S_new+q, d];
        key_pos [b, K] positions of every key (cached context, new context, block)."""
        b, q_len, S = x.shape[0], x.shape[1], ctx.shape[1]

        def heads(t, n):
            return t.view(b, t.shape[1], n, self.d).transpose(1, 2)

        q = _rope(self.q_norm(heads(self.q_proj(x), self.h)), cos[:, :, S:], sin[:, :, S:])
        k_ctx = _rope(self.k_norm(heads(self.k_proj(ctx), self.hk)), cos[:, :, :S], sin[:, :, :S])
        k_blk = _rope(self.k_norm(heads(self.k_proj(x), self.hk)), cos[:, :, S:], sin[:, :, S:])
        v_ctx, v_blk = heads(self.v_proj(ctx), self.hk), heads(self.v_proj(x), self.hk)
        if past_key_values is not None:  # context rows only; returns every cached context row
            k_ctx, v_ctx = past_key_values.update(k_ctx, v_ctx, self.layer_idx)
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        key_pos = key_pos[:, -k.shape[2] :]  # a sliding cache may keep fewer rows than were fed
        mask = attention_mask[..., -k.shape[2] :] if attention_mask is not None else None
        query_pos, any_key = key_pos[:, None, -q_len:, None], key_pos[:, None, None, :]
        if self.window is not None:
            near = (any_key - query_pos).abs() < self.window
            mask = near if mask is None else mask & near
        if self.causal:  # keys after the query (its block's later slots) are hidden
            before = any_key <= query_pos
            mask = before if mask is None else mask & before
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
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
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x, ctx, cos, sin, key_pos, attention_mask=None, past_key_values=None):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, key_pos, attention_mask, past_key_values)
        return x + self.mlp(self.post_attention_layernorm(x))


def record_past(cache, tokens: int):
    """Make `crop` able to take back up to `tokens - 1` of the last `tokens` ids fed to `cache` (one verify
    block), and return it. Sliding-window layers keep their evicted rows until `crop`. From transformers 5.25 a
    linear-attention layer (Gated DeltaNet, Mamba) also keeps its recurrent state after each of the last
    `tokens` ids (`recurrent_states_to_keep`; without it 5.25's models fail on None), so `crop` rolls it back
    too; 5.24's cannot, reports `is_croppable` False, and `rollback_copy` covers it."""
    if hasattr(cache, "get_recurrent_states_to_keep"):  # the models ask the cache for this count
        cache.activate_past_recording(recurrent_states_to_keep=tokens)
    else:
        cache.activate_past_recording()
    return cache


def rollback_copy(cache):
    """None when `crop` can undo the next forward of `cache`, else a copy of it to restore and re-feed (a
    recurrent state that this transformers cannot crop)."""
    return None if cache.is_croppable else copy.deepcopy(cache)


def _stop_ids(stop_token_ids, config) -> set[int]:
    ids = config.eos_token_id if stop_token_ids is None else stop_token_ids
    if ids is None:
        return set()
    return {int(ids)} if isinstance(ids, int) else {int(i) for i in ids}


def _probs(logits, temperature: float):
    return torch.softmax(logits.float() / temperature, dim=-1)


def speculative_accept(p, q, drafts) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) of one verified block.

    p [K+1, V]: the target's probabilities at the K draft slots and one past them; q [K, V]: the drafter's,
    from which drafts [K] were sampled. drafts[k] is kept with probability min(1, p[k, x] / q[k, x]) while all
    before it were kept; the first rejected slot takes a sample of normalise(max(0, p[k] - q[k])), and a fully
    accepted block a sample of p[K]. Every committed token is then distributed exactly as p. A drafter's q[k]
    depends on the context only, not on drafts[:k], which is all the proof needs. -> (accepted count, next)."""
    K = drafts.numel()
    slots = torch.arange(K, device=drafts.device)
    ratio = p[slots, drafts] / q[slots, drafts]
    kept = torch.rand(K, device=p.device) < ratio
    a = int(torch.cumprod(kept.int(), 0).sum())
    if a == K:
        return a, int(torch.multinomial(p[K], 1))
    residual = (p[a] - q[a]).clamp_min(0)
    return a, int(torch.multinomial(residual if residual.sum() > 0 else p[a], 1))


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
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)  # the drafter's own rope_parameters, scaling included
        self.acceptance_lengths: list[int] = []  # of the last spec_generate call, one per step
        self.post_init()

    def forward(
        self,
        noise_embedding,
        target_hidden,
        position_ids=None,
        attention_mask=None,
        past_key_values=None,
        use_cache=False,
        **kwargs,
    ):
        """noise_embedding [b, q, H] (target-embedded block); target_hidden [b, S_new, n·H], the target
        features of the context rows not in `past_key_values` yet (all of them without a cache);
        position_ids [b, S_new+q] (default: continuing after the cached rows); attention_mask: optional
        boolean [b, 1, q, K] over [cached context ‖ new context ‖ block] (default: the block sees every
        context row and itself, sliding layers within their window) -> final-normed hidden [b, q, H].
        Context rows must be consecutive positions ending right before the block (as in decoding)."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        b, S, q_len = ctx.shape[0], ctx.shape[1], noise_embedding.shape[1]
        cache = past_key_values
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + S + q_len, device=ctx.device).expand(b, -1)
        first = position_ids[:, :1]
        key_pos = torch.cat([first - past + torch.arange(past, device=ctx.device), position_ids], dim=1)
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        cos, sin = cos[:, None], sin[:, None]
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, key_pos, attention_mask, cache)
        return self.norm(x)

    def propose(self, hidden, anchor: int, head, temperature: float):
        """hidden [B-1, H] of the proposal slots -> (drafts [B-1], q [B-1, V] they were sampled from; None at
        temperature 0). DFlash1: each slot's argmax (or sample) of the target head (dflash2.py walks instead)."""
        draft_logits = hidden.to(head.dtype) @ head.T  # [B-1, V]
        if temperature == 0.0:
            return draft_logits.argmax(-1), None
        q = _probs(draft_logits, temperature)
        return torch.multinomial(q, 1)[:, 0], q

    def _features(self, hidden_states, dtype):
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1).to(dtype)

    @torch.no_grad()
    def spec_generate(self, target, input_ids, max_new_tokens, stop_token_ids=None, temperature=0.0, **kwargs):
        """Speculative decoding of one prompt with a transformers causal LM `target`:
        input_ids [1, P] -> [1, P + n] with n <= max_new_tokens, ending at the first stop token (kept;
        default: config.eos_token_id). temperature 0: the output equals the target's own greedy decoding;
        temperature > 0: each token is distributed exactly as the target's sampling at that temperature
        (speculative sampling, `speculative_accept`; torch's global RNG, so torch.manual_seed repeats a run).
        Per step: draft B-1 tokens from the anchor, verify them in one target forward, keep the accepted
        prefix plus one token from the target. The target's cache is rolled back with `crop`, or, where this
        transformers cannot crop a layer (linear attention before 5.25), restored from a copy and re-fed the
        accepted tokens (`record_past`, `rollback_copy`). Decoding ends after the step whose
        committed tokens hold a stop token, wherever in the step it falls. self.acceptance_lengths holds each
        step's count of committed tokens (a+1, the last step's included even past the stop or the limit)."""
        if not temperature >= 0.0:
            raise ValueError(f"spec_generate: temperature must be >= 0, got {temperature}")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate: input_ids must be [1, P] (one prompt), got {tuple(input_ids.shape)}")
        self.eval()
        stops = _stop_ids(stop_token_ids, self.config)
        embed = target.get_input_embeddings().weight
        head = target.get_output_embeddings().weight
        dtype, B, P = self.fc.weight.dtype, self.block_size, input_ids.shape[1]
        cache_kw = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        tcache = record_past(DynamicCache(config=target.config), B)  # a verify block can then be rolled back
        out = target(input_ids=input_ids, **{cache_kw: tcache}, use_cache=True, output_hidden_states=True)
        first = out.logits[0, -1]
        first = first.argmax() if temperature == 0.0 else torch.multinomial(_probs(first, temperature), 1)[0]
        tokens = [*input_ids[0].tolist(), int(first)]
        ctx = self._features(out.hidden_states, dtype)  # [1, P, n·H]: positions 0..P-1
        dcache = DynamicCache(config=self.config)
        self.acceptance_lengths = []
        while len(tokens) - P < max_new_tokens and tokens[-1] not in stops:
            p = len(tokens) - 1  # the anchor's position; the context is 0..p-1
            block = torch.tensor([tokens[-1]] + [self.mask_token_id] * (B - 1), device=input_ids.device)
            pos = torch.arange(p - ctx.shape[1], p + B, device=input_ids.device)[None]
            h = self(F.embedding(block, embed)[None].to(dtype), ctx, pos, past_key_values=dcache, use_cache=True)
            drafts, q = self.propose(h[0, 1:], tokens[-1], head, temperature)
            verify = torch.cat([block[:1], drafts])[None]
            snapshot = rollback_copy(tcache)
            out = target(input_ids=verify, **{cache_kw: tcache}, use_cache=True, output_hidden_states=True)
            # out.logits[0, k]: the target's distribution for position p+k+1, the slot of drafts[k]
            if temperature == 0.0:
                choice = out.logits[0].argmax(-1)
                a = int(torch.cumprod((drafts == choice[:-1]).int(), 0).sum())
                nxt = int(choice[a])
            else:
                a, nxt = speculative_accept(_probs(out.logits[0], temperature), q, drafts)
            # positions p+a+1.. were rejected: roll the target's cache back to 0..p+a
            if snapshot is None:
                tcache.crop(-(B - 1 - a))  # crop(0) also trims sliding layers back to their window
            else:
                if a < B - 1:
                    tcache = snapshot
                    target(input_ids=verify[:, : a + 1], **{cache_kw: tcache}, use_cache=True)
                tcache.crop(0)  # drop the recorded past (sliding rows, conv inputs) no later rollback needs
            ctx = self._features(out.hidden_states, dtype)[:, : a + 1]  # verified positions p..p+a
            accepted = [*drafts[:a].tolist(), nxt]
            self.acceptance_lengths.append(a + 1)  # what the step committed, as z-lab and SGLang count it
            tokens += accepted
            if stops.intersection(accepted):  # a stop anywhere in the step ends the response
                break
        new = tokens[P : P + max_new_tokens]
        for i, t in enumerate(new):
            if t in stops:
                new = new[: i + 1]
                break
        return torch.tensor([tokens[:P] + new], device=input_ids.device)
