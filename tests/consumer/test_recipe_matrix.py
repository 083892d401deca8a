"""Issue 20 on qwen3 and a hybrid target of the zoo (Qwen3.5's text decoder: Gated DeltaNet + full attention):
a drafter with the recipe's options together (Muon, a sliding layer under each in-block rule) trains, its
export reloads through AutoModel and serves the target's greedy output exactly, and `init_from` of that export
starts a fresh drafter at the same logits."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from common.config import dflash_layer_ids
from consumer.checkpoint import save_checkpoint
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer
from consumer.warm_start import warm_start
from tests.consumer.test_drafter_common import drafter_cfg
from tests.target_zoo import EOS_ID, SPECIAL_TOKENS, build_target, layer_outputs, load_model


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5_text"])
def target(request, tmp_path_factory):
    path = build_target(request.param, tmp_path_factory.mktemp(request.param))
    model = load_model(path)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)  # as the matrix does: no near-ties in greedy
    model.save_pretrained(str(path))
    layer_ids = dflash_layer_ids(model.config.get_text_config().num_hidden_layers, 2)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(len(SPECIAL_TOKENS), 260, (n,), generator=g) for n in (20, 13)]
    feats = torch.cat([layer_outputs(model, s, layer_ids) for s in seqs])
    ids, mask = torch.cat(seqs), torch.cat([(torch.arange(len(s)) >= 3).to(torch.uint8) for s in seqs])
    return path, model, layer_ids, seqs, (feats, ids, mask, torch.tensor([0, 20, 33]))


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    out = model.generate(prompt[None], max_new_tokens=n, do_sample=False, eos_token_id=EOS_ID, pad_token_id=0)
    return out[0].tolist()


@pytest.mark.parametrize("rule", ["causal", "bidirectional"])
def test_muon_sliding_drafter_trains_serves_exactly_and_warm_starts(target, rule, tmp_path):
    path, model, layer_ids, seqs, batch = target
    cfg = dict(
        block_size=4,
        num_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=3,
        sliding_block_attention=rule,
        optimizer="muon",
        dtype="float32",
    )
    trainer = Trainer(drafter_cfg(**cfg), load_target_parts(path), layer_ids, "cpu")
    losses = [trainer.train_batch(*batch, seq=i)["loss"] for i in range(4)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    ckpt = save_checkpoint(tmp_path / "ckpt", trainer)
    draft = transformers.AutoModel.from_pretrained(
        str(ckpt), trust_remote_code=True, local_files_only=True, dtype=torch.float32
    )
    for prompt in (seqs[0][:5], torch.tensor([1, 70, 80, 90, 2, 1])):
        out = draft.spec_generate(
            input_ids=prompt[None], max_new_tokens=12, temperature=0.0, target=model, stop_token_ids=[EOS_ID]
        )
        assert out[0].tolist() == greedy(model, prompt, 12)
    fresh = Trainer(drafter_cfg(**cfg, seed=5), load_target_parts(path), layer_ids, "cpu")
    feats, ids, mask, cu = batch
    context, blocks, masks = trainer.draft_inputs(feats, ids, mask, cu, torch.Generator().manual_seed(3))
    want = trainer.model.logits(trainer.model(context, blocks.ctx_pos, blocks.block_ids, blocks.block_pos, masks))
    warm_start(fresh, ckpt)
    got = fresh.model.logits(fresh.model(context, blocks.ctx_pos, blocks.block_ids, blocks.block_pos, masks))
    assert torch.equal(got, want)  # float32 export into a float32 drafter: exactly
