"""Sliding layers' in-block rule (issue 20 item 4): `sliding_block_attention = "causal" | "bidirectional"`,
trained by the dense and flex masks, exported with the keys SGLang and vLLM read (is_causal), and served
the same way by the shipped modeling file. The MASK token is exported as its id and its string."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from pydantic import ValidationError

from common.config import DrafterConfig, default_sliding_block_attention
from consumer.export.dflash import layer_is_causal
from consumer.export.layout import export_config, write_export
from consumer.mask_token import mask_token_text
from consumer.model import DFlashDrafter
from consumer.objective import attention_masks, build_draft_batch
from consumer.sliding_rule import SlidingRuleError, export_keys, served_rule, serving_caveats
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer
from evaluation.evaluate import load_drafter
from tests.consumer.test_drafter_common import LAYER_IDS, drafter_cfg, target_features, tiny_target

B, MASK, EOS = 4, 99, 3


def one_anchor_batch():
    """One sequence of 12 tokens whose only candidate anchor is p=8: block rows at positions 8..11."""
    loss_mask = torch.tensor([0] * 8 + [1, 1, 0, 0], dtype=torch.uint8)
    return build_draft_batch(
        torch.arange(20, 32),
        loss_mask,
        torch.tensor([0, 12]),
        anchors_per_seq=1,
        block_size=B,
        mask_token_id=MASK,
        gamma=4.0,
        generator=torch.Generator(),
    )


def rows(*text):
    return torch.tensor([[c == "1" for c in r.replace("|", "")] for r in text])


# columns: context positions 0..11 | block slots 0..3 (positions 8..11); one row per block slot
LITERAL = {
    (3, "bidirectional"): rows("000000110000|1110", "000000010000|1111", "000000000000|1111", "000000000000|0111"),
    (3, "causal"): rows("000000110000|1000", "000000010000|1100", "000000000000|1110", "000000000000|0111"),
    (6, "bidirectional"): rows("000111110000|1111", "000011110000|1111", "000001110000|1111", "000000110000|1111"),
    (6, "causal"): rows("000111110000|1000", "000011110000|1100", "000001110000|1110", "000000110000|1111"),
}
FULL = rows(*["111111110000|1111"] * 4)  # a full layer: context j < p, the whole block, under either rule


@pytest.mark.parametrize("window, rule", list(LITERAL))
def test_sliding_masks_are_the_literal_rule_dense_and_flex(window, rule):
    """Slot k (position 8+k) sees context j with 8+k-j < W and, causal, its block's slots k' <= k (with
    k-k' < W); bidirectional, every slot with |k-k'| < W. Both attention paths, through attention_masks."""
    batch = one_anchor_batch()
    assert batch.anchor_tok.tolist() == [8]
    kinds = ["sliding_attention", "full_attention"]
    dense = attention_masks(batch, kinds, window, flex=False, sliding_block_attention=rule)
    flex = attention_masks(batch, kinds, window, flex=True, sliding_block_attention=rule)
    for kind, want in (("sliding_attention", LITERAL[window, rule]), ("full_attention", FULL)):
        dm = dense[kind]
        got = torch.zeros(B, 16, dtype=torch.bool)
        for k in range(B):
            allowed = dm.allowed[0, 0, k if kind == "sliding_attention" else 0]
            got[k, dm.key_index[0][allowed]] = True
        assert torch.equal(got, want), kind
        bm = flex[kind]
        Qp, KVp = bm.seq_lengths
        grid = bm.mask_mod(0, 0, torch.arange(Qp)[:, None], torch.arange(KVp)[None, :])
        Tp = KVp - Qp
        assert torch.equal(torch.cat([grid[:B, :12], grid[:B, Tp : Tp + B]], dim=1), want), kind
        assert not grid[:B, 12:Tp].any() and not grid[:B, Tp + B :].any() and not grid[B:].any()
    with pytest.raises(ValueError, match="sliding_block_attention"):
        attention_masks(batch, kinds, window, flex=False, sliding_block_attention="both")


def test_rule_defaults_validation_and_the_engines_reading_of_the_keys():
    assert DrafterConfig(name="d").block_attention == "causal"
    assert DrafterConfig(name="d", sliding_block_attention="bidirectional").block_attention == "bidirectional"
    assert (default_sliding_block_attention("dflash1"), default_sliding_block_attention("dflash2")) == (
        "causal",
        "bidirectional",
    )
    with pytest.raises(ValidationError, match="sliding_block_attention"):
        DrafterConfig(name="d", sliding_block_attention="both")
    with pytest.raises(ValidationError, match="init_from"):
        DrafterConfig(name="d", init_from="")
    mixed = ["sliding_attention", "full_attention"]
    assert export_keys("causal", mixed) == {} and export_keys("bidirectional", mixed) == {"is_causal": False}
    assert export_keys("causal", ["full_attention"] * 2) == {"is_causal": False}
    # what SGLang / vLLM serve for each config, and the shipped modeling file reads it the same way per layer
    cases = [
        ({}, "causal", [True, False]),
        ({"is_causal": False}, "bidirectional", [False, False]),
        ({"dflash_config": {"causal": False}}, "bidirectional", [False, False]),
    ]
    for extra, rule, per_layer in cases:
        config = {"layer_types": mixed, "num_hidden_layers": 2, **extra}
        assert served_rule(config, "c.json") == rule
        hf = transformers.Qwen3Config(**config)
        assert [layer_is_causal(hf, i) for i in range(2)] == per_layer
    assert served_rule({"layer_types": ["full_attention"]}, "c.json") is None
    with pytest.raises(SlidingRuleError, match=r"c.json: is_causal = true makes every layer causal"):
        served_rule({"layer_types": mixed, "is_causal": True}, "c.json")
    assert serving_caveats("causal", ["sliding_attention"] * 2, 8, 4) == []
    notes = serving_caveats("bidirectional", mixed, 3, 4)
    assert len(notes) == 3 and "is_causal: false" in notes[0] and "VLLM_USE_V2_MODEL_RUNNER" in notes[2]
    assert "SGLang from 0.5.18" in notes[0] and "0.5.15-0.5.17 serve sliding layers causally" in notes[0]
    assert "torch_native" in notes[0] and "trtllm_mha" in notes[0]


def test_mask_token_string_is_the_one_the_tokenizer_maps_to_the_id(tmp_path):
    """SGLang refuses a drafter whose dflash_config.mask_token the tokenizer maps to another id."""
    from tokenizers import Tokenizer, models

    def tokenizer_dir(name, vocab):
        path = tmp_path / name
        tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "a")))
        tok.save_pretrained(path)
        return str(path)

    plain = tokenizer_dir("plain", {"a": 0, "b": 1, "<r0>": 2})
    assert mask_token_text(plain, 2) == "<r0>"  # an id the tokenizer has: its own string
    assert mask_token_text(plain, 7) == "<|MASK|>"  # a spare row: z-lab's token
    taken = tokenizer_dir("taken", {"a": 0, "<|MASK|>": 1})
    assert mask_token_text(taken, 5) == "<|dflash_mask_5|>"  # "<|MASK|>" is id 1 there: another name
    assert mask_token_text(str(tmp_path / "none"), 5) == "<|MASK|>"  # no tokenizer files


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    """A tiny target and a drafter with a sliding (window 3 < context) and a full layer, trained briefly on
    the target's greedy continuations (causal rule); the bidirectional drafter reuses its weights."""
    path = tmp_path_factory.mktemp("target")
    target = tiny_target(path)
    prompts = [torch.tensor([5 + i, 40 + 7 * i, 90 + i, 200 + 3 * i]) for i in range(2)]
    seqs = [
        target.generate(p[None], max_new_tokens=24, do_sample=False, eos_token_id=EOS, pad_token_id=0)[0]
        for p in prompts
    ]
    ids = torch.cat(seqs)
    mask = torch.cat([(torch.arange(len(s)) >= 4).to(torch.uint8) for s in seqs])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    cfg = drafter_cfg(
        block_size=B,
        num_layers=2,
        anchors_per_seq=16,
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
    )
    trainer = Trainer(cfg, load_target_parts(path), LAYER_IDS, "cpu")
    feats = target_features(target, seqs)
    for i in range(25):
        trainer.train_batch(feats, ids, mask, cu, seq=i)
    return target, trainer, seqs[0], feats[: len(seqs[0])], prompts


@pytest.mark.parametrize("rule", ["causal", "bidirectional"])
def test_export_serves_the_trained_mask_and_stays_lossless(sliding, tmp_path, rule):
    """Reloaded through AutoModel + trust_remote_code, the export drafts exactly what the training forward
    computes under the rule's masks (and the two rules differ); spec_generate equals the target's greedy."""
    target, trainer, seq, feats, prompts = sliding
    parts = trainer.parts
    arch = dataclasses.replace(trainer.arch, sliding_block_attention=rule)
    model = DFlashDrafter(arch, parts.embed_tokens, parts.lm_head)
    model.load_state_dict(trainer.model.state_dict())
    cfg = export_config(
        arch, parts, block_size=B, mask_token_id=trainer.mask_token_id, target_layer_ids=LAYER_IDS, dtype="float32"
    )
    write_export(tmp_path, model.state_dict(), cfg)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved.get("is_causal", "absent") == ("absent" if rule == "causal" else False)
    assert saved["dflash_config"]["mask_token"] == "<|MASK|>" and saved["sliding_window"] == 3
    draft = transformers.AutoModel.from_pretrained(
        str(tmp_path), trust_remote_code=True, local_files_only=True, dtype=torch.float32
    )
    assert [layer.self_attn.causal for layer in draft.layers] == [rule == "causal", False]
    assert load_drafter(tmp_path, parts.path).model.arch.sliding_block_attention == rule  # dflash-eval reads it too
    n = len(seq)
    loss_mask = torch.ones(n, dtype=torch.uint8)
    batch = build_draft_batch(
        seq,
        loss_mask,
        torch.tensor([0, n]),
        anchors_per_seq=6,
        block_size=B,
        mask_token_id=trainer.mask_token_id,
        gamma=4.0,
        generator=torch.Generator().manual_seed(3),
    )
    other = "bidirectional" if rule == "causal" else "causal"
    with torch.no_grad():
        masks = attention_masks(batch, arch.attention_layers, 3, flex=False, sliding_block_attention=rule)
        trained = model(feats, batch.ctx_pos, batch.block_ids, batch.block_pos, masks).view(-1, B, 64)
        wrong = attention_masks(batch, arch.attention_layers, 3, flex=False, sliding_block_attention=other)
        other_h = model(feats, batch.ctx_pos, batch.block_ids, batch.block_pos, wrong).view(-1, B, 64)
        for a, p in enumerate(batch.anchor_tok.tolist()):
            block = batch.block_ids.view(-1, B)[a]
            served = draft(noise_embedding=parts.embed_tokens[block][None], target_hidden=feats[None, :p])[0]
            torch.testing.assert_close(served, trained[a], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(trained, other_h, atol=1e-3)  # the rule changes what the drafter computes
    for prompt in prompts:
        out = draft.spec_generate(input_ids=prompt[None], max_new_tokens=20, target=target, stop_token_ids=[EOS])
        want = target.generate(prompt[None], max_new_tokens=20, do_sample=False, eos_token_id=EOS, pad_token_id=0)
        assert out[0].tolist() == want[0].tolist()
