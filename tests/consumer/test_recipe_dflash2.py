"""DFlash2 (issue 20 item 2): the convolution (literal values, block-local, identity at init), the selector
loss (an independent loop computation, the skip rule), the packed dense/flex paths, the warm start from a
DFlash1 state dict (logits equal exactly), and FSDP (two gloo ranks) equal to the unsharded replicas."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common.config import DrafterConfig
from consumer.dflash2 import (
    DFlash2Drafter,
    DFlash2Shape,
    GroupedDynamicCausalConv,
    grouped_causal_conv,
    make_drafter,
    selector_loss,
)
from consumer.model import DFlashDrafter, DrafterArch
from consumer.objective import build_draft_batch, dense_mask, flex_mask
from tests.consumer.test_drafter_common import (
    LAYER_IDS,
    distinct_seqs,
    drafter_cfg,
    packed,
    target_features,
    tiny_target,
)

ROOT = Path(__file__).resolve().parents[2]
B = 4
ARCH = DrafterArch(
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    num_layers=2,
    num_features=3,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
)
SHAPE = DFlash2Shape(block_size=B, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
V = 512


def frozen(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, 64, generator=g) * 0.5, torch.randn(V, 64, generator=g) * 0.5


def packed_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [30, 22]
    ids = torch.randint(0, 500, (sum(lengths),), generator=g)
    batch = build_draft_batch(
        ids,
        torch.ones(sum(lengths), dtype=torch.uint8),
        torch.tensor([0, 30, 52]),
        anchors_per_seq=5,
        block_size=B,
        mask_token_id=511,
        gamma=4.0,
        generator=torch.Generator().manual_seed(seed),
    )
    return batch, torch.randn(sum(lengths), 3 * 64, generator=g)


def randomise_new_parts(model: DFlash2Drafter, seed: int = 1) -> None:
    """Non-identity convolutions and a non-zero successor codebook (the init makes both trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_conv." in name or "successor" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


# ------------------------------------------------------------------------------------------ convolution
def test_convolution_literal_values_block_local():
    """K = 2 taps, H = 4 in 2 groups of 2, blocks of 3 rows: out[i,c] = Σ_t (base[t,c] + δ[i,t,g(c)])·x[i-t,c]
    with the tap t = 1 zero on each block's first row (rows 0 and 3), computed here by hand."""
    x = torch.arange(1.0, 25.0).view(6, 4)  # rows 0..5, x[i, c] = 4i + c + 1
    base = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, -1.0, -1.0]])  # [K, H]
    delta = torch.zeros(6, 2, 2)  # [Q, K, G]
    delta[4, 1, 1] = 10.0  # row 4's second tap on group 1 (channels 2, 3)
    out = grouped_causal_conv(x, delta, base, block_size=3, group_size=2)
    want = torch.tensor(
        [
            [1.0, 4.0, 9.0, 16.0],  # row 0: a block start, x·base[0] only
            [5 + 0.5 * 1, 12 + 0.5 * 2, 21 - 3, 32 - 4],  # row 1: + base[1]·x[0]
            [9 + 0.5 * 5, 20 + 0.5 * 6, 33 - 7, 48 - 8],
            [13.0, 28.0, 45.0, 64.0],  # row 3: a block start: row 2 does not leak in
            [17 + 0.5 * 13, 36 + 0.5 * 14, 57 + 9 * 15, 80 + 9 * 16],  # (−1 + 10)·x[3] on group 1
            [21 + 0.5 * 17, 44 + 0.5 * 18, 69 - 19, 96 - 20],
        ]
    )
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_convolution_is_identity_at_init_and_each_block_convolves_alone():
    conv = GroupedDynamicCausalConv(64, SHAPE)
    assert tuple(conv.base_kernel.shape) == (2, 2, 64)
    assert tuple(conv.kernel_projection.weight.shape) == (2 * 2 * 64 // 16, 64)  # H -> 2·K·H/gs, no bias
    assert conv.kernel_projection.bias is None
    x = torch.randn(3 * B, 64)
    u, delta = conv.prepare(x)
    assert torch.equal(u, x) and torch.equal(conv.finish(x * 2, delta), x * 2)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    u, delta = conv.prepare(x)
    assert not torch.allclose(u, x)
    for a in range(3):  # the packed rows of block a equal that block convolved on its own (as served)
        ua, da = conv.prepare(x[a * B : (a + 1) * B])
        torch.testing.assert_close(u[a * B : (a + 1) * B], ua)
        torch.testing.assert_close(conv.finish(x[a * B : (a + 1) * B], da), conv.finish(x, delta)[a * B : (a + 1) * B])


def test_group_size_must_divide_hidden_size():
    with pytest.raises(ValueError, match=r"drafters.conv_group_size = 24 must divide the target's hidden_size 64"):
        GroupedDynamicCausalConv(64, DFlash2Shape(block_size=4, conv_group_size=24))


def test_more_taps_than_a_block_is_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"conv_kernel_size = 5 is more taps than block_size = 4"):
        drafter_cfg(arch="dflash2", block_size=4, conv_kernel_size=5)
    assert drafter_cfg(arch="dflash2", block_size=4, conv_kernel_size=4).conv_kernel_size == 4


def test_group_size_is_checked_against_the_target_at_job_load(tmp_path):
    import json

    from common.config import ConfigError, load_job

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 64}}))
    job = tmp_path / "job.toml"
    body = (
        f'[target]\npath = "{tmp_path / "target"}"\n[data]\npath = "t.jsonl"\n[[drafters]]\nname = "a"\n'
        '[[drafters]]\nname = "b"\narch = "dflash2"\n'
    )
    job.write_text(body + "conv_group_size = 32\n")
    assert load_job(job).drafters[1].arch == "dflash2"
    job.write_text(body + "conv_group_size = 24\n")
    with pytest.raises(
        ConfigError,
        match=r"job.toml: drafters.1.conv_group_size: 24 does not divide the target's"
        r" hidden_size 64",
    ):
        load_job(job)


# ------------------------------------------------------------------------------------------ model
def test_dflash2_parameter_names_are_the_export_names():
    model = DFlash2Drafter(ARCH, SHAPE, *frozen())
    names = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert names["candidate_selector.predecessor_codebook"] == (V, 8)  # no ".weight" (recipes.md §5)
    assert names["candidate_selector.successor_codebook"] == (V, 8)
    assert names["candidate_selector.hidden_projection.weight"] == (8, 64)
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            assert names[f"layers.{i}.{conv}.base_kernel"] == (2, 2, 64)
            assert names[f"layers.{i}.{conv}.kernel_projection.weight"] == (16, 64)
    dflash1 = DFlashDrafter(ARCH, *frozen()).state_dict()
    assert set(names) - set(dflash1) == set(DFlash2Drafter.identity_init_params(2))
    assert set(dflash1) <= set(names)
    assert isinstance(make_drafter(drafter_cfg(arch="dflash2"), ARCH, *frozen(), 0), DFlash2Drafter)
    assert type(make_drafter(drafter_cfg(), ARCH, *frozen(), 0)) is DFlashDrafter  # dflash1 stays the default
    assert DrafterConfig(name="d").arch == "dflash1"


def test_warm_start_from_dflash1_gives_its_logits_exactly():
    """Item 4: a DFlash1 state dict loaded into a DFlash2 drafter of the same shape (other seed), the new parts
    identity-initialised: the packed-batch unary logits are bit-equal; a non-identity convolution changes them."""
    batch, feats = packed_batch()
    src = DFlashDrafter(ARCH, *frozen(), init_seed=3)
    dst = DFlash2Drafter(ARCH, SHAPE, *frozen(), init_seed=9)
    randomise_new_parts(dst)  # the loader must reset them, not rely on a fresh init
    dst.load_dflash1_state(src.state_dict(), source="ckpt/step_5")
    args = (feats, batch.ctx_pos, batch.block_ids, batch.block_pos, dense_mask(batch))
    with torch.no_grad():
        want, got = src.logits(src(*args)), dst.logits(dst(*args))
        assert torch.equal(got, want)
        with torch.no_grad():
            dst.layers[1].mlp_conv.base_kernel[1, 1] += 0.5
        assert not torch.allclose(dst.logits(dst(*args)), want)
    with pytest.raises(
        ValueError,
        match=r"ckpt/step_5 is not a DFlash1 drafter of this shape: unexpected"
        r" \['bogus'\], missing \['fc.weight'\]",
    ):
        state = {k: v for k, v in src.state_dict().items() if k != "fc.weight"}
        dst.load_dflash1_state({**state, "bogus": torch.zeros(1)}, source="ckpt/step_5")
    with pytest.raises(ValueError, match=r"holds DFlash2 tensors .*: it is not a DFlash1 state"):
        dst.load_dflash1_state(dst.state_dict())
    small = DFlashDrafter(DrafterArch(**{**ARCH.__dict__, "num_features": 2}), *frozen())
    with pytest.raises(ValueError, match=r"fc.weight \(64, 128\) \(this drafter \(64, 192\)\)"):
        dst.load_dflash1_state(small.state_dict())


def test_packed_dense_and_flex_paths_agree_and_equal_drafting():
    """Training rows of an anchor (dense SDPA and eager flex BlockMask) equal draft() of that block alone."""
    batch, feats = packed_batch(1)
    model = DFlash2Drafter(ARCH, SHAPE, *frozen())
    randomise_new_parts(model)
    args = (feats, batch.ctx_pos, batch.block_ids, batch.block_pos)
    with torch.no_grad():
        dense = model(*args, dense_mask(batch))
        flex = model(*args, flex_mask(batch, block=16))
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)
    logits = model.logits(dense).view(-1, B, V)
    cu = [0, 30, 52]
    for a in range(batch.num_anchors):
        p, start = int(batch.anchor_tok[a]), cu[int(batch.anchor_seq[a])]
        drafted = model.draft(feats[start:p], batch.block_ids.view(-1, B)[a])
        torch.testing.assert_close(drafted, logits[a], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------ selector loss
def loop_selector_loss(model: DFlash2Drafter, h: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """The selector loss slot by slot, from the definitions (recipes.md §2.2-2.3, the variant of design.md)."""
    sel, k = model.candidate_selector, SHAPE.selector_top_k
    A, Bc, P = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    total, valid, found, right = 0.0, 0, 0, 0
    for i in range(h.shape[0]):
        if weights[i] == 0:
            continue
        valid += 1
        logits = model.lm_head @ h[i]
        cand = logits.topk(k).indices.tolist()
        gold = int(labels[i])
        if gold not in cand:  # skip: no selector CE
            continue
        found += 1
        prev = int(labels[i - 1])  # the previous slot's gold token (slot 1: the anchor)
        scores = torch.stack([logits[b] + (A[prev] * (P @ h[i])) @ Bc[b] for b in cand])
        total += float(weights[i]) * float(torch.logsumexp(scores, 0) - scores[cand.index(gold)])
        right += int(int(scores.argmax()) == cand.index(gold))
    return total, [valid, found, right]


def test_selector_loss_equals_the_slot_by_slot_definition_and_skips_gold_outside_top_k():
    batch, feats = packed_batch(2)
    model = DFlash2Drafter(ARCH, SHAPE, *frozen())
    randomise_new_parts(model)
    with torch.no_grad():
        h = model(feats, batch.ctx_pos, batch.block_ids, batch.block_pos, dense_mask(batch))
        # labels of every third supervised slot set to their unary argmax, so some slots hit the top-k
        labels = batch.labels.clone()
        top = model.logits(h).argmax(-1)
        labels[::3] = top[::3]
        total, stats = selector_loss(model, h, labels, batch.weights, chunk_rows=7)  # chunks across blocks
        want, counts = loop_selector_loss(model, h, labels, batch.weights)
    assert stats.tolist() == counts and 0 < counts[1] < counts[0]  # some golds outside the top-k: skipped
    assert float(total) == pytest.approx(want, rel=1e-5)
    # the trainer's path: the candidates come out of the unary loss's own logits pass
    from consumer.loss import chunked_lm_head_loss

    cand = torch.full((h.shape[0], 4), -1, dtype=torch.int64)
    chunked_lm_head_loss(h, model.lm_head, labels, batch.weights, 5, top_k_out=cand)
    assert torch.equal(cand, model.logits(h).topk(4, dim=-1).indices)
    with torch.no_grad():
        via_loss = selector_loss(model, h, labels, batch.weights, 7, cand)
    assert torch.equal(via_loss[0], total) and torch.equal(via_loss[1], stats)
    # the predecessor is the previous slot's gold: another predecessor changes the loss
    with torch.no_grad():
        shifted = selector_loss(model, h, torch.cat([labels[1:], labels[:1]]), batch.weights.roll(-1), 64)[0]
    assert not math.isclose(float(shifted), want, rel_tol=1e-3)


def test_selector_loss_trains_the_codebooks_and_the_backbone():
    batch, feats = packed_batch(3)
    model = DFlash2Drafter(ARCH, SHAPE, *frozen())
    h = model(feats, batch.ctx_pos, batch.block_ids, batch.block_pos, dense_mask(batch))
    labels = model.logits(h).argmax(-1).detach()  # every gold in the top-k
    total, _ = selector_loss(model, h, labels, batch.weights, 64)
    total.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["candidate_selector.successor_codebook"].abs().sum() > 0  # zero-initialised, trained
    assert grads["candidate_selector.hidden_projection.weight"] is not None
    assert grads["fc.weight"].abs().sum() > 0  # no stop-gradient: U and h carry it into the backbone


def test_trainer_logs_the_selector_metrics_and_learns(tmp_path):
    """The trainer's step for arch = "dflash2": L = L_unary + α·L_sel through the one normaliser; selector recall
    and teacher-forced accuracy are logged and rise on a memorisable batch."""
    from consumer.target_parts import load_target_parts
    from consumer.trainer import Trainer

    target = tiny_target(tmp_path / "t")
    seqs = distinct_seqs([24, 30])
    feats, (ids, mask, cu) = target_features(target, seqs), packed(seqs)
    cfg = drafter_cfg(arch="dflash2", num_layers=1, selector_rank=8, selector_top_k=4)
    trainer = Trainer(cfg, load_target_parts(tmp_path / "t"), LAYER_IDS, "cpu")
    logs = [trainer.train_batch(feats, ids, mask, cu, seq=i) for i in range(25)]
    first, last = logs[0], logs[-1]
    assert {"selector_recall", "selector_acc"} <= set(first)
    assert 0.0 <= first["selector_acc"] <= first["selector_recall"] <= 1.0
    assert (
        last["selector_recall"] > first["selector_recall"] + 0.3 and last["selector_acc"] > first["selector_acc"] + 0.3
    )
    assert last["loss"] < first["loss"]


# ------------------------------------------------------------------------------------------ FSDP
@pytest.mark.slow
def test_dflash2_under_fsdp_equals_the_unsharded_replicas(tmp_path):
    """Two gloo ranks: DFlash2 (convolutions in every layer unit, the selector its own unit) sharded by FSDP2
    takes the same steps as the unsharded replica path (tests/procs/fsdp_dflash2_worker.py)."""
    from tests.consumer.test_scaleout_fsdp import assert_same_steps
    from tests.jobs import run_ranks

    model = tiny_target(tmp_path / "target")
    batches = []
    for i in range(4):
        seqs = distinct_seqs([24 + i, 30 - i], seed=i)
        batches.append((target_features(model, seqs), *packed(seqs)))
    torch.save(batches, tmp_path / "batches.pt")
    run_ranks(
        lambda rank, port: [
            "-m",
            "tests.procs.fsdp_dflash2_worker",
            tmp_path / "target",
            tmp_path / "batches.pt",
            tmp_path,
            rank,
            2,
            port,
        ]
    )
    r = torch.load(tmp_path / "result.pt", weights_only=True)
    assert len(r["fsdp"]) == len(r["replicas"]) == 3
    assert_same_steps(r["fsdp"], r["replicas"])
    assert any("candidate_selector" in n for n in r["fsdp"][0]["params"])
    moved = r["fsdp"][-1]["params"]["candidate_selector.successor_codebook"].abs().max()
    assert moved > 1e-3  # zero at init: the selector trained under FSDP
    assert r["fsdp"][-1]["selector_recall"] == pytest.approx(r["replicas"][-1]["selector_recall"])


# ------------------------------------------------------------------------------------------ export and serving
EOS = 3


@torch.no_grad()
def plain_greedy(target, prompt: torch.Tensor, max_new_tokens: int, eos: int = EOS) -> list[int]:
    out = target.generate(
        prompt[None], max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    return out[0].tolist()


def load_export(path):
    import transformers

    return transformers.AutoModel.from_pretrained(
        str(path), trust_remote_code=True, local_files_only=True, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One DFlash2 drafter (the qwen3 tiny target) trained on the target's greedy continuations, checkpointed
    through save_checkpoint and reloaded as a user does; shared by the export tests."""
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
    cfg = drafter_cfg(
        arch="dflash2",
        block_size=B,
        num_layers=1,
        anchors_per_seq=24,
        selector_rank=8,
        selector_top_k=4,
        dtype="float32",
    )
    trainer = Trainer(cfg, load_target_parts(path), LAYER_IDS, "cpu")
    feats = target_features(target, seqs)
    for i in range(50):
        trainer.train_batch(feats, ids, mask, cu, seq=i)
    ckpt = save_checkpoint(tmp_path_factory.mktemp("ckpt"), trainer)
    return target, trainer, ckpt, load_export(ckpt), prompts


def test_export_is_the_layout_sglang_and_vllm_load(trained):
    import json

    from safetensors import safe_open

    _, trainer, ckpt, draft, _ = trained
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert cfg["auto_map"] == {"AutoModel": "dflash2.DFlash2DraftModel"}
    assert cfg["dflash_config"] == {
        "mask_token_id": trainer.mask_token_id,
        "mask_token": "<|MASK|>",
        "target_layer_ids": LAYER_IDS,
        "block_size": B,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 4,
    }
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert shapes["candidate_selector.predecessor_codebook"] == (V, 8)
    assert shapes["candidate_selector.successor_codebook"] == (V, 8)
    assert shapes["candidate_selector.hidden_projection.weight"] == (8, 64)
    assert shapes["layers.0.attention_conv.base_kernel"] == (2, 2, 64)
    assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == (16, 64)
    assert not any(k.endswith("codebook.weight") for k in shapes) and "lm_head.weight" not in shapes
    manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"dflash.py", "dflash2.py"} <= set(manifest)
    assert type(draft).__name__ == "DFlash2DraftModel"
    loaded = draft.state_dict()
    for name, want in trainer.model.state_dict().items():  # every trained tensor reached the served model
        assert torch.equal(loaded[name], want), name
    assert trainer.model.candidate_selector.successor_codebook.abs().max() > 1e-2  # the selector trained


def test_spec_generate_equals_the_target_greedy_output(trained):
    target, _, draft, prompts = trained[0], trained[1], trained[3], trained[4]
    taus = []
    for prompt in [*prompts, torch.tensor([300, 301, 17])]:  # the last one unseen in training
        out = draft.spec_generate(
            input_ids=prompt[None], max_new_tokens=40, temperature=0.0, target=target, stop_token_ids=[EOS]
        )
        assert out[0].tolist() == plain_greedy(target, prompt, 40)
        taus.append(sum(draft.acceptance_lengths) / len(draft.acceptance_lengths))
    assert min(taus[:3]) > 1.5, taus  # trained on these continuations: drafts are accepted
    steps = list(draft.acceptance_lengths)
    cold = draft.spec_generate(
        input_ids=prompt[None], max_new_tokens=40, temperature=1e-6, target=target, stop_token_ids=[EOS]
    )  # the sampling path with the restricted q
    assert cold[0].tolist() == plain_greedy(target, prompt, 40) and draft.acceptance_lengths == steps


def test_served_walk_equals_the_trained_selector_and_q_lives_on_the_candidates(trained):
    """The export's walk from the anchor over S(p -> b) equals one computed with the training model's
    CandidateSelector; at T > 0 the q of the verify is softmax(S / T) on the candidates, 0 elsewhere."""
    target, trainer, _, draft, prompts = trained
    model, head = trainer.model, target.get_output_embeddings().weight
    seq = torch.tensor(plain_greedy(target, prompts[1], 20))
    feats = target_features(target, [seq])
    for p in (6, 11, 15):
        block = torch.tensor([int(seq[p])] + [trainer.mask_token_id] * (B - 1))
        with torch.no_grad():
            h = model(feats[:p], torch.arange(p), block, torch.arange(p, p + B), {"full_attention": None})[1:]
            cand = model.logits(h).topk(4, dim=-1).indices
            want, prev = [], block[:1]
            for t in range(B - 1):
                unary = model.logits(h[t : t + 1]).gather(1, cand[t : t + 1])
                scores = model.candidate_selector(h[t : t + 1], unary, cand[t : t + 1], prev)
                prev = cand[t, scores.argmax(-1)]
                want.append(int(prev))
            drafts, q = draft.propose(h, int(seq[p]), head, 0.0)
        assert drafts.tolist() == want and q is None
        torch.manual_seed(p)
        drafts, q = draft.propose(h, int(seq[p]), head, 1.0)
        torch.testing.assert_close(q.sum(-1), torch.ones(B - 1))
        support = q > 0
        assert support.sum(-1).tolist() == [4] * (B - 1)
        assert all(set(torch.nonzero(support[t])[:, 0].tolist()) == set(cand[t].tolist()) for t in range(B - 1))
        assert all(int(drafts[t]) in cand[t].tolist() for t in range(B - 1))


def test_dflash_eval_loads_the_export_and_decodes_with_the_same_walk(trained):
    """evaluation/evaluate.py (dflash-eval) on the DFlash2 export: every step proposes what the shipped modeling
    file proposes, decoding equals the target's greedy output with the same acceptance lengths; temperature > 0
    is refused with the reason (the selector's q is served by spec_generate)."""
    from evaluation.evaluate import load_drafter, load_target
    from evaluation.speculative import speculative_generate

    target, trainer, ckpt, draft, prompts = trained
    proposer = load_drafter(ckpt, trainer.parts.path)
    assert type(proposer).__name__ == "DFlash2Proposer" and proposer.block_size == B
    runner = load_target(trainer.parts.path, proposer.layer_ids)
    for prompt in prompts[:2]:
        gen = speculative_generate(runner, proposer, prompt, 40, EOS)
        out = draft.spec_generate(
            input_ids=prompt[None], max_new_tokens=40, temperature=0.0, target=target, stop_token_ids=[EOS]
        )
        assert [*prompt.tolist(), *gen.tokens] == out[0].tolist() == plain_greedy(target, prompt, 40)
        assert gen.accept_lengths == draft.acceptance_lengths
    with pytest.raises(ValueError, match="needs a drafter with draft_logits"):
        speculative_generate(runner, proposer, prompts[0], 8, EOS, temperature=0.7)


@pytest.mark.slow
def test_hybrid_target_trains_exports_and_serves_greedy_exactly(tmp_path):
    """Qwen3.5's text decoder (Gated DeltaNet + full attention: a cache restored from a copy, not cropped)."""
    from common.config import dflash_layer_ids
    from consumer.checkpoint import save_checkpoint
    from consumer.target_parts import load_target_parts
    from consumer.trainer import Trainer
    from tests.target_zoo import EOS_ID, SPECIAL_TOKENS, build_target, layer_outputs, load_model

    path = build_target("qwen3_5_text", tmp_path / "target")
    target = load_model(path)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(30.0)  # as the matrix does: no near-ties in greedy
    target.save_pretrained(str(path))
    layer_ids = dflash_layer_ids(target.config.get_text_config().num_hidden_layers, 2)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(len(SPECIAL_TOKENS), 260, (n,), generator=g) for n in (20, 13)]
    feats = torch.cat([layer_outputs(target, s, layer_ids) for s in seqs])
    ids, mask = torch.cat(seqs), torch.cat([(torch.arange(len(s)) >= 3).to(torch.uint8) for s in seqs])
    cfg = drafter_cfg(arch="dflash2", block_size=4, num_layers=1, selector_rank=8, selector_top_k=4)
    trainer = Trainer(cfg, load_target_parts(path), layer_ids, "cpu")
    for i in range(4):
        assert math.isfinite(trainer.train_batch(feats, ids, mask, torch.tensor([0, 20, 33]), seq=i)["loss"])
    draft = load_export(save_checkpoint(tmp_path / "ckpt", trainer))
    assert type(draft).__name__ == "DFlash2DraftModel"
    for prompt in (seqs[0][:5], torch.tensor([1, 70, 80, 90, 2, 1])):
        out = draft.spec_generate(
            input_ids=prompt[None], max_new_tokens=12, temperature=0.0, target=target, stop_token_ids=[EOS_ID]
        )
        assert out[0].tolist() == plain_greedy(target, prompt, 12, EOS_ID)


def test_memory_plan_counts_the_dflash2_parameters():
    """consumer/memory_plan.py builds the job's drafter: DFlash2 adds 2 layers × 2 convolutions × (2·2·64 base +
    16·64 projection) and the selector's 2·512·8 codebook + 8·64 projection parameters, all with Adam state."""
    from consumer.memory_plan import step_peak

    plans = {
        a: step_peak(
            ARCH,
            drafter_cfg(arch=a, block_size=B, selector_rank=8, selector_top_k=4),
            V,
            False,
            64,
            32,
            "float32",
            False,
        )
        for a in ("dflash1", "dflash2")
    }
    assert (
        plans["dflash2"]["params"] - plans["dflash1"]["params"] == 2 * 2 * (2 * 2 * 64 + 16 * 64) + 2 * 512 * 8 + 8 * 64
    )
    assert plans["dflash2"]["peak"] > plans["dflash1"]["peak"]
