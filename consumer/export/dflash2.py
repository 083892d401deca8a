"""DFlash2 drafter for transformers: the modeling file shipped (next to dflash.py) in every DFlash2 export.

    draft = AutoModel.from_pretrained(ckpt_dir, trust_remote_code=True, local_files_only=True)
    out = draft.spec_generate(input_ids=ids, max_new_tokens=256, temperature=0.0, target=target)

DFlash1 (dflash.py) plus, as z-lab's dflash/model.py defines them and vLLM's qwen3_dflash2.py serves them:
  * per layer, `attention_conv` / `mlp_conv` (GroupedDynamicCausalConv): base_kernel [2, K, H] and
    kernel_projection H -> 2·K·H/gs (no bias), applied around each sublayer, taps block-local;
  * `candidate_selector`: predecessor_codebook / successor_codebook [V, r] (bare parameters, no `.weight`)
    and hidden_projection H -> r. Per proposal slot t: candidates = top-k of the unary logits U_t (the target
    head), S_t(p -> b) = U_t(b) + <A[p] ⊙ P·h_t, Bc[b]>; the walk starts at the verified anchor token and
    takes p_{t+1} = argmax_b S_t(p_t -> b) (temperature 0) or a sample of softmax(S_t / T) over the
    candidates, which is then the q of the lossless speculative verify (zero outside the candidates).
Config keys read: dflash_config.{conv_kernel_size, conv_group_size, selector_rank, selector_top_k,
block_size, target_layer_ids, mask_token_id} and the optional output_multiplier / final_logit_softcapping (the
unary scores softcap(m · logits)) / selector_vocab_size (candidates among ids below it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .dflash import DFlashAttention, DFlashDraftModel, DFlashMLP, DFlashRMSNorm


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.taps, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def _convolve(self, x, delta, base):
        """x [b, q, H] (q whole blocks), delta [b, q, K, G], base [K, H]: taps never cross a block start."""
        b, q, H = x.shape
        B = self.block_size
        xb = x.view(b, q // B, B, self.groups, self.group_size)
        db = delta.to(x.dtype).view(b, q // B, B, self.taps, self.groups, 1)
        bb = base.to(x.dtype).view(self.taps, self.groups, self.group_size)
        out = xb * (bb[0] + db[:, :, :, 0])
        for t in range(1, self.taps):
            shifted = F.pad(xb[:, :, :-t], (0, 0, 0, 0, t, 0))  # x[i - t] within each block
            out = out + shifted * (bb[t] + db[:, :, :, t])
        return out.reshape(b, q, H)

    def prepare(self, x):
        delta = self.kernel_projection(x).view(*x.shape[:2], 2, self.taps, self.groups)
        return self._convolve(x, delta[:, :, 0], self.base_kernel[0]), delta[:, :, 1]

    def finish(self, y, delta):
        return self._convolve(y, delta, self.base_kernel[1])


class DFlash2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        d = config.dflash_config
        H = config.hidden_size
        self.input_layernorm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)
        conv = (H, d["conv_kernel_size"], d["conv_group_size"], d.get("block_size", config.block_size))
        self.attention_conv = GroupedDynamicCausalConv(*conv)
        self.mlp_conv = GroupedDynamicCausalConv(*conv)

    def forward(self, x, ctx, cos, sin, key_pos, attention_mask=None, past_key_values=None):
        u, delta = self.attention_conv.prepare(self.input_layernorm(x))
        attn = self.self_attn(u, ctx, cos, sin, key_pos, attention_mask, past_key_values)
        x = x + self.attention_conv.finish(attn, delta)
        u, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(u), delta)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)


class DFlash2DraftModel(DFlashDraftModel):
    _no_split_modules = ("DFlash2DecoderLayer",)

    def __init__(self, config):
        super().__init__(config)
        d = config.dflash_config
        self.layers = nn.ModuleList(DFlash2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, d["selector_rank"], d["selector_top_k"]
        )
        self.selector_vocab_size = d.get("selector_vocab_size")  # candidates among ids below it (None: all)
        self.output_multiplier = float(d.get("output_multiplier", 1.0))
        cap = float(d.get("final_logit_softcapping") or 0.0)
        self.softcap = cap if cap > 0 else None
        self.post_init()

    def unary_logits(self, hidden, head):
        logits = (hidden.to(head.dtype) @ head.T).float() * self.output_multiplier
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    def propose(self, hidden, anchor: int, head, temperature: float):
        """hidden [B-1, H] -> (drafts [B-1], q [B-1, V] or None): the walk over the edge scores from the anchor."""
        sel = self.candidate_selector
        unary, cand = self.unary_logits(hidden, head)[..., : self.selector_vocab_size].topk(sel.top_k, dim=-1)
        ph = sel.hidden_projection(hidden.to(sel.hidden_projection.weight.dtype)).float()  # [B-1, r]
        succ = sel.successor_codebook[cand].float()  # [B-1, k, r]
        pred = torch.tensor(anchor, device=hidden.device)
        drafts, q = [], torch.zeros(hidden.shape[0], head.shape[0], device=hidden.device) if temperature else None
        for t in range(hidden.shape[0]):
            scores = unary[t] + succ[t] @ (sel.predecessor_codebook[pred].float() * ph[t])  # [k]
            if temperature == 0.0:
                pick = scores.argmax()
            else:
                probs = torch.softmax(scores / temperature, dim=-1)
                q[t, cand[t]] = probs  # the restricted distribution the verify uses
                pick = torch.multinomial(probs, 1)[0]
            pred = cand[t, pick]
            drafts.append(pred)
        return torch.stack(drafts), q
