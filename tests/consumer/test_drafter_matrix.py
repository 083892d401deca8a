"""Every target architecture of tests/target_zoo.py, drafter side: target parts load, a drafter builds from
them, trains 3 steps with a finite loss and exports; the export reloads through AutoModel with
trust_remote_code and its spec_generate output equals the target's own greedy decoding."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from common.config import dflash_layer_ids
from consumer.checkpoint import save_checkpoint
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer
from tests.consumer.test_drafter_common import drafter_cfg
from tests.target_zoo import (
    ARCHS,
    EOS_ID,
    FALLBACK_ARCHS,
    MASK_ID,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_target,
    layer_outputs,
    load_model,
)


def load_target(arch: str, path):
    """As a user loads it: the class its config names (a multimodal wrapper as itself: the Qwen3.6-27B,
    Gemma 3, Mistral-Small-3 and Qwen3-VL forms), fp32."""
    return load_model(path)


def sharpen(arch: str, path) -> None:
    """Scale the saved LM head ×30 (random tiny targets have top-2 logit gaps near float noise; a trained
    target's are wide), so that 'equal to greedy' tests the algorithm, not ties. Saved back to disk, so the
    drafter's target parts, the features and the decoding all use the same target."""
    model = load_target(arch, path)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    model.save_pretrained(str(path))


def features(target, seqs: list[torch.Tensor], layer_ids: list[int]) -> torch.Tensor:
    return torch.cat([layer_outputs(target, ids, layer_ids) for ids in seqs])


@pytest.mark.parametrize("arch", ARCHS + FALLBACK_ARCHS)
def test_drafter_trains_exports_and_decodes_losslessly(arch, tmp_path):
    path = build_target(arch, tmp_path / "target")
    sharpen(arch, path)
    target = load_target(arch, path)
    parts = load_target_parts(path)
    text = target.config.get_text_config()
    assert (parts.hidden_size, parts.vocab_size) == (text.hidden_size, VOCAB_SIZE)
    layer_ids = dflash_layer_ids(text.num_hidden_layers, 2)

    g = torch.Generator().manual_seed(0)
    low = len(SPECIAL_TOKENS)
    seqs = [torch.randint(low, 260, (n,), generator=g) for n in (20, 13)]
    ids = torch.cat(seqs)
    mask = torch.cat([(torch.arange(len(s)) >= 3).to(torch.uint8) for s in seqs])
    cu = torch.tensor([0, 20, 33])
    trainer = Trainer(drafter_cfg(block_size=4, num_layers=1, anchors_per_seq=8), parts, layer_ids, "cpu")
    assert trainer.mask_token_id == MASK_ID  # the tokenizer's <|MASK|>
    feats = features(target, seqs, layer_ids)
    losses = [trainer.train_batch(feats, ids, mask, cu, seq=i)["loss"] for i in range(3)]
    assert all(math.isfinite(x) for x in losses), losses

    ckpt = save_checkpoint(tmp_path / "ckpt", trainer)
    draft = transformers.AutoModel.from_pretrained(
        str(ckpt), trust_remote_code=True, local_files_only=True, dtype=torch.float32
    )
    assert draft.config.eos_token_id == EOS_ID  # the target's, written into the export config
    for prompt in (seqs[0][:5], torch.tensor([1, 70, 80, 90, 2, 1])):  # a training prefix, a ChatML-like one
        out = draft.spec_generate(
            input_ids=prompt[None], max_new_tokens=12, temperature=0.0, target=target, stop_token_ids=[EOS_ID]
        )
        plain = target.generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=EOS_ID, pad_token_id=0)
        assert out[0].tolist() == plain[0].tolist()
        assert len(draft.acceptance_lengths) >= 1
    # the sampling path (speculative sampling) through the same cache rollback: at a vanishing temperature it
    # is greedy verification, token for token and step for step
    greedy_steps = list(draft.acceptance_lengths)
    cold = draft.spec_generate(
        input_ids=prompt[None], max_new_tokens=12, temperature=1e-6, target=target, stop_token_ids=[EOS_ID]
    )
    assert cold[0].tolist() == plain[0].tolist() and draft.acceptance_lengths == greedy_steps
