"""GPU checks of the drafter: the Triton kernel on CUDA tensors, FlexAttention training, warm-up.

Skipped without CUDA. tests/conftest.py sets TRITON_INTERPRET=1 only where CUDA is absent, so on a GPU
these tests run the compiled kernel and its autotune configs."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from consumer.kernels import weighted_ce
from consumer.model import DFlashDrafter, DrafterArch
from consumer.objective import build_draft_batch, dense_mask, flex_mask
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

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_gpu_matches_torch(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    R, V = 300, 32_000
    logits = (torch.randn(R, V, device="cuda", generator=g) * 3).to(dtype)
    labels = torch.randint(0, V, (R,), device="cuda", generator=g)
    weights = torch.rand(R, device="cuda", generator=g)
    weights[::7] = 0
    x = logits.float().clone().requires_grad_()
    ce = F.cross_entropy(x, labels, reduction="none")
    (ce * weights).sum().backward()
    buf = logits.clone()
    lse, tgt, _ = weighted_ce.weighted_ce_(buf, labels, weights)
    torch.testing.assert_close(lse - tgt, ce, rtol=1e-4, atol=1e-4)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(buf.float(), x.grad, rtol=tol, atol=tol)


def test_flex_and_dense_agree_forward_and_backward_on_gpu():
    torch.manual_seed(0)
    arch = DrafterArch(64, 4, 2, 16, 128, 2, 2, 1e-6, 10000.0)
    model = DFlashDrafter(arch, torch.randn(256, 64), torch.randn(256, 64)).cuda()
    lengths = [70, 40, 6, 90]
    T = sum(lengths)
    ids = torch.randint(0, 250, (T,), device="cuda")
    loss_mask = (torch.rand(T) > 0.2).to(torch.uint8)  # a host copy, as the stream hands it over
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    batch = build_draft_batch(
        ids,
        loss_mask,
        cu,
        anchors_per_seq=9,
        block_size=8,
        mask_token_id=255,
        gamma=4.0,
        generator=torch.Generator(device="cuda").manual_seed(0),
    )
    features = torch.randn(T, 2 * 64, device="cuda")
    outs, grads = [], []
    for mask in (dense_mask(batch), flex_mask(batch)):
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h = model(features, batch.ctx_pos, batch.block_ids, batch.block_pos, mask)
        (h * batch.weights[:, None]).sum().backward()
        outs.append(h.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-3, atol=1e-3)


def test_trainer_on_gpu_learns_with_flex_and_bf16(tmp_path):
    model = tiny_target(tmp_path / "t")
    seqs = distinct_seqs([40, 56])
    batch = (target_features(model, seqs), *packed(seqs))
    trainer = Trainer(drafter_cfg(), load_target_parts(tmp_path / "t"), LAYER_IDS, "cuda")
    assert trainer.use_flex and trainer.autocast_dtype == torch.bfloat16
    trainer.warmup(tmp_path / "triton-cache")
    losses = [trainer.train_batch(*batch, seq=i)["loss"] for i in range(60)]
    assert losses[-1] < 0.5 * losses[0]
    if not weighted_ce.INTERPRET:
        assert any((tmp_path / "triton-cache").iterdir())  # compiled kernels land in the run's cache


def test_dspark_trainer_on_gpu_learns_with_flex_and_bf16(tmp_path):
    """DSpark (consumer/dspark.py) on the GPU path: flex attention, bf16 autocast, its chunked loss recomputed in
    backward; the taps include the target's last layer, so its L1 is against the target's distribution."""
    model = tiny_target(tmp_path / "t")
    seqs = distinct_seqs([40, 56])
    batch = (target_features(model, seqs), *packed(seqs))
    cfg = drafter_cfg(arch="dspark", markov_rank=16)
    trainer = Trainer(cfg, load_target_parts(tmp_path / "t"), LAYER_IDS, "cuda")
    assert trainer.use_flex and trainer.dspark_target_block is not None
    logs = [trainer.train_batch(*batch, seq=i) for i in range(60)]
    assert logs[-1]["dspark_ce"] < 0.5 * logs[0]["dspark_ce"] and logs[-1]["loss"] < logs[0]["loss"]


def test_flex_training_compiles_the_planned_graphs_and_keeps_memory_bounded(tmp_path):
    """36 training batches of varying lengths (sliding and full layers), all inside the run's plan
    (tokens_per_batch 512, the anchor budget): compiled FlexAttention and its block-mask builder compile
    once per layer kind, a second round compiles nothing, nothing leaves the plan or falls back, and peak
    memory stays far below the dense score matrix that an eager fallback would materialise."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_target(tmp_path / "t")
    cfg = drafter_cfg(
        block_size=16,
        num_layers=2,
        anchors_per_seq=64,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
    )
    trainer = Trainer(cfg, load_target_parts(tmp_path / "t"), LAYER_IDS, "cuda", tokens_per_batch=512)
    assert trainer.use_flex and trainer.flex is not None
    plan = trainer.flex.plan
    assert (plan.ctx_rows, plan.block_rows, plan.graphs) == (512, 128 * 16, 2)
    g = torch.Generator().manual_seed(0)

    def run(batches: int, first_seq: int) -> None:
        for i in range(batches):
            seqs = [torch.randint(0, 500, (int(n),), generator=g) for n in torch.randint(70, 126, (3,), generator=g)]
            ids, mask, cu = packed(seqs)
            out = trainer.train_batch(target_features(model, seqs), ids, mask, cu, seq=first_seq + i)
            assert out is not None and math.isfinite(out["loss"])

    torch.cuda.reset_peak_memory_stats()
    run(24, 0)
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2 * plan.graphs, dict(counters["stats"])  # flex + its mask builder, per layer kind
    run(12, 24)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing new compiled
    assert trainer.flex.unplanned_shapes == trainer.flex.eager_fallbacks == 0
    dense_scores = 4 * plan.block_rows * (plan.ctx_rows + plan.block_rows) * 4  # heads × rows × keys × fp32
    assert torch.cuda.max_memory_allocated() < dense_scores / 4, (torch.cuda.max_memory_allocated(), dense_scores)
