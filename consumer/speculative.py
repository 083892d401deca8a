"""Greedy speculative decoding with a block drafter (dflash.md §4), and the plain greedy baseline.

One step, with p the position of the last committed token (the anchor):
    draft   the drafter proposes B-1 tokens for positions p+1..p+B-1 from the anchor and the target
            features of positions 0..p-1 (the anchor's own features are not known yet);
    verify  the target runs once over [anchor, drafts] at positions p..p+B-1 with its KV cache;
    accept  the longest prefix of drafts equal to the target's argmax, plus the target's next
            ("bonus") token: a+1 tokens; the cache is cropped to positions 0..p+a and the features
            of those verified positions become context.
With temperature 0 the output equals plain greedy decoding token for token (up to float ties).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn
from transformers import DynamicCache


class Drafter(Protocol):
    """What speculative decoding needs from a drafter: a block size and one proposal per step."""

    block_size: int

    def propose(self, context_features: Tensor, tokens: Tensor) -> Tensor:
        """context_features [p, n·H]: target features of positions 0..p-1; tokens [p+1]: the committed
        ids, tokens[-1] being the anchor at position p -> draft ids [B-1] for positions p+1..p+B-1."""
        ...


class TargetRunner:
    """A frozen HF causal LM run with a KV cache, returning logits and the captured target features.

    Feature i is HF hidden_states[i+1], as producer/target.py captures it for training: the output of
    decoder layer i, final-normed when i is the last layer (that is what HF reports for it).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        layers = model.model.layers
        bad = [i for i in layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"target layer ids {bad} are outside the target's {len(layers)} layers")
        self.model = model.eval()
        self.layer_ids = list(layer_ids)
        self._captured: dict[int, Tensor] | None = None
        # transformers 5 renamed past_key_values to cache (the old name is deprecated)
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        for k, i in enumerate(self.layer_ids):
            module = model.model.norm if i == len(layers) - 1 else layers[i]
            module.register_forward_hook(self._hook(k))

    def _hook(self, k: int):
        def hook(_module, _args, output) -> None:
            if self._captured is not None:
                self._captured[k] = output[0] if isinstance(output, tuple) else output  # [1, L, H]

        return hook

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, ids: Tensor, cache: DynamicCache, capture: bool) -> tuple[Tensor, Tensor | None]:
        """ids [L] at the positions after the cache -> (logits [L, V], features [L, n·H] or None)."""
        self._captured = {} if capture else None
        try:
            logits = self.model(input_ids=ids[None], use_cache=True, **{self._cache_kw: cache}).logits[0]
            feats = (
                torch.cat([self._captured[k][0] for k in range(len(self.layer_ids))], -1) if capture else None
            )
        finally:
            self._captured = None
        return logits, feats


def crop_cache(cache: DynamicCache, keep: int) -> None:
    """Keep the first `keep` positions (a negative crop removes tokens in every transformers version)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


def _finish(new: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """Cut the generated ids after the first EOS (kept) and at max_new_tokens."""
    new = new[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in new:
        new = new[: new.index(eos_token_id) + 1]
    return new


def _done(new: list[int], max_new_tokens: int, eos_token_id: int | None) -> bool:
    return len(new) >= max_new_tokens or (eos_token_id is not None and eos_token_id in new)


@dataclass
class Generation:
    tokens: list[int]  # generated ids (prompt excluded), EOS kept
    target_forwards: int
    seconds: float
    accept_lengths: list[int]  # per speculative step, a+1 ∈ [1, B]; empty for plain greedy

    @property
    def mean_accept(self) -> float | None:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else None


def greedy_generate(
    target: TargetRunner, prompt: Tensor, max_new_tokens: int, eos_token_id: int | None
) -> Generation:
    """Plain greedy decoding with a KV cache: one target forward per generated token."""
    t0 = time.perf_counter()
    cache = target.new_cache()
    logits, _ = target.forward(prompt, cache, capture=False)
    new = [int(logits[-1].argmax())]
    forwards = 1
    while not _done(new, max_new_tokens, eos_token_id):
        logits, _ = target.forward(prompt.new_tensor(new[-1:]), cache, capture=False)
        new.append(int(logits[-1].argmax()))
        forwards += 1
    return Generation(_finish(new, max_new_tokens, eos_token_id), forwards, time.perf_counter() - t0, [])


def speculative_generate(
    target: TargetRunner, drafter: Drafter, prompt: Tensor, max_new_tokens: int, eos_token_id: int | None
) -> Generation:
    """Greedy speculative decoding: one drafter and one target forward per step of a+1 tokens."""
    t0 = time.perf_counter()
    B = drafter.block_size
    cache = target.new_cache()
    logits, context = target.forward(prompt, cache, capture=True)  # prefill; context [P, n·H]
    tokens = torch.cat([prompt, logits[-1].argmax().view(1)])  # committed ids; the last is the anchor
    new = [int(tokens[-1])]
    forwards, accepts = 1, []
    while not _done(new, max_new_tokens, eos_token_id):
        drafts = drafter.propose(context, tokens).to(tokens.device, tokens.dtype)
        if drafts.shape != (B - 1,):
            raise ValueError(f"drafter proposed shape {tuple(drafts.shape)}, expected ({B - 1},)")
        logits, feats = target.forward(torch.cat([tokens[-1:], drafts]), cache, capture=True)
        forwards += 1
        choice = logits.argmax(-1)  # [B]: choice[k] is the target's token for position p+k+1
        a = int(torch.cumprod((drafts == choice[:-1]).int(), 0).sum())
        accepted = torch.cat([drafts[:a], choice[a : a + 1]])  # a+1 tokens
        crop_cache(cache, tokens.shape[0] + a)  # positions 0..p+a are verified
        context = torch.cat([context, feats[: a + 1]])
        tokens = torch.cat([tokens, accepted])
        new += accepted.tolist()
        accepts.append(a + 1)
    return Generation(_finish(new, max_new_tokens, eos_token_id), forwards, time.perf_counter() - t0, accepts)
