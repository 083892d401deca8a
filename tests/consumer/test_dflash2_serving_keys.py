"""DFlash2's optional config keys (issue 30 §2): output_multiplier, final_logit_softcapping, num_target_layers,
selector_vocab_size. Written on export when they apply, read on init_from (taken when the job leaves them unset,
a job value that differs is one line), and applied where they change the math: the edge scores' unary term
softcap(m · h·Wᵀ), candidates among ids below selector_vocab_size, in training, dflash-eval and the export."""

from __future__ import annotations

import json

import pytest
import torch

from consumer.dflash2 import DFlash2Shape, _edge_scores, selector_loss
from consumer.warm_start import WarmStartError, warm_start, with_published_serving_keys
from tests.consumer.test_drafter_common import drafter_cfg, target_features, tiny_target

B, V, SVS = 4, 512, 500
KEYS = {"output_multiplier": 0.196, "final_logit_softcapping": 20.0, "selector_vocab_size": SVS}
LAYER_IDS = [1, 25, 49]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A DFlash2 drafter on a 52-layer tiny target with the three keys set, trained 3 steps and checkpointed."""
    from consumer.checkpoint import save_checkpoint
    from consumer.target_parts import load_target_parts
    from consumer.trainer import Trainer

    path = tmp_path_factory.mktemp("target")
    target = tiny_target(path, num_hidden_layers=52, hidden_size=32, head_dim=8, intermediate_size=64)
    parts = load_target_parts(path)
    seqs = [torch.arange(10, 40), torch.arange(60, 85)]
    ids = torch.cat(seqs)
    mask = torch.cat([(torch.arange(len(s)) >= 2).to(torch.uint8) for s in seqs])
    cu = torch.tensor([0, 30, 55])
    feats = target_features(target, seqs, LAYER_IDS)
    cfg = drafter_cfg(arch="dflash2", block_size=B, selector_rank=8, selector_top_k=4, dtype="float32", **KEYS)
    trainer = Trainer(cfg, parts, LAYER_IDS, "cpu")
    for i in range(3):
        trainer.train_batch(feats, ids, mask, cu, seq=i)
    return parts, trainer, save_checkpoint(tmp_path_factory.mktemp("ckpt"), trainer), feats


def test_the_export_writes_the_keys_that_apply(published):
    ckpt = published[2]
    cfg = json.loads((ckpt / "config.json").read_text())
    assert {k: cfg["dflash_config"][k] for k in KEYS} == KEYS
    assert cfg["num_target_layers"] == 52 and cfg["dflash_config"]["block_size"] == B
    plain = DFlash2Shape(B).export_keys()
    assert plain == {}  # defaults are not written: a drafter without them exports what it did before


def test_init_from_takes_the_keys_and_the_export_round_trips(published, tmp_path):
    from consumer.checkpoint import save_checkpoint
    from consumer.trainer import Trainer

    parts, trainer, ckpt, _ = published
    cfg = drafter_cfg(arch="dflash2", block_size=B, selector_rank=8, selector_top_k=4, dtype="float32", seed=5)
    cfg = with_published_serving_keys(cfg.model_copy(update={"init_from": str(ckpt)}))
    assert (cfg.output_multiplier, cfg.final_logit_softcapping, cfg.selector_vocab_size) == (0.196, 20.0, SVS)
    fresh = Trainer(cfg, parts, LAYER_IDS, "cpu")
    warm_start(fresh, ckpt)
    again = json.loads((save_checkpoint(tmp_path / "again", fresh) / "config.json").read_text())
    assert {k: again["dflash_config"][k] for k in KEYS} == KEYS and again["num_target_layers"] == 52
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name

    other = drafter_cfg(arch="dflash2", block_size=B, selector_rank=8, selector_top_k=4, dtype="float32")
    other = other.model_copy(update={"init_from": str(ckpt), "output_multiplier": 0.5})
    with pytest.raises(WarmStartError, match=r"output_multiplier = 0.196, but drafter d0 has output_multiplier = 0.5"):
        warm_start(Trainer(with_published_serving_keys(other), parts, LAYER_IDS, "cpu"), ckpt)


def test_a_target_of_another_depth_is_refused_naming_num_target_layers(published, tmp_path):
    from consumer.target_parts import load_target_parts
    from consumer.trainer import Trainer

    _, _, ckpt, _ = published
    tiny_target(tmp_path / "t50", num_hidden_layers=50, hidden_size=32, head_dim=8, intermediate_size=64)
    cfg = drafter_cfg(arch="dflash2", block_size=B, selector_rank=8, selector_top_k=4, dtype="float32", **KEYS)
    trainer = Trainer(cfg, load_target_parts(tmp_path / "t50"), LAYER_IDS, "cpu")  # the same taps, 50 layers
    with pytest.raises(WarmStartError, match=r"num_target_layers = 52, but drafter d0 has num_target_layers = 50"):
        warm_start(trainer, ckpt)


def test_the_keys_change_the_edge_scores_the_walk_and_the_candidates(published):
    """Training's edge scores use softcap(0.196 · raw); the walk and the selector loss pick candidates among ids <
    500; the exported modeling file (AutoModel) and dflash-eval's loader walk exactly as the training model does."""
    import transformers

    from evaluation.evaluate import load_drafter

    parts, trainer, ckpt, feats = published
    model = trainer.model
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 32, generator=g)
    cand = torch.randint(0, SVS, (6, 4), generator=g)
    prev = torch.randint(0, SVS, (6,), generator=g)
    raw = torch.einsum("nh,nkh->nk", h, model.lm_head[cand])
    want = model.candidate_selector(h, 20.0 * torch.tanh(0.196 * raw / 20.0), cand, prev)
    torch.testing.assert_close(_edge_scores(model, h, cand, prev), want)

    with torch.no_grad():  # a head row past selector_vocab_size that would win every top-k
        model.lm_head[SVS + 3] = h.mean(0) * 1e3
    try:
        block = torch.tensor([17] + [trainer.mask_token_id] * (B - 1))
        with torch.no_grad():
            hb = model(feats[:9], torch.arange(9), block, torch.arange(9, 9 + B), {"full_attention": None})[1:]
        drafts = model.walk(hb, block[0])
        assert (drafts < SVS).all()
        labels = torch.randint(0, SVS, (B * 2,), generator=g)
        _, stats = selector_loss(model, hb.repeat(2, 1)[: B * 2], labels, torch.ones(B * 2), 64)
        assert stats[0] > 0
        draft = transformers.AutoModel.from_pretrained(
            str(ckpt), trust_remote_code=True, local_files_only=True, dtype=torch.float32
        )
        served, _ = draft.propose(hb, int(block[0]), model.lm_head, 0.0)
        assert served.tolist() == drafts.tolist()
        proposer = load_drafter(ckpt, parts.path)
        assert proposer.model.shape == model.shape
        proposer.model.lm_head.copy_(model.lm_head)
        assert proposer.model.walk(hb, block[0]).tolist() == drafts.tolist()
    finally:
        with torch.no_grad():
            model.lm_head.copy_(parts.lm_head)
