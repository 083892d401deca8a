"""The DFlash2 drafter (z-lab dflash/model.py; recipes.md §2): DFlash1 plus two things.

H hidden, B block size, Q = A·B block rows (A blocks of B consecutive rows, slot k = row mod B),
K conv taps, gs channels per group, G = H / gs groups, V the full target vocabulary, r selector rank,
k_sel candidates per slot.

1. A grouped dynamic causal convolution (`GroupedDynamicCausalConv`) around each sublayer:
       u, δ_out = attention_conv.prepare(norm(x));  x = x + attention_conv.finish(attn(u), δ_out)
       u, δ_out = mlp_conv.prepare(norm(x));        x = x + mlp_conv.finish(mlp(u), δ_out)
   prepare computes δ = kernel_projection(x_in) [Q, 2, K, G] once from the sublayer INPUT; side 0 is
   applied to the input, side 1 (δ_out) to the sublayer output:
       out[i, c] = Σ_t (base[s, t, c] + δ[i, s, t, c // gs]) · x[i - t, c],   taps with t > i mod B are 0
   so a tap never crosses a block start: the packed [A·B] layout and a served block of B rows convolve
   alike. Identity at init (base[:, 0] = 1, other taps 0, projection 0): a DFlash1 state dict loaded into
   this drafter gives exactly its logits (`DFlash2Drafter.IDENTITY_INIT_PARAMS`).
2. A candidate selector (`CandidateSelector`): per proposal slot, candidates = top-k_sel of the unary
   logits U = lm_head(h); edge score S(p -> b) = U(b) + <A[p] ⊙ P·h, Bc[b]>, A/Bc the predecessor/successor
   codebooks [V, r], P the hidden_projection H -> r. Serving walks it from the verified anchor
   (consumer/export/dflash2.py); training scores it teacher-forced (`selector_loss`).

Parameter names are the export names SGLang and vLLM load (recipes.md §5): the codebooks are bare
parameters, `candidate_selector.predecessor_codebook` with no `.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from common.config import DrafterConfig
from consumer.dspark import DSparkDrafter, DSparkShape
from consumer.model import MLP, Attention, DFlashDrafter, DrafterArch, RMSNorm


@dataclass(frozen=True)
class DFlash2Shape:
    """The DFlash2 keys of `dflash_config` (what vLLM's qwen3_dflash2.py indexes) and the loss weight."""

    block_size: int
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    # the optional serving keys (vLLM's DFlash2Qwen3ForCausalLM.compute_candidates): U = softcap(m · h·Wᵀ) for the
    # edge scores, candidates among ids < selector_vocab_size (None: the whole vocabulary)
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    selector_vocab_size: int | None = None

    @classmethod
    def from_config(cls, cfg: DrafterConfig) -> DFlash2Shape:
        return cls(
            cfg.block_size,
            cfg.conv_kernel_size,
            cfg.conv_group_size,
            cfg.selector_rank,
            cfg.selector_top_k,
            cfg.output_multiplier if cfg.output_multiplier is not None else 1.0,
            cfg.final_logit_softcapping,
            cfg.selector_vocab_size,
        )

    def unary(self, logits: Tensor) -> Tensor:
        """Raw head logits -> the unary scores the selector adds to: softcap(m · logits) in float32 (monotonic, so
        the candidates are the raw logits' top-k)."""
        u = logits.float() * self.output_multiplier
        cap = self.final_logit_softcapping
        return torch.tanh(u / cap) * cap if cap else u

    def export_keys(self) -> dict:
        """The optional keys as dflash_config carries them, only those that apply."""
        out: dict = {}
        if self.output_multiplier != 1.0:
            out["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            out["final_logit_softcapping"] = self.final_logit_softcapping
        if self.selector_vocab_size is not None:
            out["selector_vocab_size"] = self.selector_vocab_size
        return out


def grouped_causal_conv(x: Tensor, delta: Tensor, base: Tensor, block_size: int, group_size: int) -> Tensor:
    """x [Q, H] (Q a multiple of block_size), delta [Q, K, G], base [K, H] -> [Q, H] (module docstring, 1)."""
    Q, H = x.shape
    K, G, B = base.shape[0], H // group_size, block_size
    xb = x.view(Q // B, B, G, group_size)  # [A, B, G, gs]: blocks, slots, groups, channels
    db = delta.to(x.dtype).view(Q // B, B, K, G, 1)
    bb = base.to(x.dtype).view(K, G, group_size)
    out = xb * (bb[0] + db[:, :, 0])
    for t in range(1, K):
        shifted = F.pad(xb[:, :-t], (0, 0, 0, 0, t, 0))  # x[i - t] within each block: zero for slots < t
        out = out + shifted * (bb[t] + db[:, :, t])
    return out.reshape(Q, H)


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, shape: DFlash2Shape):
        super().__init__()
        if hidden_size % shape.conv_group_size:
            raise ValueError(
                f"drafters.conv_group_size = {shape.conv_group_size} must divide the target's hidden_size {hidden_size}"
            )
        self.block_size, self.group_size, self.taps = shape.block_size, shape.conv_group_size, shape.conv_kernel_size
        self.groups = hidden_size // shape.conv_group_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.taps, hidden_size))  # [2 (in, out), K, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * self.taps * self.groups, bias=False)  # H -> 2·K·G
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Sublayer input x [Q, H] -> (convolved input [Q, H], output-side delta [Q, K, G])."""
        delta = self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.groups)
        return grouped_causal_conv(x, delta[:, 0], self.base_kernel[0], self.block_size, self.group_size), delta[:, 1]

    def finish(self, y: Tensor, delta: Tensor) -> Tensor:
        return grouped_causal_conv(y, delta, self.base_kernel[1], self.block_size, self.group_size)


class DFlash2DecoderLayer(nn.Module):
    def __init__(self, a: DrafterArch, shape: DFlash2Shape):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)
        self.attention_conv = GroupedDynamicCausalConv(a.hidden_size, shape)
        self.mlp_conv = GroupedDynamicCausalConv(a.hidden_size, shape)

    def forward(self, x: Tensor, ctx: Tensor, rope_ctx, rope_blk, mask) -> Tensor:
        u, delta = self.attention_conv.prepare(self.input_layernorm(x))  # context rows are not convolved
        x = x + self.attention_conv.finish(self.self_attn(u, ctx, rope_ctx, rope_blk, mask), delta)
        u, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(u), delta)


class CandidateSelector(nn.Module):
    """Edge scores over each slot's candidates. Its own FSDP unit (`DFlash2Drafter.fsdp_units`): the codebooks
    (2·V·r, 127M parameters at V = 248,320) are gathered around its call only, not with the root's weights."""

    def __init__(self, hidden_size: int, vocab_size: int, shape: DFlash2Shape):
        super().__init__()
        self.top_k = shape.selector_top_k
        r = shape.selector_rank
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, r))  # A [V, r]
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, r))  # Bc [V, r]
        self.hidden_projection = nn.Linear(hidden_size, r, bias=False)  # P [r, H]

    def forward(self, hidden: Tensor, unary: Tensor, candidates: Tensor, predecessors: Tensor) -> Tensor:
        """hidden [N, H], unary [N, k] (the candidates' unary logits), candidates [N, k], predecessors [N]
        -> S [N, k] = unary + <A[pred] ⊙ P·h, Bc[cand]>."""
        ph = self.hidden_projection(hidden)  # [N, r]
        a = F.embedding(predecessors, self.predecessor_codebook)  # [N, r]
        b = F.embedding(candidates, self.successor_codebook)  # [N, k, r]
        return unary.float() + torch.einsum("nr,nkr->nk", (a * ph).float(), b.float())


class DFlash2Drafter(DFlashDrafter):
    # identity-initialised parameters a DFlash1 state dict of the same shape lacks: `load_dflash1_state`
    # keeps their init (the warm start a DFlash1 drafter directory gives a DFlash2 job)
    IDENTITY_INIT_SUFFIXES = (
        "attention_conv.base_kernel",
        "attention_conv.kernel_projection.weight",
        "mlp_conv.base_kernel",
        "mlp_conv.kernel_projection.weight",
    )
    SELECTOR_PARAMS = (
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
    )

    def __init__(
        self, arch: DrafterArch, shape: DFlash2Shape, embed_tokens: Tensor, lm_head: Tensor, init_seed: int = 0
    ):
        self.shape = shape  # read by _make_layer during DFlashDrafter.__init__
        super().__init__(arch, embed_tokens, lm_head, init_seed)
        self.candidate_selector = CandidateSelector(arch.hidden_size, lm_head.shape[0], shape)
        gen = torch.Generator().manual_seed(init_seed + 1)
        with torch.no_grad():
            for layer in self.layers:  # DFlashDrafter's init drew every Linear, the convolutions' too
                layer.attention_conv.reset_identity()
                layer.mlp_conv.reset_identity()
            sel = self.candidate_selector
            # SpecForge's init (docs/concepts/DFlash2.md): successor codebook 0, so S = U at step 0 (the walk is
            # the unary argmax, DFlash1's draft); the predecessor codebook and P random so gradients flow
            sel.predecessor_codebook.copy_(torch.randn(sel.predecessor_codebook.shape, generator=gen) * 0.02)
            sel.successor_codebook.zero_()
            sel.hidden_projection.weight.copy_(torch.randn(sel.hidden_projection.weight.shape, generator=gen) * 0.02)

    def _make_layer(self, arch: DrafterArch) -> nn.Module:
        return DFlash2DecoderLayer(arch, self.shape)

    def fsdp_units(self) -> list[nn.Module]:
        return [*self.layers, self.candidate_selector]

    @classmethod
    def identity_init_params(cls, num_layers: int) -> list[str]:
        """The parameter names a DFlash1 source of the same shape may lack (identity-initialised here) and the
        selector's (freshly initialised: S = U at step 0)."""
        return [f"layers.{i}.{s}" for i in range(num_layers) for s in cls.IDENTITY_INIT_SUFFIXES] + list(
            cls.SELECTOR_PARAMS
        )

    @torch.no_grad()
    def walk(self, hidden: Tensor, anchor: Tensor) -> Tensor:
        """hidden [B-1, H] of the proposal slots, anchor [] the verified token -> greedy drafts [B-1]:
        x_t = argmax over the candidates of S_t(x_{t-1} -> b), x_0 = the anchor (consumer/export/dflash2.py)."""
        raw = self.logits(hidden)[..., : self.shape.selector_vocab_size]  # candidates among the selector's ids
        raw, cand = raw.float().topk(self.candidate_selector.top_k, dim=-1)  # [B-1, k]
        unary = self.shape.unary(raw)
        drafts, prev = [], anchor.view(1)
        for t in range(hidden.shape[0]):
            scores = self.candidate_selector(hidden[t : t + 1], unary[t : t + 1], cand[t : t + 1], prev)  # [1, k]
            prev = cand[t, scores.argmax(-1)]
            drafts.append(prev)
        return torch.cat(drafts)

    def load_dflash1_state(self, state: dict[str, Tensor], source: str = "the DFlash1 state") -> None:
        """Warm start from a DFlash1 drafter's state dict of the same shape: every DFlash1 tensor is loaded, the
        convolutions reset to identity and the selector keeps what it holds (its init on a fresh drafter), so the
        unary logits equal the DFlash1 drafter's exactly. A DFlash2 state (load_state_dict loads it), names that
        are neither, or a shape mismatch raise a ValueError naming them."""
        new = set(self.identity_init_params(self.arch.num_layers))
        mine = self.state_dict()
        if new & set(state):
            raise ValueError(
                f"{source} holds DFlash2 tensors ({sorted(new & set(state))[:2]}): it is not a DFlash1"
                " state (a DFlash2 state loads as it is)"
            )
        unknown = sorted(set(state) - set(mine))
        missing = sorted(set(mine) - set(state) - new)
        if unknown or missing:
            raise ValueError(
                f"{source} is not a DFlash1 drafter of this shape: unexpected {unknown[:4]}, missing {missing[:4]}"
            )
        bad = [
            f"{k} {tuple(v.shape)} (this drafter {tuple(mine[k].shape)})"
            for k, v in state.items()
            if v.shape != mine[k].shape
        ]
        if bad:
            raise ValueError(f"{source}: tensor shapes differ from this drafter's: {', '.join(bad[:3])}")
        self.load_state_dict({**mine, **state})
        for layer in self.layers:
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()


class DFlash2Proposer:
    """A trained DFlash2 drafter behind evaluation.speculative's Drafter protocol (greedy: the walk from the anchor
    over the edge scores; no draft_logits, since its q is the selector's restricted one: sampling is served by
    the exported spec_generate)."""

    def __init__(self, model: DFlash2Drafter, mask_token_id: int, layer_ids: list[int]):
        self.model = model.eval()
        self.block_size = model.shape.block_size
        self.mask_token_id = mask_token_id
        self.layer_ids = list(layer_ids)

    def propose(self, context_features: Tensor, tokens: Tensor) -> Tensor:
        """context_features [p, n·H], tokens [p+1] (tokens[-1] the anchor) -> draft ids [B-1]."""
        block = tokens.new_full((self.block_size,), self.mask_token_id)
        block[0] = tokens[-1]
        h = self.model.draft_hidden(context_features.to(self.model.fc.weight.dtype), block)  # [B, H]
        return self.model.walk(h[1:], block[0])


def make_drafter(
    cfg: DrafterConfig, arch: DrafterArch, embed_tokens: Tensor, lm_head: Tensor, init_seed: int
) -> DFlashDrafter:
    """The drafter `cfg.arch` names (drafters.arch)."""
    if cfg.arch == "dflash2":
        return DFlash2Drafter(arch, DFlash2Shape.from_config(cfg), embed_tokens, lm_head, init_seed)
    if cfg.arch == "dspark":
        return DSparkDrafter(arch, DSparkShape.from_config(cfg), embed_tokens, lm_head, init_seed)
    return DFlashDrafter(arch, embed_tokens, lm_head, init_seed)


# ----------------------------------------------------------------------------------------------- the loss
# The variant (docs/design.md "DFlash2 selector loss"): SpecForge's current rule. Candidates are the strict
# unary top-k, as served; a slot whose gold token is outside them adds no selector CE (it cannot be drafted
# whatever the selector does; the unary CE is what pulls it in) and counts against the logged recall. The
# predecessor is teacher-forced (the gold token of the slot before; slot 1's is the anchor). Each slot's CE is
# weighted by the unary loss's own slot weight, so the trainer's one normaliser applies to the sum
# L_unary + α·L_sel. No stop-gradient: the selector CE also trains the backbone through U and h (every
# trainer's default). α constant (no warmup ramp: SpecForge's schema default is 0).

SELECTOR_STATS = ("selector_recall", "selector_acc")


def _edge_scores(model: DFlash2Drafter, h: Tensor, cand: Tensor, prev: Tensor) -> Tensor:
    """S [n, k] of one chunk: the candidates' unary logits U (through h: no stop-gradient) plus the selector's."""
    lm_head = model.lm_head
    raw = torch.einsum("nh,nkh->nk", h.to(lm_head.dtype), F.embedding(cand, lm_head))  # head logits at the candidates
    return model.candidate_selector(h, model.shape.unary(raw), cand, prev)  # U = softcap(m · raw)


def selector_loss(
    model: DFlash2Drafter,
    hidden: Tensor,
    labels: Tensor,
    weights: Tensor,
    chunk_rows: int,
    candidates: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """hidden [Q, H] final-normed block rows, labels/weights [Q] of consumer.objective.DraftBatch ->
    (Σ w · CE_sel as a float32 scalar, stats [3] float64: Σ valid slots, Σ gold in top-k, Σ selector argmax is
    gold). candidates [Q, k]: the unary top-k, as chunked_lm_head_loss(top_k_out=...) gives them in its own
    logits pass (the trainer); None: computed here (one more [Q, V] logits pass). The selector runs at least
    once (an FSDP unit: every replica calls it on every pass)."""
    B, k = model.shape.block_size, model.candidate_selector.top_k
    lm_head = model.lm_head
    Q = hidden.shape[0]
    prev = labels.view(-1, B).roll(1, dims=1).reshape(-1)  # slot j's predecessor: slot j-1's label (the anchor)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    stats = torch.zeros(3, dtype=torch.float64, device=hidden.device)
    for s in range(0, max(Q, 1), chunk_rows):
        e = min(s + chunk_rows, Q)
        h, gold, w = hidden[s:e], labels[s:e], weights[s:e].float()
        if candidates is not None:
            cand = candidates[s:e]
        else:
            with torch.no_grad():  # [n, k] strict top-k among the selector's ids
                cand = (h.detach().to(lm_head.dtype) @ lm_head[: model.shape.selector_vocab_size].T).topk(k, dim=-1)
                cand = cand.indices
        # recomputed in backward: the gathered head rows [n, k, H] are never kept for more than one chunk
        scores = checkpoint(_edge_scores, model, h, cand, prev[s:e], use_reentrant=False)  # [n, k]
        hit = cand == gold[:, None]
        found = hit.any(-1)
        target = hit.float().argmax(-1)
        ce = F.cross_entropy(scores, target, reduction="none")
        use = (w > 0) & found
        total = total + torch.where(use, w * ce, 0.0).sum()
        valid = w > 0
        right = scores.detach().argmax(-1) == target
        stats += torch.stack([valid.sum(), use.sum(), (use & right).sum()]).double()
    return total, stats


class SelectorMetrics:
    """Running sums on the device (read() is the one sync): selector_recall = share of supervised slots whose
    gold token is among the unary top-k; selector_acc = share whose teacher-forced selector argmax is it."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)

    def add(self, stats: Tensor) -> None:
        self.sums += stats

    def read(self) -> dict[str, float]:
        valid, found, right = self.sums.tolist()
        self.sums.zero_()
        nan = float("nan")
        return {"selector_recall": found / valid if valid else nan, "selector_acc": right / valid if valid else nan}
