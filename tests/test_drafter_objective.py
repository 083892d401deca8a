"""Anchors, block inputs, labels, weights and the attention mask of the DFlash objective (dflash.md §2)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from consumer.model import DFlashDrafter, DrafterArch
from consumer.objective import build_draft_batch, dense_mask, flex_mask, slot_weights

MASK = 99
B = 3


def hand_batch(seed: int = 0):
    """Two sequences, lengths 6 and 4, block 3, 4 anchors per sequence. Candidates (loss_mask==1 and
    p+3 <= S): seq 0 (loss_mask 0 at p=0) -> p in {1, 2, 3}; seq 1 -> p in {0, 1}. Every candidate is
    drawn whatever the RNG, so the anchors are known: [1, 2, 3, pad] and [0, 1, pad, pad]."""
    input_ids = torch.tensor([10, 11, 12, 13, 14, 15, 20, 21, 22, 23])
    loss_mask = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 0, 1], dtype=torch.uint8)
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    return (
        build_draft_batch(
            input_ids,
            loss_mask,
            cu,
            anchors_per_seq=4,
            block_size=B,
            mask_token_id=MASK,
            gamma=2.0,
            generator=torch.Generator().manual_seed(seed),
        ),
        input_ids,
        loss_mask,
    )


# (sequence, p in the sequence, packed index of p) per anchor; None: padding
ANCHORS = [(0, 1, 1), (0, 2, 2), (0, 3, 3), None, (1, 0, 6), (1, 1, 7), None, None]
SEQ_OF_TOKEN = [0] * 6 + [1] * 4
T = 10


def expected_allowed(q: int, kv: int) -> bool:
    """The rule, written out independently of the implementation."""
    anchor = ANCHORS[q // B]
    if anchor is None:
        return False  # padding blocks see nothing
    seq, _, p_packed = anchor
    if kv < T:  # context: same sequence, strictly before the anchor
        return SEQ_OF_TOKEN[kv] == seq and kv < p_packed
    return (kv - T) // B == q // B  # own block (bidirectional), no other block


def test_anchors_of_the_hand_batch():
    batch, _, _ = hand_batch()
    assert batch.anchor_tok.tolist() == [1, 2, 3, 0, 6, 7, 6, 6]
    assert batch.anchor_valid.tolist() == [a is not None for a in ANCHORS]
    assert batch.anchor_seq.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_every_query_key_pair_of_the_mask():
    batch, _, _ = hand_batch()
    Q = len(ANCHORS) * B
    q = torch.arange(Q)[:, None]
    kv = torch.arange(T + Q)[None, :]
    got = batch.allowed(q, kv)
    want = torch.tensor([[expected_allowed(i, j) for j in range(T + Q)] for i in range(Q)])
    assert torch.equal(got, want)
    # the pairs the SpecForge bug got wrong, and the others that must stay closed
    for row in range(B):  # anchor p=2 of seq 0 (packed 2), rows 3..5
        assert bool(batch.allowed(torch.tensor(B + row), torch.tensor(1)))  # j = 1 < p
        assert not bool(batch.allowed(torch.tensor(B + row), torch.tensor(2)))  # j == p: forbidden
    assert not bool(batch.allowed(torch.tensor(5 * B), torch.tensor(0)))  # seq 1 anchor p=1 vs seq 0 ctx
    assert bool(batch.allowed(torch.tensor(5 * B), torch.tensor(6)))  # its own sequence's j=0
    assert not got[:, T + 0 * B : T + 1 * B][B : 2 * B].any()  # block 1 never sees block 0
    assert not got[3 * B : 4 * B].any() and not got[6 * B :].any()  # padding rows see nothing


def test_dense_mask_is_the_full_mask_on_each_blocks_reachable_keys():
    batch, _, _ = hand_batch()
    dm = dense_mask(batch)
    Q = len(ANCHORS) * B
    full = batch.allowed(torch.arange(Q)[:, None], torch.arange(T + Q)[None, :])
    for a in range(len(ANCHORS)):
        keys = dm.key_index[a]
        row_full = full[a * B]
        assert torch.equal(dm.allowed[a, 0, 0], row_full[keys])
        # nothing the full mask allows is outside the gathered keys, and no key is counted twice
        assert set(keys[dm.allowed[a, 0, 0]].tolist()) == set(torch.nonzero(row_full)[:, 0].tolist())
        assert int(dm.allowed[a, 0, 0].sum()) == int(row_full.sum())
        assert all(torch.equal(full[a * B + k], row_full) for k in range(B))  # one row per block


def test_block_inputs_positions_labels_and_weights():
    batch, ids, loss_mask = hand_batch()
    bids = batch.block_ids.view(-1, B)
    labels, weights, pos = batch.labels.view(-1, B), batch.weights.view(-1, B), batch.block_pos.view(-1, B)
    w = [0.0, 1.0, math.exp(-1 / 2.0)]  # w_k = exp(-(k-1)/γ), γ = 2; slot 0 carries no loss
    for a, anchor in enumerate(ANCHORS):
        if anchor is None:
            assert bids[a].tolist() == [MASK] * B
            assert weights[a].tolist() == [0.0] * B
            continue
        _, p, p_packed = anchor
        assert bids[a].tolist() == [int(ids[p_packed])] + [MASK] * (B - 1)
        assert pos[a].tolist() == [p + k for k in range(B)]
        # NOT shifted: slot k predicts x[p+k] (SpecForge issue 455: a +1 shift broke acceptance)
        assert labels[a].tolist() == ids[p_packed : p_packed + B].tolist()
        for k in range(B):
            assert weights[a, k].item() == pytest.approx(w[k] * float(loss_mask[p_packed + k]))
    # seq 1 anchor p=0: slot 2 lands on packed 8 whose loss_mask is 0 -> no loss there
    assert weights[4].tolist() == pytest.approx([0.0, 1.0, 0.0])


def test_slot_weights():
    assert slot_weights(4, 7.0).tolist() == pytest.approx([0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7)])


def test_anchor_sampling_rules_and_resampling():
    torch.manual_seed(0)
    lengths = [40, 25, 3, 30]
    T = sum(lengths)
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    loss_mask = (torch.rand(T) > 0.3).to(torch.uint8)
    ids = torch.arange(T)
    N, Bs = 6, 4

    def draw(gen):
        batch = build_draft_batch(
            ids,
            loss_mask,
            torch.tensor(cu),
            anchors_per_seq=N,
            block_size=Bs,
            mask_token_id=0,
            gamma=1.0,
            generator=gen,
        )
        return batch.anchor_tok.view(-1, N), batch.anchor_valid.view(-1, N)

    gen = torch.Generator().manual_seed(0)
    draws = [draw(gen) for _ in range(20)]
    cands = [
        [p for p in range(cu[s], cu[s + 1]) if loss_mask[p] and p - cu[s] + Bs <= lengths[s]]
        for s in range(4)
    ]
    seen = set()
    for tok, valid in draws:
        for s in range(len(lengths)):
            picked = tok[s][valid[s]].tolist()
            assert len(picked) == min(N, len(cands[s]))  # without replacement, padding only when too few
            assert picked == sorted(set(picked)) and set(picked) <= set(cands[s])
            assert valid[s].tolist() == [True] * len(picked) + [False] * (N - len(picked))  # padding last
            seen.update(picked)
    assert seen == {p for c in cands for p in c}  # resampled every call: every candidate shows up
    assert not torch.equal(draws[0][0], draws[1][0])
    assert torch.equal(draw(torch.Generator().manual_seed(0))[0], draws[0][0])  # the generator decides


def test_bad_cu_seqlens_is_a_clear_error():
    ids = torch.zeros(10, dtype=torch.long)
    with pytest.raises(ValueError, match="cu_seqlens"):
        build_draft_batch(
            ids,
            torch.ones(10),
            torch.tensor([0, 4, 9]),
            anchors_per_seq=2,
            block_size=2,
            mask_token_id=0,
            gamma=1.0,
            generator=torch.Generator(),
        )


def test_flex_and_dense_attention_give_the_same_output():
    """FlexAttention runs forward-only on the CPU (no CPU backward in torch): compare the outputs."""
    torch.manual_seed(0)
    arch = DrafterArch(32, 4, 2, 8, 64, 2, 2, 1e-6, 10000.0)
    model = DFlashDrafter(arch, torch.randn(128, 32), torch.randn(128, 32))
    lengths = [37, 20, 5, 30]
    Tn = sum(lengths)
    ids = torch.randint(0, 120, (Tn,))
    loss_mask = (torch.rand(Tn) > 0.2).to(torch.uint8)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    batch = build_draft_batch(
        ids,
        loss_mask,
        cu,
        anchors_per_seq=7,
        block_size=4,
        mask_token_id=127,
        gamma=4.0,
        generator=torch.Generator().manual_seed(3),
    )
    assert not batch.anchor_valid.all()  # the 5-token sequence has padding blocks
    features = torch.randn(Tn, 2 * 32)
    args = (features, batch.ctx_pos, batch.block_ids, batch.block_pos)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        dense = model(*args, dense_mask(batch))
        flex = model(*args, flex_mask(batch, block=16))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(dense).all()
