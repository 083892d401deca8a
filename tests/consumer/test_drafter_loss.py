"""The fused weighted-CE kernel (Triton under TRITON_INTERPRET=1, and its torch fallback), the chunked
lm_head loss against the full-logits one, and the logged metrics."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from consumer.kernels import weighted_ce
from consumer.loss import DraftMetrics, chunked_lm_head_loss, full_logits_loss


def reference(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    x = logits.float().clone().requires_grad_()
    ce = F.cross_entropy(x, labels, reduction="none")
    (ce * weights).sum().backward()
    return ce.detach(), x.amax(-1).detach(), x.grad


def case(R: int = 37, V: int = 700, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R, V, generator=g) * 3).to(dtype)
    labels = torch.randint(0, V, (R,), generator=g)
    weights = torch.rand(R, generator=g)
    weights[[1, 3]] = 0.0  # rows without loss
    return logits, labels, weights


@pytest.fixture(params=["triton", "torch"])
def kernel_path(request, monkeypatch):
    if request.param == "triton":
        if weighted_ce.triton is None or not weighted_ce.INTERPRET:
            pytest.skip(
                "Triton interpreter off: CUDA present (tests/consumer/test_drafter_cuda.py runs the compiled kernel)"
            )
    else:
        monkeypatch.setattr(weighted_ce, "_use_triton", lambda x: False)
    return request.param


@pytest.mark.parametrize("R,V", [(37, 700), (5, 2048), (64, 96)])
def test_kernel_forward_and_backward_match_torch(kernel_path, R, V):
    """V not a multiple of the tile, several tiles, rows past the last program; float32: 1e-5."""
    logits, labels, weights = case(R, V)
    ce, mx, grad = reference(logits, labels, weights)
    buf = logits.clone()
    lse, tgt, got_max = weighted_ce.weighted_ce_(buf, labels, weights)
    torch.testing.assert_close(lse - tgt, ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tgt, logits[torch.arange(R), labels])
    torch.testing.assert_close(got_max, mx)
    torch.testing.assert_close(buf, grad, rtol=1e-5, atol=1e-6)  # the gradient, in place
    assert (buf[1] == 0).all() and (buf[3] == 0).all()


def test_kernel_in_bfloat16(kernel_path):
    logits, labels, weights = case(dtype=torch.bfloat16)
    ce, _, grad = reference(logits, labels, weights)  # the reference upcasts the same bf16 values
    buf = logits.clone()
    lse, tgt, _ = weighted_ce.weighted_ce_(buf, labels, weights)
    torch.testing.assert_close(lse - tgt, ce, rtol=1e-5, atol=1e-5)  # float32 arithmetic inside
    torch.testing.assert_close(buf.float(), grad, rtol=1e-2, atol=1e-2)  # gradient stored in bf16


def test_kernel_without_grad_leaves_logits(kernel_path):
    logits, labels, weights = case()
    buf = logits.clone()
    lse, _, _ = weighted_ce.weighted_ce_(buf, labels, weights, need_grad=False)
    assert torch.equal(buf, logits)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))


def test_zero_weight_rows_get_exact_zero_gradient_even_when_not_finite(kernel_path):
    logits, labels, weights = case()
    logits[3, 5] = float("nan")
    weighted_ce.weighted_ce_(logits, labels, weights)
    assert (logits[3] == 0).all() and torch.isfinite(logits).all()


@pytest.mark.parametrize("chunk", [7, 16, 1000])
def test_chunked_loss_equals_full_logits_loss(chunk):
    """Σ w·CE and d/d hidden agree with the unchunked loss to float32 rounding (rtol 1e-5, atol 1e-6)."""
    torch.manual_seed(0)
    Q, H, V = 50, 16, 300
    hidden = torch.randn(Q, H, requires_grad=True)
    lm_head = torch.randn(V, H)
    labels = torch.randint(0, V, (Q,))
    weights = torch.rand(Q) * (torch.rand(Q) > 0.3)
    loss, correct = chunked_lm_head_loss(hidden, lm_head, labels, weights, chunk)
    (loss * 0.5).backward()  # the stored gradient is scaled by the incoming one
    grad = hidden.grad.clone()
    hidden.grad = None
    ref_loss, ref_correct = full_logits_loss(hidden, lm_head, labels, weights)
    (ref_loss * 0.5).backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, hidden.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(correct, ref_correct)
    assert torch.equal(correct, (hidden @ lm_head.T).argmax(-1) == labels)


def test_chunked_loss_refuses_a_trainable_lm_head():
    with pytest.raises(ValueError, match="frozen"):
        chunked_lm_head_loss(
            torch.randn(4, 8),
            torch.randn(16, 8, requires_grad=True),
            torch.zeros(4, dtype=torch.long),
            torch.ones(4),
            16,
        )


def test_metrics_per_slot_accuracy_and_tau():
    B = 4
    m = DraftMetrics(B, torch.device("cpu"))
    # 3 anchors; slot 0 never has a label. anchor 0: slots 1,2 right, 3 wrong -> 2 leading;
    # anchor 1: slot 1 right, slot 2 has no label (loss_mask 0) -> 1 leading; anchor 2: slot 1 wrong -> 0
    correct = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 1, 1]], dtype=torch.bool).view(-1)
    weights = torch.tensor([[0, 1.0, 0.8, 0.6], [0, 1.0, 0.0, 0.6], [0, 1.0, 0.0, 0.0]]).view(-1)
    m.add(torch.tensor(3.0), correct, weights)
    out = m.read()
    assert out["loss"] == pytest.approx(3.0 / 5.0)
    assert out["acc_slot_1"] == pytest.approx(2 / 3)
    assert out["acc_slot_2"] == 1.0  # one labelled slot-2 prediction, right
    assert out["acc_slot_3"] == 0.5
    assert out["tau_est"] == pytest.approx(1 + (2 + 1 + 0) / 3)
    empty = m.read()  # the window was reset
    assert math.isnan(empty["loss"]) and math.isnan(empty["tau_est"])


def test_rows_without_loss_cannot_poison_the_loss():
    """A padding row whose hidden state is not finite adds nothing (value or gradient)."""
    torch.manual_seed(0)
    hidden = torch.randn(6, 8)
    hidden[2] = float("nan")
    hidden.requires_grad_()
    weights = torch.tensor([1.0, 0.5, 0.0, 1.0, 0.0, 0.3])
    loss, _ = chunked_lm_head_loss(hidden, torch.randn(32, 8), torch.randint(0, 32, (6,)), weights, 4)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(hidden.grad).all() and (hidden.grad[2] == 0).all()


def test_an_optimizer_step_normalises_by_the_weight_sum_of_all_its_batches(tmp_path):
    """Two micro-batches with very different Σw accumulate into one optimizer step: the gradient the
    optimizer sees must be ∇(Σ_batches Σ w·CE / Σ_batches Σ w), computed here independently (the
    full-logits loss on a copy of the model, the same anchors). Dropping the 1/Σw, dividing by the token
    count, or normalising each batch by its own Σw all give a different gradient."""
    from consumer.objective import attention_masks, build_draft_batch
    from consumer.target_parts import load_target_parts
    from consumer.trainer import Trainer
    from tests.consumer.test_drafter_common import (
        LAYER_IDS,
        distinct_seqs,
        drafter_cfg,
        packed,
        target_features,
        tiny_target,
    )

    target = tiny_target(tmp_path / "t")
    long_seqs, short_seqs = distinct_seqs([40, 56]), distinct_seqs([9], seed=2)
    batches = [(target_features(target, s), *packed(s, prompt_len=p)) for s, p in ((long_seqs, 2), (short_seqs, 6))]
    tokens = sum(b[1].numel() for b in batches)
    cfg = drafter_cfg(
        tokens_per_step=tokens, grad_clip=1e9, anchors_per_seq=16, loss="decay"
    )  # dpace: test_recipe_loss
    trainer = Trainer(cfg, load_target_parts(tmp_path / "t"), LAYER_IDS, "cpu")
    reference_model = copy.deepcopy(trainer.model)
    gen = torch.Generator().manual_seed(0)
    gen.set_state(trainer.generator.get_state())  # the trainer's anchors, drawn again

    loss_sum, weight_sums = 0.0, []
    for hidden, ids, mask, cu in batches:
        batch = build_draft_batch(
            ids,
            mask,
            cu,
            anchors_per_seq=16,
            block_size=cfg.block_size,
            mask_token_id=trainer.mask_token_id,
            gamma=cfg.loss_gamma,
            generator=gen,
        )
        h = reference_model(
            hidden,
            batch.ctx_pos,
            batch.block_ids,
            batch.block_pos,
            attention_masks(batch, ["full_attention"], None, flex=False),
        )
        loss_sum = loss_sum + full_logits_loss(h, reference_model.lm_head, batch.labels, batch.weights)[0]
        weight_sums.append(float(batch.weights.sum()))
    assert weight_sums[0] > 5 * weight_sums[1] > 0  # very different Σw
    (loss_sum / sum(weight_sums)).backward()
    want = {n: p.grad for n, p in reference_model.named_parameters()}

    seen = {}
    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    )
    assert trainer.train_batch(*batches[0], seq=0) is None  # accumulating: no step yet
    trainer.train_batch(*batches[1], seq=1)
    assert trainer.step == 1 and set(seen) == set(want)
    for n in want:
        torch.testing.assert_close(seen[n], want[n], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("anchors_per_batch, want", [(None, 512 // 8), (40, 40)])
def test_the_trainer_runs_at_most_its_anchor_budget(tmp_path, anchors_per_batch, want):
    """20 sequences of 12 tokens (9 candidates each, 180 in all), 64 anchors per sequence asked: the old
    trainer ran 20 × 64 = 1,280 anchors. Now: the budget, from data.tokens_per_batch (512 // 8) or the
    job key, and the step still learns from them (a finite loss with weight)."""
    from common.profile import ProfileStats
    from consumer.target_parts import load_target_parts
    from consumer.trainer import Trainer
    from tests.consumer.test_drafter_common import (
        LAYER_IDS,
        distinct_seqs,
        drafter_cfg,
        packed,
        target_features,
        tiny_target,
    )

    target = tiny_target(tmp_path / "t")
    seqs = distinct_seqs([12] * 20)
    prof = ProfileStats()
    cfg = drafter_cfg(anchors_per_seq=64, anchors_per_batch=anchors_per_batch)
    trainer = Trainer(cfg, load_target_parts(tmp_path / "t"), LAYER_IDS, "cpu", prof=prof, tokens_per_batch=512)
    assert trainer.max_anchors == want
    out = trainer.train_batch(target_features(target, seqs), *packed(seqs), seq=0)
    assert prof.snapshot()["counters"]["anchors"] == want
    assert math.isfinite(out["loss"]) and out["loss"] > 0
