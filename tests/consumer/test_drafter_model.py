"""Target parts loading and the drafter model: parameter names, frozen parts, training vs drafting."""

from __future__ import annotations

import json
import re

import pytest
import torch

from consumer.mask_token import resolve_mask_token_id
from consumer.model import DFlashDrafter, DrafterArch
from consumer.objective import build_draft_batch, dense_mask
from consumer.target_parts import TargetPartsError, load_target_parts
from tests.consumer.test_drafter_common import TINY, tiny_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    return path, tiny_target(path)


def test_target_parts_reads_config_and_frozen_tensors(target):
    path, model = target
    parts = load_target_parts(path)
    assert (parts.hidden_size, parts.num_attention_heads, parts.num_key_value_heads, parts.head_dim) == (
        64,
        4,
        2,
        16,
    )
    assert (parts.intermediate_size, parts.vocab_size, parts.num_hidden_layers) == (128, 512, 6)
    assert parts.max_position_embeddings == 256
    assert parts.rms_norm_eps == model.config.rms_norm_eps
    assert torch.equal(parts.embed_tokens, model.model.embed_tokens.weight)
    assert torch.equal(parts.lm_head, model.lm_head.weight)
    assert load_target_parts(path, torch.bfloat16).lm_head.dtype == torch.bfloat16


def test_target_parts_tied_and_sharded(tmp_path):
    tied = tiny_target(tmp_path / "tied", tie_word_embeddings=True)
    parts = load_target_parts(tmp_path / "tied")
    assert parts.tie_word_embeddings and parts.lm_head is parts.embed_tokens
    assert torch.equal(parts.lm_head, tied.lm_head.weight)
    model = tiny_target(tmp_path / "plain")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    parts = load_target_parts(tmp_path / "sharded")
    assert torch.equal(parts.embed_tokens, model.model.embed_tokens.weight)
    assert torch.equal(parts.lm_head, model.lm_head.weight)


def test_target_parts_errors_name_the_place(tmp_path):
    with pytest.raises(TargetPartsError, match=re.escape(str(tmp_path / "nowhere"))):
        load_target_parts(tmp_path / "nowhere")
    (tmp_path / "cfg_only").mkdir()
    (tmp_path / "cfg_only" / "config.json").write_text(json.dumps({**TINY, "model_type": "qwen3"}))
    with pytest.raises(TargetPartsError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        load_target_parts(tmp_path / "cfg_only")
    (tmp_path / "cfg_bad").mkdir()
    (tmp_path / "cfg_bad" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(TargetPartsError, match=r"cfg_bad/config\.json: not a usable model config"):
        load_target_parts(tmp_path / "cfg_bad")


def save_tokenizer(path, words: int, special: list[str], mask: str | None = None):
    """A word-level tokenizer of `words` ids plus the given added special tokens, saved like a download."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0")),
        bos_token="w1",
        eos_token="w2",
    )
    tok.add_special_tokens({"additional_special_tokens": special, **({"mask_token": mask} if mask else {})})
    tok.save_pretrained(path)
    return tok


def test_mask_token_id_resolution(tmp_path):
    assert resolve_mask_token_id(tmp_path, 512, None) == 511  # no tokenizer: the last row
    assert resolve_mask_token_id(tmp_path, 512, 7) == 7
    with pytest.raises(ValueError, match="outside the target's embedding"):
        resolve_mask_token_id(tmp_path, 512, 512)
    # Llama-3-like: the tokenizer fills the embedding; a reserved special token (not the first added one)
    save_tokenizer(tmp_path / "full", 10, ["<|begin_of_text|>", "<|reserved_special_token_0|>", "<unused0>"])
    assert resolve_mask_token_id(tmp_path / "full", 13, None) == 11
    # Qwen3-like: the embedding has rows past the tokenizer's last id: the first spare row
    assert resolve_mask_token_id(tmp_path / "full", 20, None) == 13
    save_tokenizer(tmp_path / "gemma", 10, ["<start_of_turn>", "<unused0>", "<unused1>"])
    assert resolve_mask_token_id(tmp_path / "gemma", 13, None) == 11
    masked = save_tokenizer(tmp_path / "masked", 10, ["<x>"], mask="<mask>")
    mask_id = masked.convert_tokens_to_ids("<mask>")
    assert resolve_mask_token_id(tmp_path / "masked", 20, None) == mask_id < len(masked)  # its own, not a spare row
    save_tokenizer(tmp_path / "none", 10, ["<|im_start|>"])
    with pytest.raises(ValueError, match=r"uses every row.*set mask_token_id"):
        resolve_mask_token_id(tmp_path / "none", 11, None)


ARCH = DrafterArch(64, 4, 2, 16, 128, 2, 3, 1e-6, 10000.0)


def make_model(seed: int = 0) -> DFlashDrafter:
    g = torch.Generator().manual_seed(seed)
    return DFlashDrafter(ARCH, torch.randn(512, 64, generator=g), torch.randn(512, 64, generator=g))


def test_parameter_names_are_the_export_keys():
    model = make_model()
    want = {"fc.weight": (64, 3 * 64), "hidden_norm.weight": (64,), "norm.weight": (64,)}
    for i in range(2):
        p = f"layers.{i}."
        want |= {
            p + "self_attn.q_proj.weight": (4 * 16, 64),
            p + "self_attn.k_proj.weight": (2 * 16, 64),
            p + "self_attn.v_proj.weight": (2 * 16, 64),
            p + "self_attn.o_proj.weight": (64, 4 * 16),
            p + "self_attn.q_norm.weight": (16,),
            p + "self_attn.k_norm.weight": (16,),
            p + "mlp.gate_proj.weight": (128, 64),
            p + "mlp.up_proj.weight": (128, 64),
            p + "mlp.down_proj.weight": (64, 128),
            p + "input_layernorm.weight": (64,),
            p + "post_attention_layernorm.weight": (64,),
        }
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == want
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(want)
    assert not model.embed_tokens.requires_grad and not model.lm_head.requires_grad


def test_training_rows_of_an_anchor_equal_drafting_at_that_anchor():
    """The training path (packed, dense mask) and draft() agree: the block of anchor p sees the
    context rows 0..p-1 and itself at positions p..p+B-1 — drafting with the first p features."""
    torch.manual_seed(0)
    model = make_model()
    lengths = [30, 22]
    ids = torch.randint(0, 500, (sum(lengths),))
    loss_mask = torch.ones(sum(lengths), dtype=torch.uint8)
    cu = torch.tensor([0, 30, 52])
    batch = build_draft_batch(
        ids,
        loss_mask,
        cu,
        anchors_per_seq=5,
        block_size=4,
        mask_token_id=511,
        gamma=4.0,
        generator=torch.Generator().manual_seed(0),
    )
    features = torch.randn(sum(lengths), 3 * 64)
    with torch.no_grad():
        h = model(features, batch.ctx_pos, batch.block_ids, batch.block_pos, dense_mask(batch))
    logits = model.logits(h).view(-1, 4, 512)
    for a in range(batch.num_anchors):
        p_packed, start = int(batch.anchor_tok[a]), int(cu[int(batch.anchor_seq[a])])
        drafted = model.draft(features[start:p_packed], batch.block_ids.view(-1, 4)[a])
        torch.testing.assert_close(drafted, logits[a], rtol=1e-4, atol=1e-4)


def test_gradients_reach_only_the_trainable_parameters():
    model = make_model()
    features = torch.randn(10, 3 * 64)
    h = model(features, torch.arange(10), torch.tensor([1, 2, 511, 511]), torch.arange(10, 14), None)
    model.logits(h).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert model.embed_tokens.grad is None and model.lm_head.grad is None
