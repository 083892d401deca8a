"""optimizer = "muon" (issue 20 item 3): which parameters Muon gets, that one step is torch's Muon plus AdamW
with the configured values and one schedule, that a non-finite step changes nothing, that checkpoint ->
resume is bit-exact, and that FSDP with Muon loads (its sharded training: tests/consumer/test_scaleout_fsdp.py)."""

from __future__ import annotations

import math

import pytest
import torch

from common.config import DrafterConfig, load_job
from consumer.checkpoint import load_latest, save_checkpoint
from consumer.optim import is_muon_param
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


def test_muon_takes_hidden_matrices_and_adamw_the_rest():
    cases = {
        ("layers.0.self_attn.q_proj.weight", (64, 64)): True,
        ("fc.weight", (64, 192)): True,
        ("layers.0.mlp.down_proj.weight", (64, 128)): True,
        ("layers.0.input_layernorm.weight", (64,)): False,  # 1-D
        ("candidate_selector.predecessor_codebook", (512, 16)): False,  # a codebook
        ("embed_tokens.weight", (512, 64)): False,
        ("lm_head.weight", (512, 64)): False,
        ("layers.0.attention_conv.base_kernel", (2, 2, 64)): False,  # 3-D
        ("gate.weight", (1, 64)): False,  # degenerate [1, N]
    }
    for (name, shape), want in cases.items():
        assert is_muon_param(name, torch.nn.Parameter(torch.zeros(shape))) is want, name
    assert not is_muon_param("fc.weight", torch.zeros(4, 4))  # frozen (no grad): nobody's


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon")
    model = tiny_target(tmp / "t")
    batches = []
    for i in range(4):
        seqs = distinct_seqs([24 + i, 30 - i], seed=i)
        batches.append((target_features(model, seqs), *packed(seqs)))
    return load_target_parts(tmp / "t"), batches, tmp


def _muon_cfg(**kw) -> DrafterConfig:
    return drafter_cfg(optimizer="muon", lr=2e-3, warmup_frac=0.5, total_steps=4, **kw)


def test_a_muon_step_is_torch_muon_on_the_matrices_and_adamw_on_the_rest(case):
    """The drafter's real parameters: Muon (lr = lr by default, momentum 0.95, weight decay 0.1, 5 NS steps,
    match_rms_adamw) on q/k/v/o, the MLP and fc; AdamW on the norms; both at the schedule's lr."""
    parts, batches, _ = case
    trainer = Trainer(_muon_cfg(), parts, LAYER_IDS, "cpu")
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    muon_names = {names[id(p)] for g in trainer.optimizer.muon.param_groups for p in g["params"]}
    adam_names = {names[id(p)] for g in trainer.optimizer.adamw.param_groups for p in g["params"]}
    assert "fc.weight" in muon_names and "layers.0.self_attn.q_proj.weight" in muon_names
    assert all(n.endswith("norm.weight") for n in adam_names) and adam_names
    assert muon_names | adam_names == set(names.values()) and not muon_names & adam_names
    group = trainer.optimizer.muon.param_groups[0]
    assert (group["momentum"], group["weight_decay"], group["ns_steps"], group["adjust_lr_fn"]) == (
        0.95,
        0.1,
        5,
        "match_rms_adamw",
    )
    # warmup 2 of 4 steps: the first step runs at lr·1/2 for both optimizers
    assert trainer.scheduler.get_last_lr() == [1e-3, 1e-3]  # AdamW (its one group: the norms), Muon

    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    grads = {}
    trainer.optimizer.muon.register_step_pre_hook(
        lambda *_: grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    )
    trainer.train_batch(*batches[0], seq=0)
    for n, p in trainer.model.named_parameters():  # the same step by hand through torch's optimizers
        ref = torch.nn.Parameter(before[n].clone())
        ref.grad = grads[n]
        if n in muon_names:
            opt = torch.optim.Muon([ref], lr=1e-3, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
        else:
            opt = torch.optim.AdamW([ref], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
        opt.step()
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-6, msg=n)
    assert trainer.scheduler.get_last_lr() == [2e-3, 2e-3]


def test_a_non_finite_step_leaves_muon_and_adamw_untouched(case):
    parts, batches, _ = case
    trainer = Trainer(_muon_cfg(), parts, LAYER_IDS, "cpu")
    trainer.train_batch(*batches[0], seq=0)  # momentum buffers exist
    state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    bufs = [b["momentum_buffer"].clone() for b in trainer.optimizer.muon.state.values()]
    bad = batches[1][0].clone()
    bad[0, 0] = math.nan
    trainer.train_batch(bad, *batches[1][1:], seq=1)
    assert all(torch.equal(v, state[k]) for k, v in trainer.model.state_dict().items())
    assert all(
        torch.equal(b["momentum_buffer"], w) for b, w in zip(trainer.optimizer.muon.state.values(), bufs, strict=True)
    )
    assert trainer.nonfinite.skipped() == 1 and trainer.step == 2


def test_muon_checkpoint_resume_is_bit_exact(case):
    """Train 2 steps, checkpoint, resume in a fresh trainer, train 2 more == 4 steps straight, bit for bit."""
    parts, batches, tmp = case
    straight = Trainer(_muon_cfg(), parts, LAYER_IDS, "cpu")
    for i, b in enumerate(batches):
        straight.train_batch(*b, seq=i)
    first = Trainer(_muon_cfg(), parts, LAYER_IDS, "cpu")
    for i, b in enumerate(batches[:2]):
        first.train_batch(*b, seq=i)
    save_checkpoint(tmp / "ckpt", first)
    resumed = Trainer(_muon_cfg(), parts, LAYER_IDS, "cpu")
    resumed.load_state_dict(load_latest(tmp / "ckpt").state)
    for i, b in enumerate(batches[2:], start=2):
        resumed.train_batch(*b, seq=i)
    for (n, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    for a, b in zip(straight.optimizer.muon.state.values(), resumed.optimizer.muon.state.values(), strict=True):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    assert straight.scheduler.get_last_lr() == resumed.scheduler.get_last_lr()
    adamw = Trainer(drafter_cfg(), parts, LAYER_IDS, "cpu")  # a Muon state into an AdamW drafter: refused
    with pytest.raises(
        ValueError, match="the ckpt was trained with optimizer = 'muon', this job has optimizer = 'adamw'"
    ):
        adamw.load_state_dict(load_latest(tmp / "ckpt").state, source="the ckpt")


def test_muon_under_fsdp_loads_as_written(tmp_path):
    """No longer refused: the FSDP gather and resume carry Muon's state."""
    path = tmp_path / "job.toml"
    path.write_text("""
[target]
path = "t"
[data]
path = "d.jsonl"
[[drafters]]
name = "d0"
replicas = 2
distributed = "fsdp"
optimizer = "muon"
muon_momentum = 0.9
""")
    (drafter,) = load_job(path).drafters
    assert (drafter.optimizer, drafter.distributed, drafter.replicas, drafter.muon_momentum) == ("muon", "fsdp", 2, 0.9)
