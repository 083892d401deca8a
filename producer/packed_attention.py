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
it: transformers refuses the name for them as it refuses "sdpa".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

NAME = "packed_sdpa"
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
    **kwargs,
) -> SegmentMask | torch.Tensor | None:
    """The mask builder registered under NAME: a SegmentMask for a packed batch [1, T] with no cache and no 2D
    mask; anything else is sdpa's own mask, so it runs as sdpa."""
    if batch_size != 1 or q_length != kv_length or q_offset != 0 or kv_offset != 0 or attention_mask is not None:
        return sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, use_vmap=use_vmap,
            device=device, **kwargs,
        )  # fmt: skip
    return SegmentMask(mask_function, torch.device(device), use_vmap, q_length)


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
    total = attention_mask.length
    bounds = [0, total] if cu_seq_lens_q is None else cu_seq_lens_q.tolist()
    if query.shape[2] != total or key.shape[2] != total or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"{NAME}: query {tuple(query.shape)} / key {tuple(key.shape)} with cu_seq_lens_q {bounds} do not match"
            f" the packed mask's {total} tokens"
        )
    if cu_seq_lens_k is not None and cu_seq_lens_k.tolist() != bounds:
        raise ValueError(f"{NAME}: cu_seq_lens_k {cu_seq_lens_k.tolist()} differs from cu_seq_lens_q {bounds}")
    out = [
        sdpa_attention_forward(
            module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], attention_mask.block(s, e), dropout,
            scaling, is_causal, **kwargs,
        )[0]
        for s, e in itertools.pairwise(bounds)
    ]  # fmt: skip
    return (out[0] if len(out) == 1 else torch.cat(out, dim=1)), None


AttentionInterface.register(NAME, packed_sdpa_attention)
AttentionMaskInterface.register(NAME, segment_mask)
