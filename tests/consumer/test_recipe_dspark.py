"""DSpark (issue 30 §1): next-token labels (literal values), the forward and loss against an independent loop,
the export as vLLM's Qwen3DSparkForCausalLM and SGLang's DSpark parser load it, the warm start from a DFlash1
drafter, and greedy speculative decoding with the Markov head's sequential walk (lossless)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from consumer.dspark import DSparkDrafter, DSparkShape, dspark_loss, previous_tokens
from consumer.model import DrafterArch
from consumer.objective import build_draft_batch, dense_mask
from tests.consumer.test_drafter_common import drafter_cfg, target_features, tiny_target

B, V, H, R = 4, 512, 64, 8
LAYER_IDS = [1, 2, 4]  # the tiny target has 6 layers; SGLang serves no DSpark tap of the last one (5)
ARCH = DrafterArch(
    hidden_size=H,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    num_layers=1,
    num_features=3,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
)


def frozen(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=g) * 0.5, torch.randn(V, H, generator=g) * 0.5


def randomised(seed: int = 3, with_markov: bool = True) -> DSparkDrafter:
    """A DSpark drafter whose heads are far from their init (the Markov bias and confidence matter)."""
    embed, head = frozen()
    model = DSparkDrafter(ARCH, DSparkShape(B, R, with_markov), embed, head, init_seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "markov" in name or "confidence" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def test_next_token_labels_weights_and_contiguous_prefix_literal():
    """Slot k of anchor p predicts x[p+k+1] (slot 0 too) with w_k = exp(-k/4); a slot past the sequence end or
    after an unsupervised token carries no loss, nor does any slot after it (DeepSpec's cumprod eval_mask)."""
    ids = torch.arange(100, 112)  # one sequence of 12 tokens: x[i] = 100 + i
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.uint8)
    batch = build_draft_batch(
        ids,
        mask,
        torch.tensor([0, 12]),
        anchors_per_seq=12,
        block_size=B,
        mask_token_id=7,
        gamma=4.0,
        generator=torch.Generator().manual_seed(0),
        next_token=True,
    )
    # candidates: loss_mask 1 at p and p+1 -> p in {2, 3, 4, 5, 8, 9, 10}
    assert batch.anchor_tok.tolist() == [2, 3, 4, 5, 8, 9, 10]
    labels, w = batch.labels.view(-1, B), batch.weights.view(-1, B)
    assert labels[0].tolist() == [103, 104, 105, 106]
    assert batch.block_ids.view(-1, B)[0].tolist() == [102, 7, 7, 7]
    d = [math.exp(-k / 4) for k in range(B)]
    torch.testing.assert_close(w[0], torch.tensor(d))  # x3..x6 supervised
    torch.testing.assert_close(w[2], torch.tensor([d[0], d[1], 0.0, 0.0]))  # p=4: x7 has no loss, x8 after it neither
    torch.testing.assert_close(w[5], torch.tensor([d[0], d[1], 0.0, 0.0]))  # p=9: x12 is past the end
    torch.testing.assert_close(w[6], torch.tensor([d[0], 0.0, 0.0, 0.0]))
    prev = previous_tokens(batch.block_ids, batch.labels, B).view(-1, B)
    assert prev[0].tolist() == [102, 103, 104, 105]  # the anchor, then the token before each slot


def _loop_loss(
    model: DSparkDrafter, h: torch.Tensor, block_ids, labels, weights, target_h=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DSpark loss slot by slot with einsum (no shared code): Σ w·(0.1 CE + 0.9 ‖p − p*‖₁ + BCE(c, 1 − ½‖p − p*‖₁))
    with p* the one-hot label, or softmax(lm_head · target_h) when given; and the base + Markov logits [Q, V]."""
    W1 = model.markov_head.markov_w1.weight  # [V, r]
    W2 = model.markov_head.markov_w2.weight  # [V, r]
    Wc, bc = model.confidence_head.proj.weight[0], model.confidence_head.proj.bias[0]  # [H + r], []
    total, rows = torch.zeros(()), []
    A = labels.numel() // B
    for a in range(A):
        for k in range(B):
            i = a * B + k
            prev = block_ids[a * B] if k == 0 else labels[i - 1]
            e = W1[prev]  # [r]
            logit = torch.einsum("h,vh->v", h[i], model.lm_head) + torch.einsum("vr,r->v", W2, e)
            rows.append(logit)
            p = torch.softmax(logit, -1)
            if target_h is None:
                ref = torch.zeros(V)
                ref[labels[i]] = 1.0
            else:
                ref = torch.softmax(torch.einsum("h,vh->v", target_h[i], model.lm_head), -1)
            ce = -torch.log(p[labels[i]])
            l1 = (p - ref).abs().sum()
            t = (1 - l1 / 2).detach()
            c = torch.einsum("f,f->", Wc, torch.cat([h[i], e])) + bc
            s = torch.sigmoid(c)
            bce = -(t * torch.log(s) + (1 - t) * torch.log(1 - s))
            if weights[i] > 0:
                total = total + weights[i] * (0.1 * ce + 0.9 * l1 + 1.0 * bce)
    return total, torch.stack(rows)


@pytest.mark.parametrize("soft", [False, True], ids=["one-hot target", "target distribution"])
def test_forward_and_loss_equal_an_independent_loop_with_their_gradients(soft):
    torch.manual_seed(0)
    model = randomised()
    lengths = [14, 11]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 500, (sum(lengths),), generator=g)
    batch = build_draft_batch(
        ids,
        torch.ones(sum(lengths), dtype=torch.uint8),
        torch.tensor([0, 14, 25]),
        anchors_per_seq=4,
        block_size=B,
        mask_token_id=511,
        gamma=4.0,
        generator=torch.Generator().manual_seed(2),
        next_token=True,
    )
    assert batch.num_anchors == 8 and batch.weights.view(-1, B)[:, 0].min() > 0
    feats = torch.randn(sum(lengths), 3 * H, generator=g)
    h = model(feats, batch.ctx_pos, batch.block_ids, batch.block_pos, dense_mask(batch))
    assert h.shape == (8 * B, H)
    target_h = torch.randn(8 * B, H, generator=g) if soft else None
    total, correct, stats = dspark_loss(model, h, batch.block_ids, batch.labels, batch.weights, 5, target_h)
    params = [model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight, model.confidence_head.proj.weight]
    grads = torch.autograd.grad(total, [*params, model.fc.weight], retain_graph=True)
    want, logits = _loop_loss(model, h, batch.block_ids, batch.labels, batch.weights, target_h)
    want_grads = torch.autograd.grad(want, [*params, model.fc.weight])
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-4)
    for got, ref in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert correct.tolist() == (logits.argmax(-1) == batch.labels).tolist()
    torch.testing.assert_close(stats[4], batch.weights.sum().double())
    # the served step logits are the same sum (consumer/dspark.py step_logits)
    prev = previous_tokens(batch.block_ids, batch.labels, B)
    torch.testing.assert_close(model.step_logits(h, prev), logits, rtol=1e-5, atol=1e-4)


def test_target_rows_are_the_last_layers_features_at_each_slots_position():
    """Slot k of anchor p reads the target's last hidden state at p+k (the distribution of x[p+k+1]), clamped to the
    batch; the last layer's block of the features is the one read."""
    from consumer.dspark import target_rows

    T, H2 = 10, 3
    feats = torch.arange(T * 2 * H2, dtype=torch.float32).view(T, 2 * H2)  # blocks: layer a | the last layer
    rows = target_rows(feats, torch.tensor([2, 8]), 3, last_block=1, hidden_size=H2)
    assert rows[:, 0].tolist() == [feats[i, H2].item() for i in (2, 3, 4, 8, 9, 9)]
    assert rows.shape == (6, H2)


def test_confidence_without_markov_reads_the_hidden_state_only():
    model = randomised(with_markov=False)
    assert model.confidence_head.proj.weight.shape == (1, H)
    h, prev = torch.randn(3, H), torch.tensor([1, 2, 3])
    want = h @ model.confidence_head.proj.weight[0] + model.confidence_head.proj.bias[0]
    torch.testing.assert_close(model.confidence(h, prev), want)


def test_walk_is_the_sequential_argmax_from_the_anchor():
    model = randomised()
    h = torch.randn(B, H)
    drafts, prev = [], torch.tensor(42)
    for k in range(B):
        logit = h[k] @ model.lm_head.T + model.markov_head.markov_w2.weight @ model.markov_head.markov_w1.weight[prev]
        prev = logit.argmax()
        drafts.append(int(prev))
    assert model.walk(h, torch.tensor(42)).tolist() == drafts


# ------------------------------------------------------------------------------------------ export and serving
EOS = 3


@torch.no_grad()
def plain_greedy(target, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    out = target.generate(
        prompt[None], max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=0
    )
    return out[0].tolist()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A DSpark drafter (tiny qwen3 target) trained on the target's greedy continuations, checkpointed."""
    from consumer.checkpoint import save_checkpoint
    from consumer.target_parts import load_target_parts
    from consumer.trainer import Trainer

    path = tmp_path_factory.mktemp("target")
    target = tiny_target(path)
    prompts = [torch.tensor([5 + i, 40 + 7 * i, 90 + i, 200 + 3 * i]) for i in range(3)]
    seqs = [torch.tensor(plain_greedy(target, p, 40)) for p in prompts]
    ids = torch.cat(seqs)
    mask = torch.cat([(torch.arange(len(s)) >= 4).to(torch.uint8) for s in seqs])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    cfg = drafter_cfg(arch="dspark", block_size=B, num_layers=1, anchors_per_seq=24, markov_rank=R, dtype="float32")
    trainer = Trainer(cfg, load_target_parts(path), LAYER_IDS, "cpu")
    feats = target_features(target, seqs, LAYER_IDS)
    for i in range(50):
        metrics = trainer.train_batch(feats, ids, mask, cu, seq=i)
    ckpt = save_checkpoint(tmp_path_factory.mktemp("ckpt"), trainer)
    return target, trainer, ckpt, prompts, metrics


def vllm_expected_params(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The parameters vLLM's Qwen3DSparkForCausalLM allocates for this config.json, under the names its
    load_weights gives the checkpoint's tensors ("model." + name, lm_head/embed_tokens shared with the target
    when absent): vllm/model_executor/models/qwen3_dspark.py + qwen3_dflash.py's DFlashQwen3Model (q/k/v and
    gate/up unfused here: the loader's stacked mapping takes them by these names)."""
    H, n = cfg["hidden_size"], len(cfg["target_layer_ids"])
    hq, hk, d, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]
    r, vocab = cfg["markov_rank"], cfg["vocab_size"]
    draft_vocab = cfg.get("draft_vocab_size") or vocab
    out = {
        "model.fc.weight": (H, n * H),
        "model.hidden_norm.weight": (H,),
        "model.norm.weight": (H,),
        "model.markov_head.markov_w1.weight": (vocab, r),
        "model.markov_head.markov_w2.weight": (draft_vocab, r),
    }
    if cfg.get("enable_confidence_head"):
        width = H + (r if cfg.get("confidence_head_with_markov") else 0)
        out["model.confidence_head.proj.weight"] = (1, width)
        out["model.confidence_head.proj.bias"] = (1,)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (hq * d, H),
            p + "self_attn.k_proj.weight": (hk * d, H),
            p + "self_attn.v_proj.weight": (hk * d, H),
            p + "self_attn.o_proj.weight": (H, hq * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, H),
            p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter),
        }
    return out


def vllm_load_names(names) -> list[str]:
    """Qwen3DSparkForCausalLM.load_weights' renaming: t2d dropped, d2t renamed, "model." before the rest but lm_head."""
    out = []
    for name in names:
        if "t2d" in name:
            continue
        out.append(name.replace("d2t", "draft_id_to_target_id") if "d2t" in name else
                   (name if "lm_head" in name else "model." + name))  # fmt: skip
    return out


def sglang_parse(cfg: dict, target_num_layers: int) -> dict:
    """SGLang's parse_dspark_draft_config + _validate_target_layer_ids (speculative/dspark_utils.py): block_size
    is gamma (the drafted positions), markov_rank > 0 with a known head type, a mask id, taps in {-1} ∪ [0, N-2]."""
    inner = cfg.get("dspark_config") or {}
    markov_rank = int(inner.get("markov_rank", cfg.get("markov_rank", 0)))
    head = str(inner.get("markov_head_type", cfg.get("markov_head_type"))).lower()
    mask = inner.get("mask_token_id", cfg.get("mask_token_id", (cfg.get("dflash_config") or {}).get("mask_token_id")))
    ids = cfg.get("target_layer_ids") or cfg["dflash_config"]["target_layer_ids"]
    gamma = int((cfg.get("dflash_config") or {}).get("block_size", cfg.get("block_size")))
    assert markov_rank > 0 and head in ("vanilla", "gated", "rnn") and mask is not None
    assert all(-1 <= i <= target_num_layers - 2 for i in ids) and ids == sorted(set(ids))
    return {"gamma": gamma, "markov_rank": markov_rank, "mask_token_id": int(mask), "target_layer_ids": ids}


def test_export_loads_as_vllm_and_sglang_read_it(trained):
    from safetensors import safe_open

    _, trainer, ckpt, _, _ = trained
    cfg = json.loads((ckpt / "config.json").read_text())
    # vLLM's registry: "DSparkDraftModel" is the DeepSeek-V4 class; a Qwen3 backbone is Qwen3DSparkModel
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert "auto_map" not in cfg  # no transformers modeling file claims to serve it
    assert cfg["sample_from_anchor"] is True  # vLLM's DSparkSpeculator: N query slots, each predicting the next
    assert cfg["block_size"] == cfg["num_speculative_tokens"] == B
    assert cfg["markov_rank"] == R and cfg["markov_head_type"] == "vanilla"
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    assert cfg["mask_token_id"] == cfg["dflash_config"]["mask_token_id"] == trainer.mask_token_id
    assert cfg["target_layer_ids"] == cfg["dflash_config"]["target_layer_ids"] == LAYER_IDS
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    loaded = dict(zip(vllm_load_names(shapes), shapes.values(), strict=True))
    assert loaded == vllm_expected_params(cfg)  # every tensor has a parameter of its shape, none is missing
    assert sglang_parse(cfg, cfg["num_target_layers"]) == {
        "gamma": B,
        "markov_rank": R,
        "mask_token_id": trainer.mask_token_id,
        "target_layer_ids": LAYER_IDS,
    }


def test_trainer_logs_the_dspark_terms_and_learns(trained):
    metrics = trained[4]
    assert set(metrics) >= {"dspark_ce", "dspark_l1", "dspark_confidence_bce", "acc_slot_1", "tau_est"}
    assert metrics["acc_slot_1"] > 0.5 and metrics["tau_est"] > 1.5, metrics  # fits its own training data
    assert 0 <= metrics["dspark_l1"] <= 2


def test_speculative_decoding_with_the_markov_walk_is_lossless(trained):
    """dflash-eval's path (evaluation/evaluate.py): the export loads as a DSparkProposer whose drafts are the
    Markov walk over the trained model's block; greedy decoding equals the target's, with drafts accepted."""
    from evaluation.evaluate import load_drafter, load_target
    from evaluation.speculative import greedy_generate, speculative_generate

    target, trainer, ckpt, prompts, _ = trained
    proposer = load_drafter(ckpt, trainer.parts.path)
    assert type(proposer).__name__ == "DSparkProposer" and proposer.block_size == B + 1
    runner = load_target(trainer.parts.path, proposer.layer_ids)
    taus = []
    for prompt in [*prompts, torch.tensor([300, 301, 17])]:  # the last one unseen in training
        spec = speculative_generate(runner, proposer, prompt, 40, EOS)
        plain = greedy_generate(runner, prompt, 40, EOS)
        assert spec.tokens == plain.tokens == plain_greedy(target, prompt, 40)[len(prompt) :]
        assert max(spec.accept_lengths) <= B + 1
        taus.append(spec.mean_accept)
    assert min(taus[:3]) > 1.5, taus
    seq = torch.tensor(plain_greedy(target, prompts[0], 20))
    feats = target_features(target, [seq], LAYER_IDS)
    p = 9
    block = torch.tensor([int(seq[p])] + [trainer.mask_token_id] * (B - 1))
    with torch.no_grad():
        h = trainer.model(feats[:p], torch.arange(p), block, torch.arange(p, p + B), {"full_attention": None})
    assert proposer.propose(feats[:p], seq[: p + 1]).tolist() == trainer.model.walk(h, block[0]).tolist()


@pytest.mark.slow
def test_a_hybrid_target_trains_a_dspark_drafter_whose_walk_decodes_losslessly(tmp_path):
    """Qwen3.5's text decoder (Gated DeltaNet + full attention: dflash-eval restores its recurrent state from a
    copy on a rejected draft, it cannot crop it): the DSpark head trains on its features, exports, and
    speculative decoding with the Markov walk equals the target's own greedy decoding, with drafts accepted."""
    from consumer.checkpoint import save_checkpoint
    from consumer.target_parts import load_target_parts
    from consumer.trainer import Trainer
    from evaluation.evaluate import load_drafter, load_target
    from evaluation.speculative import greedy_generate, speculative_generate
    from tests.target_zoo import EOS_ID, SPECIAL_TOKENS, build_target, layer_outputs, load_model

    path = build_target("qwen3_5_text", tmp_path / "target")
    target = load_model(path)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(30.0)  # wide logit gaps: no near-ties in greedy
    target.save_pretrained(str(path))
    layer_ids = [0, 2]  # of its 4 layers (3 linear + 1 full): not the last, which SGLang serves no DSpark tap of
    prompts = [torch.tensor([len(SPECIAL_TOKENS) + 7 * i, 70 + i, 80, 90 + 3 * i]) for i in range(3)]
    with torch.no_grad():
        seqs = [
            target.generate(p[None], max_new_tokens=30, do_sample=False, eos_token_id=EOS_ID, pad_token_id=0)[0]
            for p in prompts
        ]
    feats = torch.cat([layer_outputs(target, s, layer_ids) for s in seqs])
    ids = torch.cat(seqs)
    mask = torch.cat([(torch.arange(len(s)) >= len(p)).to(torch.uint8) for s, p in zip(seqs, prompts, strict=True)])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    cfg = drafter_cfg(arch="dspark", block_size=B, num_layers=1, anchors_per_seq=24, markov_rank=R, dtype="float32")
    trainer = Trainer(cfg, load_target_parts(path), layer_ids, "cpu")
    for i in range(50):
        assert math.isfinite(trainer.train_batch(feats, ids, mask, cu, seq=i)["loss"])
    ckpt = save_checkpoint(tmp_path / "ckpt", trainer)
    proposer = load_drafter(ckpt, path)
    assert type(proposer).__name__ == "DSparkProposer"
    runner = load_target(path, proposer.layer_ids)
    taus, accepts = [], []
    for prompt in [*prompts, torch.tensor([300, 301, 17]), torch.tensor([9, 250, 31, 77])]:  # the last two unseen
        spec = speculative_generate(runner, proposer, prompt, 30, EOS_ID)
        plain = greedy_generate(runner, prompt, 30, EOS_ID)
        assert spec.tokens == plain.tokens, (prompt, spec.tokens, plain.tokens)
        taus.append(spec.mean_accept)
        accepts += spec.accept_lengths
    assert min(taus[:3]) > 2.0, taus  # trained on these continuations: whole blocks accepted
    assert min(accepts) < B + 1, accepts  # and rejected drafts too: the recurrent state was restored, not cropped


def test_dflash_eval_loads_a_deepspec_layout(trained, tmp_path):
    """DeepSpec's build_draft_config states the DFlash keys at the top level only (no dflash_config) and its
    checkpoint holds its frozen embed_tokens / lm_head copies: dflash-eval loads it and drafts as our export."""
    from safetensors.torch import load_file, save_file

    from evaluation.evaluate import load_drafter

    target, trainer, ckpt, prompts, _ = trained
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("dflash_config")
    d = tmp_path / "deepspec"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(ckpt / "model.safetensors"))
    state |= {"embed_tokens.weight": trainer.parts.embed_tokens, "lm_head.weight": trainer.parts.lm_head}
    save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"))
    ours, theirs = load_drafter(ckpt, trainer.parts.path), load_drafter(d, trainer.parts.path)
    seq = torch.tensor(plain_greedy(target, prompts[1], 20))
    feats = target_features(target, [seq], LAYER_IDS)
    assert theirs.layer_ids == LAYER_IDS and theirs.mask_token_id == ours.mask_token_id
    for p in (6, 11):
        assert theirs.propose(feats[:p], seq[: p + 1]).tolist() == ours.propose(feats[:p], seq[: p + 1]).tolist()


def test_warm_start_from_a_dflash1_drafter_copies_the_backbone_and_starts_the_heads(tmp_path, caplog):
    from consumer.checkpoint import save_checkpoint
    from consumer.target_parts import load_target_parts
    from consumer.trainer import Trainer
    from consumer.warm_start import warm_start

    path = tmp_path / "target"
    tiny_target(path)
    parts = load_target_parts(path)
    dflash1 = Trainer(drafter_cfg(block_size=8, num_layers=1, seed=1, dtype="float32"), parts, LAYER_IDS, "cpu")
    src = save_checkpoint(tmp_path / "src", dflash1)
    cfg = drafter_cfg(arch="dspark", block_size=B, num_layers=1, markov_rank=R, seed=2, dtype="float32")
    fresh = Trainer(cfg, parts, LAYER_IDS, "cpu")
    heads = {k: v.clone() for k, v in fresh.model.state_dict().items() if k in DSparkDrafter.HEAD_PARAMS}
    with caplog.at_level(logging.INFO, logger="consumer.warm_start"):
        warm_start(fresh, src)  # another block size: DSpark's slots mean another thing, the weights fit
    mine = fresh.model.state_dict()
    for name, tensor in dflash1.model.state_dict().items():
        assert torch.equal(mine[name], tensor), name
    for name, tensor in heads.items():
        assert torch.equal(mine[name], tensor), name  # the new heads keep their initialisation
    line = next(r.getMessage() for r in caplog.records if "starts from" in r.getMessage())
    assert f"{len(dflash1.model.state_dict())} tensors copied, 4 new" in line
    assert all(name in line for name in DSparkDrafter.HEAD_PARAMS), line


def test_a_dspark_tap_of_the_last_target_layer_is_named_at_start(tmp_path, caplog):
    """SGLang's DSpark worker refuses a tap of the target's last layer; training still runs (the demo taps it, and
    the heads' A/B shares the features), with one warning naming it."""
    from consumer.target_parts import load_target_parts
    from consumer.trainer import Trainer

    tiny_target(tmp_path / "target")
    parts = load_target_parts(tmp_path / "target")
    cfg = drafter_cfg(arch="dspark", block_size=B, markov_rank=R, dtype="float32")
    with caplog.at_level(logging.WARNING, logger="consumer.trainer"):
        Trainer(cfg, parts, [1, 2, 4], "cpu")
        assert not [r for r in caplog.records if "last layer" in r.getMessage()]
        tapped = Trainer(cfg, parts, [1, 3, 5], "cpu")
    assert tapped.dspark_target_block == 2  # its loss reads the target's distribution from that block
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (40,), generator=g)
    m = tapped.train_batch(
        torch.randn(40, 3 * 64, generator=g), ids, torch.ones(40, dtype=torch.uint8), torch.tensor([0, 40]), 0
    )
    assert math.isfinite(m["loss"]) and 0 < m["dspark_l1"] < 2  # against a distribution, not a one-hot
    (line,) = [r.getMessage() for r in caplog.records if "last layer" in r.getMessage()]
    assert "tap the target's last layer 5, which SGLang does not serve" in line


def test_a_validation_pass_reads_dsparks_own_loss_and_slots(trained):
    """consumer/validation.py on a DSpark drafter: the held-out loss is dspark_loss's, and tau_est counts the slots
    from the anchor's, as training's metrics do."""
    from consumer.validation import Evaluator

    target, trainer, _, prompts, _ = trained
    seqs = [torch.tensor(plain_greedy(target, p, 40)) for p in prompts]
    ids = torch.cat(seqs)
    mask = torch.cat([(torch.arange(len(s)) >= 4).to(torch.uint8) for s in seqs])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    result = Evaluator(trainer).add(target_features(target, seqs, LAYER_IDS), ids, mask, cu, [0, 1, 2], (0, 0, 1))
    m = result.metrics
    assert set(m) == {"loss", "tau_est", *(f"acc_slot_{k}" for k in range(1, B + 1))}
    assert m["tau_est"] > 1.5 and 0 < m["loss"] < 10, m  # it fits these continuations (the training data)


@pytest.mark.slow
def test_dspark_under_fsdp_equals_the_unsharded_replicas(tmp_path):
    """Two gloo ranks (tests/procs/fsdp_dflash2_worker.py with arch dspark): FSDP2 shards the decoder layers and
    keeps the Markov and confidence heads in the root unit, which FSDP2 keeps gathered from forward to backward,
    so the loss reads them after the forward; the steps equal the unsharded replicas' (a stand-in pass included)."""
    from tests.consumer.test_drafter_common import distinct_seqs, packed
    from tests.consumer.test_scaleout_fsdp import assert_same_steps
    from tests.jobs import run_ranks

    model = tiny_target(tmp_path / "target")
    batches = []
    for i in range(4):
        seqs = distinct_seqs([24 + i, 30 - i], seed=i)
        batches.append((target_features(model, seqs), *packed(seqs)))  # the worker's taps: [1, 3, 5]
    torch.save(batches, tmp_path / "batches.pt")
    worker = "tests.procs.fsdp_dflash2_worker"
    run_ranks(
        lambda rank, port: [
            "-m",
            worker,
            tmp_path / "target",
            tmp_path / "batches.pt",
            tmp_path,
            rank,
            2,
            port,
            "dspark",
        ]
    )
    r = torch.load(tmp_path / "result.pt", weights_only=True)
    assert len(r["fsdp"]) == len(r["replicas"]) == 3
    assert_same_steps(r["fsdp"], r["replicas"])
    first, last = (r["fsdp"][i]["params"]["markov_head.markov_w2.weight"] for i in (0, -1))
    assert (last - first).abs().max() > 1e-4  # the Markov head trained under FSDP
    assert r["fsdp"][-1]["loss"] == pytest.approx(r["replicas"][-1]["loss"], rel=1e-4)
