"""The CPU packed attention (producer/packed_attention.py): per-sequence blocks of the model's own mask, and
attention outputs equal to sdpa over the dense packed mask. The whole-model check over every target family is
tests/producer/test_targets_matrix.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from transformers import MistralConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from producer import packed_attention
from producer.packed_attention import SegmentMask, packed_sdpa_attention

LENGTHS = [5, 20, 1, 12]
WINDOW = 8


def bounds(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def build_mask(impl: str, builder=create_sliding_window_causal_mask, window: int = WINDOW, lengths=LENGTHS):
    """The model-side call: the library's mask builder for a packed batch (position ids restart per sequence)."""
    cfg = MistralConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, sliding_window=window)
    cfg._attn_implementation = impl
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    embeds = torch.zeros(1, sum(lengths), 16)
    return builder(config=cfg, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=positions)


def test_blocks_are_the_diagonal_blocks_of_the_dense_mask():
    dense = build_mask("sdpa")[0, 0]  # [T, T]: sliding window ∧ same sequence
    segments = build_mask(packed_attention.NAME)
    assert isinstance(segments, SegmentMask) and segments.length == sum(LENGTHS)
    cu = bounds(LENGTHS).tolist()
    for s, e in itertools.pairwise(cu):
        block, n = segments.block(s, e), e - s
        expected = dense[s:e, s:e]
        if n <= WINDOW:  # the window covers the whole sequence: plain causal, sdpa's is_causal
            assert block is None and torch.equal(expected, torch.ones(n, n, dtype=torch.bool).tril())
        else:
            assert block.shape == (1, 1, n, n) and torch.equal(block[0, 0], expected)
            assert not block[0, 0, -1, 0]  # the window holds inside the sequence
        assert not dense[s:e, :s].any() and not dense[s:e, e:].any()  # nothing outside the block is attended
    assert segments.block(cu[1], cu[2]) is segments.blocks[cu[1], cu[2]]  # evaluated once, shared by layers


def test_causal_check_by_row_chunks_finds_a_late_window(monkeypatch):
    """A window that first bites after several row chunks still gives the whole block."""
    monkeypatch.setattr(packed_attention, "CAUSAL_CHECK_ROWS", 4)
    segments = build_mask(packed_attention.NAME, window=13, lengths=[20])
    dense = build_mask("sdpa", window=13, lengths=[20])
    assert torch.equal(segments.block(0, 20), dense)
    full = build_mask(packed_attention.NAME, builder=create_causal_mask, lengths=[20])
    assert full.block(0, 20) is None


def attention_module(groups: int) -> nn.Module:
    module = nn.Module()
    module.is_causal, module.num_key_value_groups = True, groups
    return module


@pytest.mark.parametrize("builder", [create_causal_mask, create_sliding_window_causal_mask])
def test_outputs_equal_sdpa_over_the_dense_packed_mask(builder):
    gen = torch.Generator().manual_seed(0)
    total, heads, kv_heads, dim = sum(LENGTHS), 4, 2, 8
    q = torch.randn(1, heads, total, dim, generator=gen)
    k, v = torch.randn(2, 1, kv_heads, total, dim, generator=gen)
    module = attention_module(heads // kv_heads)
    cu = bounds(LENGTHS)
    out, _ = packed_sdpa_attention(
        module, q, k, v, build_mask(packed_attention.NAME, builder), scaling=dim**-0.5, cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
    )  # fmt: skip
    ref, _ = sdpa_attention_forward(module, q, k, v, build_mask("sdpa", builder), scaling=dim**-0.5)
    assert out.shape == (1, total, heads, dim)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    # without the bounds the packed batch is one run over the whole mask: still exact, just T² work
    whole, _ = packed_sdpa_attention(module, q, k, v, build_mask(packed_attention.NAME, builder), scaling=dim**-0.5)
    torch.testing.assert_close(whole, ref, rtol=0, atol=1e-6)


def test_anything_but_a_segment_mask_is_plain_sdpa_and_bad_bounds_are_named():
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 1, 2, 10, 8, generator=gen)
    module = attention_module(1)
    dense = build_mask("sdpa", lengths=[4, 6])
    assert torch.equal(
        packed_sdpa_attention(module, q, k, v, dense)[0], sdpa_attention_forward(module, q, k, v, dense)[0]
    )
    segments = build_mask(packed_attention.NAME, lengths=[4, 6])
    with pytest.raises(ValueError, match=r"packed_sdpa: .*cu_seq_lens_q \[0, 4, 9\] do not match .* 10 tokens"):
        packed_sdpa_attention(module, q, k, v, segments, cu_seq_lens_q=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match=r"packed_sdpa: cu_seq_lens_k \[0, 5, 10\] differs"):
        packed_sdpa_attention(
            module, q, k, v, segments, cu_seq_lens_q=torch.tensor([0, 4, 10]), cu_seq_lens_k=torch.tensor([0, 5, 10])
        )


def test_packed_eager_keeps_attention_sinks_and_equals_eager_over_the_dense_mask():
    """gpt-oss's own eager attention (sinks: a learned per-head logit in every softmax), once per sequence."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss import modeling_gpt_oss

    cfg = GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW)
    cfg._attn_implementation = packed_attention.EAGER_NAME
    torch.manual_seed(0)
    module = modeling_gpt_oss.GptOssAttention(cfg, layer_idx=0).eval()
    nn.init.normal_(module.sinks, std=2.0)  # sinks that matter
    total = sum(LENGTHS)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, total, 8, generator=gen)
    k, v = torch.randn(2, 1, 2, total, 8, generator=gen)
    cu = bounds(LENGTHS)
    segments = build_mask(packed_attention.EAGER_NAME)
    assert isinstance(segments, SegmentMask)
    out, _ = packed_attention.packed_eager_attention(module, q, k, v, segments, scaling=8**-0.5, cu_seq_lens_q=cu)
    dense = build_mask("eager")  # float: 0 kept, dtype min dropped
    ref, _ = modeling_gpt_oss.eager_attention_forward(module, q, k, v, dense, scaling=8**-0.5)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    no_sinks, _ = packed_sdpa_attention(
        module, q, k, v, build_mask(packed_attention.NAME), scaling=8**-0.5, cu_seq_lens_q=cu
    )
    assert (out - no_sinks).abs().max() > 1e-2  # the sinks changed the result: sdpa would have dropped them
