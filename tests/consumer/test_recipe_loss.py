"""D-PACE (loss = "dpace", issue 20 item 1): weights and loss by hand on two blocks, both loss paths, the
normaliser (valid anchors, global over the step's rounds and replicas: two gloo processes), and the trainer
on qwen3 and a hybrid (Gated DeltaNet) target of the zoo against an independent full-logits computation."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from common.config import DrafterConfig, dflash_layer_ids
from consumer.kernels import weighted_ce
from consumer.loss import (
    DecayLoss,
    DPaceLoss,
    chunked_lm_head_loss,
    dpace_weights,
    full_logits_loss,
    slot_loss,
)
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
from tests.consumer.test_drafter_loss import case, kernel_path, reference  # noqa: F401 (kernel_path: a fixture)
from tests.jobs import run_ranks
from tests.target_zoo import build_target, layer_outputs, load_model

ROOT = Path(__file__).resolve().parents[2]
LN2, LN43 = math.log(2.0), math.log(4.0 / 3.0)

# Two blocks of B = 4, α = 0.5. q = the draft's probability of the label; slot 0 is the anchor (no loss).
#   block 1: m = [0, 1, 1, 1], q = [-, 1/2, 1/4, 3/4]
#     q̃ = (1-α)q + α = [1 (masked), 3/4, 5/8, 7/8]; C = cumprod = [1, 3/4, 15/32, 105/256]
#     w3 = C3 = 105/256; w2 = C2 + C3 = 225/256; w1 = C1 + C2 + C3 = 417/256
#   block 2: m = [0, 1, 1, 0] (slot 3 past the sequence end), q = [-, 3/4, 1/2, 1/4 (masked)]
#     q̃ = [1, 7/8, 3/4, 1 (masked: a no-op)]; C = [1, 7/8, 21/32, 21/32]
#     w3 = 0 (masked); w2 = m2·C2 + m3·C3 = 21/32; w1 = 7/8 + 21/32 = 49/32
# CE ℓ = -ln q: block 1 [ln 2, 2 ln 2, ln 4/3], block 2 [ln 4/3, ln 2]
# Σ w·ℓ = 417/256·ln2 + 225/256·2ln2 + 105/256·ln(4/3) + 49/32·ln(4/3) + 21/32·ln2
#       = (417 + 450 + 168)/256·ln2 + (105 + 392)/256·ln(4/3) = 1035/256·ln2 + 497/256·ln(4/3)
# normaliser = 2 valid anchors (not Σw = (417 + 225 + 105 + 392 + 168)/256 = 1307/256)
MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.float32)
Q = torch.tensor([[0.5, 0.5, 0.25, 0.75], [0.5, 0.75, 0.5, 0.25]])  # slot 0's q is irrelevant (masked)
WANT_W = torch.tensor([[0, 417 / 256, 225 / 256, 105 / 256], [0, 49 / 32, 21 / 32, 0]])
WANT_SUM = 1035 / 256 * LN2 + 497 / 256 * LN43


def test_dpace_weights_of_two_blocks_by_hand():
    got = dpace_weights(-Q.log(), MASK, 0.5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, WANT_W, rtol=0, atol=1e-6)
    # α = 1: q̃ = 1, every weight is the count of supervised slots at or after k (no confidence at all)
    torch.testing.assert_close(dpace_weights(-Q.log(), MASK, 1.0), torch.tensor([[0, 3, 2, 1], [0, 2, 1, 0.0]]))


def _logits_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden rows that ARE the logits (lm_head = I, V = 2), label 0: softmax(x)[0] = q exactly."""
    q = Q.reshape(-1)
    hidden = torch.stack([torch.log(q), torch.log(1 - q)], dim=1)
    return hidden, torch.zeros(8, dtype=torch.int64)


@pytest.mark.parametrize("path", ["full", "chunked_4", "chunked_7", "chunked_64"])
def test_dpace_loss_value_and_gradient_by_hand(path):
    """Σ w·ℓ / 2 anchors, and d/dx of it: (w/2)·(softmax - onehot) with w held constant (stop-gradient:
    differentiating the weights too would add ∂w/∂ℓ terms). chunked_7: chunks round down to whole blocks."""
    hidden, labels = _logits_rows()
    hidden.requires_grad_(True)
    loss = DPaceLoss(block_size=4, alpha=0.5)
    mask = MASK.reshape(-1)
    eye = torch.eye(2)
    if path == "full":
        total, _ = full_logits_loss(hidden, eye, labels, mask, loss)
    else:
        total, _ = chunked_lm_head_loss(hidden, eye, labels, mask, int(path.split("_")[1]), loss)
    norm = loss.normaliser(mask, num_sequences=1)
    assert float(norm) == 2.0  # valid anchors; not Σw = 1307/256
    assert float(total.detach()) == pytest.approx(WANT_SUM, rel=1e-6)
    (total / norm).backward()
    q = Q.reshape(-1)
    want = (WANT_W.reshape(-1) / 2)[:, None] * torch.stack([q - 1, 1 - q], dim=1)  # softmax - onehot(0)
    torch.testing.assert_close(hidden.grad, want, rtol=0, atol=1e-6)
    assert torch.equal(mask, MASK.reshape(-1))  # the caller's mask is not overwritten


def test_dpace_normaliser_counts_anchors_or_sequences_and_decay_keeps_the_weight_sum():
    mask = torch.tensor([0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1.0])  # three anchors, the middle one without loss
    assert float(DPaceLoss(4, 0.5).normaliser(mask, num_sequences=5)) == 2.0  # "anchors", the default
    assert float(DPaceLoss(4, 0.5, "anchors").normaliser(mask, num_sequences=5)) == 2.0
    assert float(DPaceLoss(4, 0.5, "sequences").normaliser(mask, num_sequences=5)) == 5.0  # the reference's bsz
    w = torch.tensor([0, 1.0, 0.5, 0.25])
    assert float(DecayLoss(4).normaliser(w, num_sequences=5)) == 1.75
    assert isinstance(slot_loss("dpace", 4, 0.3), DPaceLoss) and slot_loss("dpace", 4, 0.3).alpha == 0.3
    assert slot_loss("dpace", 4, 0.3, "sequences").normalise_by == "sequences"
    assert DrafterConfig(name="d").loss == "dpace"  # the default for new jobs
    assert DrafterConfig(name="d").dpace_normaliser == "anchors"
    assert DrafterConfig(name="d", dpace_normaliser="sequences").dpace_normaliser == "sequences"
    with pytest.raises(ValueError, match="dpace_alpha"):
        DrafterConfig(name="d", dpace_alpha=0.0)
    with pytest.raises(ValueError, match="dpace_normaliser"):
        DrafterConfig(name="d", dpace_normaliser="tokens")


def _merged(batches):
    """One batch holding every sequence of `batches` (hidden, ids, loss_mask, cu_seqlens)."""
    cu = [0]
    for *_, c in batches:
        for n in (c[1:] - c[:-1]).tolist():
            cu.append(cu[-1] + n)
    return (
        torch.cat([b[0] for b in batches]),
        torch.cat([b[1] for b in batches]),
        torch.cat([b[2] for b in batches]),
        torch.tensor(cu, dtype=torch.int32),
    )


def _batches(model):
    long_seqs, short_seqs = distinct_seqs([40, 56]), distinct_seqs([9], seed=2)
    return [(target_features(model, s), *packed(s, prompt_len=p)) for s, p in ((long_seqs, 2), (short_seqs, 6))]


def _step_grads(trainer: Trainer, batches) -> dict[str, torch.Tensor]:
    """The gradients the optimizer is handed at the first step (after the step's normalisation)."""
    seen = {}
    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    )
    for i, b in enumerate(batches):
        trainer.accumulate(*b, seq=i)
    trainer.optimizer_step(len(batches) - 1)
    return seen


def _cfg(**kw) -> DrafterConfig:
    # every candidate is an anchor (anchors_per_seq ≥ any sequence): the anchors do not depend on the split
    return drafter_cfg(loss="dpace", grad_clip=1e9, anchors_per_seq=64, **kw)


def replica_worker(rank: int, port: int, data: str, out: str) -> None:
    """One of two replicas: batch `rank` each, one step summed over the group."""
    from consumer.distributed import GroupEnv, ReplicaGroup

    torch.set_num_threads(1)
    d = torch.load(data, weights_only=True)
    env = GroupEnv.resolve(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, replica=rank, replicas=2, node_rank=0, nnodes=1
    )
    group = ReplicaGroup(env, torch.device("cpu"), timeout_s=60)
    trainer = Trainer(_cfg(), load_target_parts(d["target"]), LAYER_IDS, "cpu")
    trainer.grad_sync = group.sum_grads
    group.broadcast_params(trainer.params)
    torch.save(_step_grads(trainer, [d["batches"][rank]]), out)
    group.close()


def reference_dpace_sum(model, hidden, ids, mask, cu, mask_token_id: int) -> tuple[torch.Tensor, int]:
    """(Σ w·CE, anchors) of one batch by the full-logits D-PACE loss (B = 4, α = 0.5, the test drafters'),
    the anchors drawn from a fresh unseeded generator as the trainer's own first draw."""
    batch = build_draft_batch(
        ids,
        mask,
        cu,
        anchors_per_seq=64,
        block_size=4,
        mask_token_id=mask_token_id,
        gamma=1.0,
        generator=torch.Generator(),
    )
    masks = attention_masks(batch, ["full_attention"], None, flex=False)
    h = model(hidden, batch.ctx_pos, batch.block_ids, batch.block_pos, masks)
    loss = DPaceLoss(4, 0.5)
    return full_logits_loss(h, model.lm_head, batch.labels, loss.base_weights(batch.weights), loss)[
        0
    ], batch.num_anchors


@pytest.fixture(scope="module")
def split_case(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpace_split")
    model = tiny_target(tmp / "t")
    return tmp, _batches(model)


def test_dpace_step_over_two_rounds_equals_one_batch_and_an_independent_reference(split_case):
    """Batches of 93 and 3 anchors accumulated over two rounds: the step's gradient is
    ∇(Σ_batches Σ w·CE / Σ_batches anchors), as one batch of every sequence gives it and as the full-logits
    loss computes it independently. Normalising each batch by its own count (local) gives another gradient."""
    tmp, batches = split_case
    parts = load_target_parts(tmp / "t")
    two_rounds = Trainer(_cfg(tokens_per_step=10**6), parts, LAYER_IDS, "cpu")
    reference_model = copy.deepcopy(two_rounds.model)
    got_two = _step_grads(two_rounds, batches)
    got_one = _step_grads(Trainer(_cfg(), parts, LAYER_IDS, "cpu"), [_merged(batches)])

    total, counts = 0.0, []
    for b in batches:
        loss_sum, anchors = reference_dpace_sum(reference_model, *b, two_rounds.mask_token_id)
        total, counts = total + loss_sum, [*counts, anchors]
    assert counts == [90, 2]  # 37 + 53 candidates, and 2
    (total / sum(counts)).backward()
    for name, p in reference_model.named_parameters():
        torch.testing.assert_close(got_two[name], p.grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(got_one[name], p.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_dpace_step_over_two_gloo_replicas_equals_one_replica_one_batch(split_case):
    tmp, batches = split_case
    torch.save({"target": str(tmp / "t"), "batches": batches}, tmp / "data.pt")
    code = "import sys; from tests.consumer.test_recipe_loss import replica_worker as w; w(int(sys.argv[1]), *sys.argv[2:])"
    run_ranks(lambda r, port: ["-c", code, r, port, tmp / "data.pt", tmp / f"r{r}.pt"], timeout=120)
    want = _step_grads(Trainer(_cfg(), load_target_parts(tmp / "t"), LAYER_IDS, "cpu"), [_merged(batches)])
    r0, r1 = (torch.load(tmp / f"r{r}.pt", weights_only=True) for r in range(2))
    for name, w in want.items():
        assert torch.equal(r0[name], r1[name])
        torch.testing.assert_close(r0[name], w, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_dpace_trainer_on_zoo_targets_matches_the_full_logits_reference(arch, tmp_path):
    """qwen3 and a hybrid target (Gated DeltaNet + full attention): the trainer's first D-PACE step hands
    the optimizer ∇(Σ w·CE / anchors) of the full-logits loss, and three steps train with finite losses."""
    path = build_target(arch, tmp_path / "target")
    target = load_model(path)
    text = target.config.get_text_config()
    layer_ids = dflash_layer_ids(text.num_hidden_layers, 2)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, 260, (n,), generator=g) for n in (20, 13)]
    ids = torch.cat(seqs)
    mask = torch.cat([(torch.arange(len(s)) >= 3).to(torch.uint8) for s in seqs])
    cu = torch.tensor([0, 20, 33], dtype=torch.int32)
    feats = torch.cat([layer_outputs(target, s, layer_ids) for s in seqs])
    trainer = Trainer(
        drafter_cfg(loss="dpace", grad_clip=1e9, anchors_per_seq=64), load_target_parts(path), layer_ids, "cpu"
    )
    reference_model = copy.deepcopy(trainer.model)
    total, anchors = reference_dpace_sum(reference_model, feats, ids, mask, cu, trainer.mask_token_id)
    (total / anchors).backward()
    got = _step_grads(trainer, [(feats, ids, mask, cu)])
    for name, p in reference_model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-7)
    losses = [trainer.train_batch(feats, ids, mask, cu, seq=i)["loss"] for i in range(1, 4)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


@pytest.mark.usefixtures("kernel_path")
def test_kernel_reweights_between_its_forward_and_its_gradient():
    """weighted_ce_ with `reweight`: the weights come from the rows' CE after the forward pass, are written
    into `weights`, and the in-place gradient uses them (both the Triton kernels and the torch fallback)."""
    logits, labels, base = case()
    ce, _, _ = reference(logits, labels, base)

    def reweight(row_ce, w):
        return torch.exp(-row_ce) * w  # any function of the CE

    want_w = torch.exp(-ce) * base
    _, _, grad = reference(logits, labels, want_w)
    buf, w = logits.clone(), base.clone()
    lse, tgt, _ = weighted_ce.weighted_ce_(buf, labels, w, reweight=reweight)
    torch.testing.assert_close(lse - tgt, ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(buf, grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="float32"):
        weighted_ce.weighted_ce_(logits.clone(), labels, base.double(), reweight=reweight)
