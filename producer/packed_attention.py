"""Packed attention for the CPU ("packed_sdpa"): the attention of a packed batch costs Σ L², not T².

Registered through transformers' own AttentionInterface and AttentionMaskInterface, so the model's code runs
unchanged: its projections, rotary embeddings and output projection run once over all T packed tokens, and
only the attention itself runs per sequence. Two pieces:

- the mask builder (`segment_mask`): where sdpa would build a dense [1, 1, T, T] mask from the model's mask
  function (causal, sliding window, chunked, and "same sequence" when the position ids restart), it keeps
  the mask function itself in a `SegmentMask`; nothing of size T² is built.
- the attention (`packed_sdpa_attention`): given the sequence bounds the way transformers' varlen path
  receives them (`cu_seq_lens_q` keyword argument, a CPU tensor), it calls the library's own sdpa attention
  once per sequence with that sequence's diagonal block of the mask: None (sdpa's `is_causal`) when the
  block is plain causal, else the block evaluated from the model's mask function (e.g. a sliding window
  shorter than the sequence). Blocks are evaluated once per forward and mask kind, shared by its layers.

Exact by construction: a sequence's attention sees exactly its own block of the mask the model asked for,
and a per-sequence forward runs the same sdpa call on the same block. Anything else (a dense or 2D mask, a
cache, no mask) goes to sdpa unchanged. Models without sdpa support (gpt-oss: attention sinks) cannot use
it (transformers refuses the name for them as it refuses "sdpa"); for them "packed_eager" does the same
with the model's own eager attention function per sequence.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, eager_mask, sdpa_mask

NAME = "packed_sdpa"
EAGER_NAME = "packed_eager"  # the same with the model's own eager attention, for models without sdpa
NAMES = (NAME, EAGER_NAME)
CAUSAL_CHECK_ROWS = 1024  # rows of a block evaluated at a time while checking it is plain causal


@dataclass
class SegmentMask:
    """The model's mask function for one packed batch (one mask kind), evaluated per sequence on demand."""

    mask_function: Callable
    device: torch.device
    use_vmap: bool
    length: int  # T, the packed tokens
    blocks: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)

    def block(self, start: int, end: int) -> torch.Tensor | None:
        """The [1, 1, L, L] bool mask of tokens start..end-1 among themselves; None when it is plain causal."""
        if (start, end) not in self.blocks:
            self.blocks[start, end] = self._evaluate(start, end)
        return self.blocks[start, end]

    def _evaluate(self, start: int, end: int) -> torch.Tensor | None:
        n = end - start
        kv = torch.arange(n, device=self.device)
        for r in range(0, n, CAUSAL_CHECK_ROWS):  # row chunks: a plain causal block never exists in full
            rows = self._rows(start + r, min(CAUSAL_CHECK_ROWS, n - r), start, n)
            q = torch.arange(r, r + rows.shape[2], device=self.device)
            if not torch.equal(rows[0, 0], kv[None, :] <= q[:, None]):
                return self._rows(start, n, start, n)
        return None

    def _rows(self, q_start: int, q_len: int, kv_start: int, kv_len: int) -> torch.Tensor:
        return sdpa_mask(
            batch_size=1, q_length=q_len, kv_length=kv_len, q_offset=q_start, kv_offset=kv_start,
            mask_function=self.mask_function, allow_is_causal_skip=False, use_vmap=self.use_vmap,
            device=self.device,
        )  # fmt: skip


def segment_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    *,
    dense: Callable,
    **kwargs,
) -> SegmentMask | torch.Tensor | None:
    """The mask builder registered for both names: a SegmentMask for a packed batch [1, T] with no cache and no
    2D mask; anything else is the `dense` builder's own mask (sdpa's or eager's), so it runs as those do."""
    if batch_size != 1 or q_length != kv_length or q_offset != 0 or kv_offset != 0 or attention_mask is not None:
        return dense(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, use_vmap=use_vmap,
            device=device, **kwargs,
        )  # fmt: skip
    return SegmentMask(mask_function, torch.device(device), use_vmap, q_length)


def sequence_bounds(name: str, query, key, mask: SegmentMask, cu_q, cu_k) -> list[tuple[int, int]]:
    """(start, end) of every packed sequence; the whole batch as one when no bounds were passed."""
    total = mask.length
    bounds = [0, total] if cu_q is None else cu_q.tolist()
    if query.shape[2] != total or key.shape[2] != total or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"{name}: query {tuple(query.shape)} / key {tuple(key.shape)} with cu_seq_lens_q {bounds} do not match"
            f" the packed mask's {total} tokens"
        )
    if cu_k is not None and cu_k.tolist() != bounds:
        raise ValueError(f"{name}: cu_seq_lens_k {cu_k.tolist()} differs from cu_seq_lens_q {bounds}")
    return list(itertools.pairwise(bounds))


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: SegmentMask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query/key/value [1, heads, T, D] → [1, T, heads, D]: sdpa per sequence of `cu_seq_lens_q` (module docstring)."""
    if not isinstance(attention_mask, SegmentMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    out = [
        sdpa_attention_forward(
            module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], attention_mask.block(s, e), dropout,
            scaling, is_causal, **kwargs,
        )[0]
        for s, e in sequence_bounds(NAME, query, key, attention_mask, cu_seq_lens_q, cu_seq_lens_k)
    ]  # fmt: skip
    return (out[0] if len(out) == 1 else torch.cat(out, dim=1)), None


def model_eager_attention(model_cls: type) -> Callable | None:
    """The model's own eager attention (`eager_attention_forward` of its modeling module), if it has one."""
    return getattr(sys.modules[model_cls.__module__], "eager_attention_forward", None)


def packed_eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: SegmentMask | torch.Tensor | None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """As packed_sdpa_attention with the model's own eager attention per sequence, for models without sdpa
    (gpt-oss: its attention sinks live in its eager code). Eager adds a float mask: 0 kept, dtype min not."""
    eager = model_eager_attention(type(module))
    if eager is None:
        raise ValueError(f"{EAGER_NAME}: {type(module).__module__} has no eager_attention_forward")
    if not isinstance(attention_mask, SegmentMask):
        return eager(module, query, key, value, attention_mask, **kwargs)
    out = []
    for s, e in sequence_bounds(EAGER_NAME, query, key, attention_mask, cu_seq_lens_q, cu_seq_lens_k):
        block = attention_mask.block(s, e)
        if block is None:
            block = torch.ones(e - s, e - s, dtype=torch.bool, device=query.device).tril()[None, None]
        additive = torch.where(block, query.new_zeros(()), torch.finfo(query.dtype).min)
        out.append(eager(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], additive, **kwargs)[0])
    return (out[0] if len(out) == 1 else torch.cat(out, dim=1)), None


AttentionInterface.register(NAME, packed_sdpa_attention)
AttentionInterface.register(EAGER_NAME, packed_eager_attention)
AttentionMaskInterface.register(NAME, functools.partial(segment_mask, dense=sdpa_mask))
AttentionMaskInterface.register(EAGER_NAME, functools.partial(segment_mask, dense=eager_mask))
