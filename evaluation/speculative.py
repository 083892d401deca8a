"""Greedy speculative decoding with a block drafter (dflash.md §4), and the plain greedy baseline.

One step, with p the position of the last committed token (the anchor):
    draft   the drafter proposes B-1 tokens for positions p+1..p+B-1 from the anchor and the target
            features of positions 0..p-1 (the anchor's own features are not known yet);
    verify  the target runs once over [anchor, drafts] at positions p..p+B-1 with its KV cache;
    accept  the longest prefix of drafts equal to the target's argmax, plus the target's next
            ("bonus") token: a+1 tokens; the cache is cropped to positions 0..p+a and the features
            of those verified positions become context.
With temperature 0 the output equals plain greedy decoding token for token (up to float ties). With
temperature T > 0 the drafts are sampled from the drafter's softmax(logits / T) and verified by speculative
sampling (consumer/export/dflash.py `speculative_accept`): every committed token is distributed as the
target's own sampling at T. Decoding ends after the step that commits a stop token anywhere in it.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from consumer.export.dflash import record_past, rollback_copy, speculative_accept

StopIds = int | Collection[int] | None  # one id, several, or none


class Drafter(Protocol):
    """What speculative decoding needs from a drafter: a block size and one proposal per step."""

    block_size: int

    def propose(self, context_features: Tensor, tokens: Tensor) -> Tensor:
        """context_features [p, n·H]: target features of positions 0..p-1; tokens [p+1]: the committed
        ids, tokens[-1] being the anchor at position p -> draft ids [B-1] for positions p+1..p+B-1."""
        ...


class SamplingDrafter(Drafter, Protocol):
    """A drafter that also gives its logits, which speculative sampling (temperature > 0) needs."""

    def draft_logits(self, context_features: Tensor, tokens: Tensor) -> Tensor:
        """As `propose`, but the logits [B-1, V] of the draft slots."""
        ...


class TargetRunner:
    """A frozen HF causal LM run with a KV cache, returning logits and the captured target features.

    Feature i is HF hidden_states[i+1], as producer/target.py captures it for training: the output of
    decoder layer i, final-normed when i is the last layer (that is what HF reports for it). Any causal
    LM whose forward reports hidden states works, multimodal wrappers included (their text config
    gives the depth).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        depth = model.config.get_text_config().num_hidden_layers
        bad = [i for i in layer_ids if not 0 <= i < depth]
        if bad:
            raise ValueError(f"target layer ids {bad} are outside the target's {depth} layers")
        self.model = model.eval()
        self.layer_ids = list(layer_ids)
        # transformers 5 renamed past_key_values to cache (the old name is deprecated)
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def new_cache(self, rollback_tokens: int = 0) -> DynamicCache:
        """A fresh cache; with rollback_tokens > 0, `rollback` can take back up to rollback_tokens - 1 of the
        last rollback_tokens ids fed (it then records past states; plain decoding need not pay for that)."""
        cache = DynamicCache(config=self.model.config)
        return record_past(cache, rollback_tokens) if rollback_tokens > 0 else cache

    @torch.inference_mode()
    def forward(self, ids: Tensor, cache: DynamicCache, capture: bool) -> tuple[Tensor, Tensor | None]:
        """ids [L] at the positions after the cache -> (logits [L, V], features [L, n·H] or None)."""
        out = self.model(input_ids=ids[None], use_cache=True, output_hidden_states=capture, **{self._cache_kw: cache})
        feats = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], -1) if capture else None
        return out.logits[0], feats

    def save_point(self, cache: DynamicCache) -> DynamicCache | None:
        """What `rollback` needs: None when crop can undo a forward, else a copy of the cache (before
        transformers 5.25 no crop takes back a linear-attention layer's recurrent state)."""
        return rollback_copy(cache)

    def rollback(self, cache: DynamicCache, saved: DynamicCache | None, fed: Tensor, keep: int) -> DynamicCache:
        """The cache as if only the first `keep` of the ids `fed` since `save_point` had been fed."""
        if saved is None:
            cache.crop(-(fed.numel() - keep))  # crop(0) also trims sliding layers back to their window
            return cache
        if keep < fed.numel():
            cache = saved
            self.forward(fed[:keep], cache, capture=False)
        cache.crop(0)  # drop the recorded past (sliding rows, conv inputs) that no later rollback needs
        return cache


def _stop_set(stop: StopIds) -> frozenset[int]:
    if stop is None:
        return frozenset()
    return frozenset([int(stop)]) if isinstance(stop, int) else frozenset(int(i) for i in stop)


def _finish(new: list[int], max_new_tokens: int, stops: frozenset[int]) -> list[int]:
    """Cut the generated ids after the first stop token (kept) and at max_new_tokens."""
    new = new[:max_new_tokens]
    for i, t in enumerate(new):
        if t in stops:
            return new[: i + 1]
    return new


def _pick(logits: Tensor, temperature: float) -> int:
    """The target's next token: argmax at temperature 0, else a sample of softmax(logits / T)."""
    if temperature == 0.0:
        return int(logits.argmax())
    return int(torch.multinomial(_probs(logits, temperature), 1))


def _probs(logits: Tensor, temperature: float) -> Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


@dataclass
class Generation:
    tokens: list[int]  # generated ids (prompt excluded), EOS kept
    target_forwards: int
    seconds: float
    accept_lengths: list[int]  # per speculative step, a+1 ∈ [1, B]; empty for plain greedy
    # per speculative step, the tokens committed when the drafter proposed (prompt + generated, anchor included)
    context_lengths: list[int] = field(default_factory=list)

    @property
    def mean_accept(self) -> float | None:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else None


def greedy_generate(
    target: TargetRunner, prompt: Tensor, max_new_tokens: int, stop: StopIds, temperature: float = 0.0
) -> Generation:
    """Plain decoding with a KV cache, one target forward per generated token (greedy at temperature 0)."""
    t0 = time.perf_counter()
    stops = _stop_set(stop)
    cache = target.new_cache()
    logits, _ = target.forward(prompt, cache, capture=False)
    new = [_pick(logits[-1], temperature)]
    forwards = 1
    while len(new) < max_new_tokens and new[-1] not in stops:
        logits, _ = target.forward(prompt.new_tensor(new[-1:]), cache, capture=False)
        new.append(_pick(logits[-1], temperature))
        forwards += 1
    return Generation(_finish(new, max_new_tokens, stops), forwards, time.perf_counter() - t0, [])


def speculative_generate(
    target: TargetRunner,
    drafter: Drafter,
    prompt: Tensor,
    max_new_tokens: int,
    stop: StopIds,
    temperature: float = 0.0,
) -> Generation:
    """Speculative decoding: one drafter and one target forward per step of a+1 tokens. The step that
    commits a stop token anywhere in it is the last; its a+1 is counted whole (as z-lab and SGLang do)."""
    if temperature > 0.0 and not hasattr(drafter, "draft_logits"):
        raise ValueError("speculative sampling (temperature > 0) needs a drafter with draft_logits")
    t0 = time.perf_counter()
    B = drafter.block_size
    stops = _stop_set(stop)
    cache = target.new_cache(rollback_tokens=B)
    logits, context = target.forward(prompt, cache, capture=True)  # prefill; context [P, n·H]
    tokens = torch.cat([prompt, prompt.new_tensor([_pick(logits[-1], temperature)])])  # the last is the anchor
    new = [int(tokens[-1])]
    forwards, accepts, contexts = 1, [], []
    while len(new) < max_new_tokens and new[-1] not in stops:
        contexts.append(int(tokens.numel()))
        if temperature == 0.0:
            drafts = drafter.propose(context, tokens).to(tokens.device, tokens.dtype)
        else:
            q = _probs(drafter.draft_logits(context, tokens), temperature)  # [B-1, V]
            drafts = torch.multinomial(q, 1)[:, 0].to(tokens.device, tokens.dtype)
        if drafts.shape != (B - 1,):
            raise ValueError(f"drafter proposed shape {tuple(drafts.shape)}, expected ({B - 1},)")
        verify = torch.cat([tokens[-1:], drafts])
        saved = target.save_point(cache)
        logits, feats = target.forward(verify, cache, capture=True)
        forwards += 1
        if temperature == 0.0:
            choice = logits.argmax(-1)  # [B]: choice[k] is the target's token for position p+k+1
            a = int(torch.cumprod((drafts == choice[:-1]).int(), 0).sum())
            nxt = int(choice[a])
        else:
            a, nxt = speculative_accept(_probs(logits, temperature), q.to(logits.device), drafts)
        accepted = torch.cat([drafts[:a], drafts.new_tensor([nxt])])  # a+1 tokens
        cache = target.rollback(cache, saved, verify, a + 1)  # positions 0..p+a are verified
        forwards += int(saved is not None and a + 1 < B)  # a rolled-back linear-attention cache is re-fed
        context = torch.cat([context, feats[: a + 1]])
        tokens = torch.cat([tokens, accepted])
        accepts.append(a + 1)
        step = accepted.tolist()
        new += step
        if stops.intersection(step):
            break
    return Generation(_finish(new, max_new_tokens, stops), forwards, time.perf_counter() - t0, accepts, contexts)
