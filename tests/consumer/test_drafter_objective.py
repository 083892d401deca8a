"""Anchors, block inputs, labels, weights and the attention mask of the DFlash objective (dflash.md §2)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from consumer.loss import chunked_lm_head_loss
from consumer.model import DFlashDrafter, DrafterArch
from consumer.objective import (
    anchor_budget,
    attention_masks,
    build_draft_batch,
    dense_mask,
    flex_bucket,
    flex_mask,
    slot_weights,
)

MASK = 99
B = 3


def hand_batch(seed: int = 0, partial_blocks: bool = False):
    """Two sequences, lengths 6 and 4, block 3, 4 anchors per sequence. Under the whole-block rule
    (loss_mask==1 and p+3 <= S): seq 0 (loss_mask 0 at p=0) -> p in {1, 2, 3}; seq 1 -> p in {0, 1}.
    Every candidate is drawn whatever the RNG, so the anchors are known: [1, 2, 3] and [0, 1], and no
    padding anchor fills the sequences that have fewer than 4. (The partial-block rule's anchors of this
    batch: test_partial_block_anchors.)"""
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
            partial_blocks=partial_blocks,
        ),
        input_ids,
        loss_mask,
    )


# (sequence, p in the sequence, packed index of p) per anchor
ANCHORS = [(0, 1, 1), (0, 2, 2), (0, 3, 3), (1, 0, 6), (1, 1, 7)]
SEQ_OF_TOKEN = [0] * 6 + [1] * 4
T = 10


def expected_allowed(q: int, kv: int) -> bool:
    """The rule, written out independently of the implementation."""
    seq, _, p_packed = ANCHORS[q // B]
    if kv < T:  # context: same sequence, strictly before the anchor
        return SEQ_OF_TOKEN[kv] == seq and kv < p_packed
    return (kv - T) // B == q // B  # own block (bidirectional), no other block


def test_anchors_of_the_hand_batch():
    batch, _, _ = hand_batch()
    assert batch.anchor_tok.tolist() == [1, 2, 3, 6, 7]
    assert batch.anchor_seq.tolist() == [0, 0, 0, 1, 1]
    assert batch.num_candidates == 5


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
    assert not bool(batch.allowed(torch.tensor(4 * B), torch.tensor(0)))  # seq 1 anchor p=1 vs seq 0 ctx
    assert bool(batch.allowed(torch.tensor(4 * B), torch.tensor(6)))  # its own sequence's j=0
    assert not got[:, T + 0 * B : T + 1 * B][B : 2 * B].any()  # block 1 never sees block 0


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
    for a, (_, p, p_packed) in enumerate(ANCHORS):
        assert bids[a].tolist() == [int(ids[p_packed])] + [MASK] * (B - 1)
        assert pos[a].tolist() == [p + k for k in range(B)]
        # NOT shifted: slot k predicts x[p+k] (SpecForge issue 455: a +1 shift broke acceptance)
        assert labels[a].tolist() == ids[p_packed : p_packed + B].tolist()
        for k in range(B):
            assert weights[a, k].item() == pytest.approx(w[k] * float(loss_mask[p_packed + k]))
    # seq 1 anchor p=0: slot 2 lands on packed 8 whose loss_mask is 0 -> no loss there
    assert weights[3].tolist() == pytest.approx([0.0, 1.0, 0.0])


def test_slot_weights():
    assert slot_weights(4, 7.0).tolist() == pytest.approx([0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7)])


@pytest.mark.parametrize("partial_blocks", [True, False])
def test_anchor_sampling_rules_and_resampling(partial_blocks):
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
            partial_blocks=partial_blocks,
        )
        return [batch.anchor_tok[batch.anchor_seq == s].tolist() for s in range(len(lengths))]

    def candidate(p: int, s: int) -> bool:
        if partial_blocks:  # supervised tokens at p and p+1 inside the sequence
            return bool(loss_mask[p]) and p + 1 < cu[s + 1] and bool(loss_mask[p + 1])
        return bool(loss_mask[p]) and p - cu[s] + Bs <= lengths[s]  # a whole block inside

    gen = torch.Generator().manual_seed(0)
    draws = [draw(gen) for _ in range(20)]
    cands = [[p for p in range(cu[s], cu[s + 1]) if candidate(p, s)] for s in range(4)]
    seen = set()
    for picks in draws:
        for s in range(len(lengths)):
            picked = picks[s]
            assert len(picked) == min(N, len(cands[s]))  # without replacement; no padding when too few
            assert picked == sorted(set(picked)) and set(picked) <= set(cands[s])
            seen.update(picked)
    assert seen == {p for c in cands for p in c}  # resampled every call: every candidate shows up
    assert draws[0] != draws[1]
    assert draw(torch.Generator().manual_seed(0)) == draws[0]  # the generator decides


def test_anchor_budget():
    assert anchor_budget(16384, None, 512) == 2048  # one anchor per 8 tokens of a full batch
    assert anchor_budget(1024, None, 512) == 512  # never below one sequence's anchors
    assert anchor_budget(16384, 1000, 512) == 1000  # the job key decides when set


def test_a_batch_under_the_budget_draws_the_anchors_it_drew_without_one():
    """Pinned to the anchors the code before the budget drew (every sequence has >= N candidates, so
    it had no padding): with no budget or one that does not bind, the same anchors, and the generator
    ends in the same state (the cut's draw happens only when the budget binds)."""
    lengths = [11, 9, 14]
    ids = torch.randint(0, 50, (sum(lengths),), generator=torch.Generator().manual_seed(5))
    loss_mask = torch.ones(sum(lengths), dtype=torch.uint8)
    loss_mask[[0, 11, 12]] = 0
    cu = torch.tensor([0, 11, 20, 34])
    ends = []
    for budget in (None, 12, 10_000):
        gen = torch.Generator().manual_seed(7)
        batch = build_draft_batch(
            ids,
            loss_mask,
            cu,
            anchors_per_seq=4,
            block_size=3,
            mask_token_id=99,
            gamma=2.0,
            generator=gen,
            max_anchors=budget,
        )
        assert batch.anchor_tok.tolist() == [1, 4, 6, 8, 13, 14, 15, 17, 21, 24, 25, 29]
        assert batch.weights.sum().item() == pytest.approx(19.27836799621582, rel=1e-6)  # the old code's Σw
        ends.append(torch.rand(1, generator=gen).item())
    assert ends[0] == ends[1] == ends[2]


def short_sequences(nseq: int, seed: int = 0):
    """nseq packed sequences of 6..20 tokens, each with a prompt of 1..4 tokens (loss_mask 0)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 21, (nseq,), generator=g).tolist()
    prompts = torch.randint(1, 5, (nseq,), generator=g).tolist()
    loss_mask = torch.cat([(torch.arange(n) >= p).to(torch.uint8) for n, p in zip(lengths, prompts, strict=True)])
    ids = torch.randint(0, 120, (sum(lengths),), generator=g)
    return ids, loss_mask, torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def reference_loss(model, features, ids, loss_mask, cu, anchors, block_size: int, gamma: float, mask_id: int):
    """Σ w·CE over the given (packed) anchors, each drafted on its own (model.draft on its sequence's
    context before p): no packing, no mask machinery, no padding anchors."""
    total = 0.0
    for p in anchors:
        s = int(torch.searchsorted(cu, p, right=True)) - 1
        start, end = int(cu[s]), int(cu[s + 1])
        block = torch.tensor([int(ids[p])] + [mask_id] * (block_size - 1))
        logits = model.draft(features[start:p], block)
        for k in range(1, block_size):
            if p + k < end and loss_mask[p + k]:
                ce = F.cross_entropy(logits[k][None].float(), ids[p + k][None])
                total += math.exp(-(k - 1) / gamma) * ce.item()
    return total


@pytest.mark.parametrize("budget", [None, 100])
def test_many_short_sequences_run_at_most_their_candidates_and_budget(budget):
    """40 short sequences, 64 anchors per sequence asked: the old code ran 40 × 64 anchors (mostly
    padding). Now the drafter sees only real anchors: every candidate (N > any sequence's candidates), or
    exactly the budget; and the loss equals Σ w·CE of those anchors drafted one by one."""
    torch.manual_seed(0)
    ids, loss_mask, cu = short_sequences(40)
    N, Bs, gamma, mask_id = 64, 4, 4.0, 127
    batch = build_draft_batch(
        ids,
        loss_mask,
        cu,
        anchors_per_seq=N,
        block_size=Bs,
        mask_token_id=mask_id,
        gamma=gamma,
        generator=torch.Generator().manual_seed(1),
        max_anchors=budget,
    )
    cands = {p for s in range(40) for p in range(int(cu[s]), int(cu[s + 1]) - 1) if loss_mask[p] and loss_mask[p + 1]}
    assert batch.num_candidates == len(cands) > 100
    bound = len(cands) if budget is None else budget
    assert batch.num_anchors == bound and batch.block_ids.numel() == bound * Bs  # rows entering the drafter
    assert batch.num_anchors * Bs < 0.2 * 40 * N * Bs  # the old rows
    picked = batch.anchor_tok.tolist()
    assert picked == sorted(set(picked)) and set(picked) <= cands
    assert batch.anchor_seq.tolist() == [int(torch.searchsorted(cu, p, right=True)) - 1 for p in picked]

    arch = DrafterArch(32, 4, 2, 8, 64, 1, 2, 1e-6, 1e4)
    model = DFlashDrafter(arch, torch.randn(128, 32), torch.randn(128, 32))
    features = torch.randn(ids.numel(), 2 * 32)
    with torch.no_grad():
        h = model(features, batch.ctx_pos, batch.block_ids, batch.block_pos, dense_mask(batch))
        loss, _ = chunked_lm_head_loss(h, model.lm_head, batch.labels, batch.weights, 64)
    want = reference_loss(model, features, ids, loss_mask, cu, picked, Bs, gamma, mask_id)
    assert loss.item() == pytest.approx(want, rel=1e-4)


def test_the_budget_cut_keeps_each_sequences_share():
    """Two sequences with 2 and 20 candidates, N = 5: 2 + 5 draws, cut to a budget of 4. Each draw keeps
    its inclusion probability up to one factor (4/7), so sequence 0 averages 4 · 2/7 anchors (uniform over
    the batch's candidates would give it 4 · 2/22)."""
    loss_mask = torch.ones(24, dtype=torch.uint8)
    cu = torch.tensor([0, 3, 24])  # candidates: p in {0, 1} and {3, ..., 22}
    ids = torch.arange(24)
    gen = torch.Generator().manual_seed(0)
    from_first = []
    for _ in range(400):
        batch = build_draft_batch(
            ids,
            loss_mask,
            cu,
            anchors_per_seq=5,
            block_size=2,
            mask_token_id=0,
            gamma=1.0,
            generator=gen,
            max_anchors=4,
        )
        seqs = batch.anchor_seq.tolist()
        assert len(seqs) == 4 and seqs.count(0) <= 2 and seqs.count(1) <= 5
        from_first.append(seqs.count(0))
    assert sum(from_first) / 400 == pytest.approx(4 * 2 / 7, abs=0.1)


def test_counts_come_from_host_tensors_and_a_device_copy_is_refused():
    ids = torch.zeros(8, dtype=torch.long)
    common = dict(anchors_per_seq=2, block_size=2, mask_token_id=0, gamma=1.0, generator=torch.Generator())
    with pytest.raises(ValueError, match="loss_mask must be a host"):
        build_draft_batch(ids, torch.ones(8, device="meta"), torch.tensor([0, 8]), **common)
    with pytest.raises(ValueError, match="cu_seqlens must be a host"):
        build_draft_batch(ids, torch.ones(8), torch.tensor([0, 8], device="meta"), **common)


def test_a_batch_without_candidates_trains_zero_anchors():
    """No supervised pair anywhere: zero anchors, zero rows; forward, loss and backward still run (an FSDP
    replica must take part in every pass) and add nothing."""
    ids = torch.arange(12)
    batch = build_draft_batch(
        ids,
        torch.zeros(12, dtype=torch.uint8),
        torch.tensor([0, 5, 12]),
        anchors_per_seq=4,
        block_size=3,
        mask_token_id=99,
        gamma=2.0,
        generator=torch.Generator(),
    )
    assert batch.num_anchors == 0 and batch.num_candidates == 0 and batch.labels.numel() == 0
    arch = DrafterArch(32, 4, 2, 8, 64, 1, 2, 1e-6, 1e4)
    model = DFlashDrafter(arch, torch.randn(128, 32), torch.randn(128, 32))
    h = model(torch.randn(12, 64), batch.ctx_pos, batch.block_ids, batch.block_pos, dense_mask(batch))
    loss, correct = chunked_lm_head_loss(h, model.lm_head, batch.labels, batch.weights, 64)
    loss.backward()
    assert h.shape == (0, 32) and loss.item() == 0.0 and correct.numel() == 0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


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
    assert batch.anchor_seq.tolist().count(2) < 7  # the 5-token sequence has fewer anchors than the others
    features = torch.randn(Tn, 2 * 32)
    args = (features, batch.ctx_pos, batch.block_ids, batch.block_pos)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        dense = model(*args, dense_mask(batch))
        flex = model(*args, flex_mask(batch, block=16))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(dense).all()


def test_partial_block_anchors_and_weights_of_the_hand_batch():
    """The default rule: an anchor needs loss_mask 1 at p and p+1 inside its sequence; its block may run
    past the end. Seq 0 (S=6, loss_mask 0 only at p=0) -> p in {1, 2, 3, 4} (p=5 has no p+1);
    seq 1 (loss_mask [1, 1, 0, 1]) -> p=0 only (p=1: loss_mask[2]=0; p=3: no p+1)."""
    batch, _, _ = hand_batch(partial_blocks=True)
    assert batch.anchor_tok.tolist() == [1, 2, 3, 4, 6]
    w1 = math.exp(-1 / 2.0)
    weights = batch.weights.view(-1, B).tolist()
    # p=4 of seq 0: slot 1 is x[5] (the last token, a label now), slot 2 would be position 6: past the end
    assert weights[3] == pytest.approx([0.0, 1.0, 0.0])
    assert batch.labels.view(-1, B)[3, :2].tolist() == [14, 15]
    assert batch.block_pos.view(-1, B)[3].tolist() == [4, 5, 6]
    assert weights[2] == pytest.approx([0.0, 1.0, w1])  # p=3: whole block inside, as before
    assert weights[4] == pytest.approx([0.0, 1.0, 0.0])  # seq 1 p=0: slot 2 lands on loss_mask 0


def test_a_response_shorter_than_a_block_trains_its_end_of_turn_token():
    """[prompt, answer, <eot>] with B=4: the whole-block rule finds no anchor at all; the default rule
    anchors at the answer and makes <eot> the slot-1 label with full weight."""
    ids = torch.tensor([5, 6, 7])  # 7 stands for the end-of-turn token
    loss_mask = torch.tensor([0, 1, 1], dtype=torch.uint8)
    common = dict(anchors_per_seq=2, block_size=4, mask_token_id=MASK, gamma=4.0)
    old = build_draft_batch(
        ids, loss_mask, torch.tensor([0, 3]), generator=torch.Generator(), partial_blocks=False, **common
    )
    assert old.num_anchors == 0 and old.weights.numel() == 0 and old.block_ids.numel() == 0
    new = build_draft_batch(ids, loss_mask, torch.tensor([0, 3]), generator=torch.Generator(), **common)
    assert new.anchor_tok.tolist() == [1]
    assert new.block_ids.view(-1, 4)[0].tolist() == [6, MASK, MASK, MASK]
    assert new.labels.view(-1, 4)[0, 1].item() == 7
    assert new.weights.view(-1, 4).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def window_batch():
    """One sequence of 7 tokens whose only candidate anchor is p=5 (loss_mask 1 at 5 and 6), block 4:
    block rows at positions 5, 6, 7, 8 (7 and 8 past the end)."""
    ids = torch.arange(10, 17)
    loss_mask = torch.tensor([0, 0, 0, 0, 0, 1, 1], dtype=torch.uint8)
    return build_draft_batch(
        ids,
        loss_mask,
        torch.tensor([0, 7]),
        anchors_per_seq=1,
        block_size=4,
        mask_token_id=MASK,
        gamma=4.0,
        generator=torch.Generator(),
    )


def test_sliding_window_mask_literal():
    """Window W=3 (smaller than the block, so the block part is cut too): slot k at position 5+k sees
    context j < 5 with 5+k-j < 3, and block slot k' with |k-k'| < 3. Columns: context 0..6 | block 0..3."""
    batch = window_batch()
    assert batch.anchor_tok.tolist() == [5] and batch.block_pos.tolist() == [5, 6, 7, 8]
    got = batch.allowed(torch.arange(4)[:, None], torch.arange(7 + 4)[None, :], window=3)
    rows = ["0001100|1110", "0000100|1111", "0000000|1111", "0000000|0111"]
    want = torch.tensor([[c == "1" for c in r.replace("|", "")] for r in rows])
    assert torch.equal(got, want)
    full = batch.allowed(torch.arange(4)[:, None], torch.arange(11)[None, :])
    assert torch.equal(full, torch.tensor([[c == "1" for c in "11111001111"]] * 4))  # no window: j < p, whole block


@pytest.mark.parametrize("window", [None, 3, 6, 100])
def test_dense_mask_with_a_window_is_the_full_mask_on_the_gathered_keys(window):
    torch.manual_seed(0)
    lengths = [12, 9, 3]
    Tn = sum(lengths)
    batch = build_draft_batch(
        torch.randint(0, 90, (Tn,)),
        (torch.rand(Tn) > 0.2).to(torch.uint8),
        torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        anchors_per_seq=5,
        block_size=4,
        mask_token_id=MASK,
        gamma=4.0,
        generator=torch.Generator().manual_seed(1),
    )
    dm = dense_mask(batch, window)
    Q = batch.num_anchors * 4
    full = batch.allowed(torch.arange(Q)[:, None], torch.arange(Tn + Q)[None, :], window)
    for a in range(batch.num_anchors):
        for k in range(4):
            row = full[a * 4 + k]
            allowed = dm.allowed[a, 0, k if window is not None else 0]
            assert torch.equal(allowed, row[dm.key_index[a]])
            assert sorted(dm.key_index[a][allowed].tolist()) == torch.nonzero(row)[:, 0].tolist()


def test_flex_buckets():
    assert [flex_bucket(n) for n in (1, 128, 129, 192, 193, 256, 257, 385, 5000)] == [
        128,
        128,
        192,
        192,
        256,
        256,
        384,
        512,
        6144,
    ]


@pytest.mark.parametrize("window", [None, 5])
def test_padded_flex_mask_is_the_predicate_on_the_real_rows(window):
    """flex_mask pads T and Q up to buckets; on the real rows it is exactly `allowed`, padding is closed."""
    torch.manual_seed(0)
    lengths = [37, 20, 5]
    Tn = sum(lengths)
    batch = build_draft_batch(
        torch.randint(0, 90, (Tn,)),
        (torch.rand(Tn) > 0.2).to(torch.uint8),
        torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        anchors_per_seq=7,
        block_size=4,
        mask_token_id=MASK,
        gamma=4.0,
        generator=torch.Generator().manual_seed(2),
    )
    Q = batch.num_anchors * 4
    bm = flex_mask(batch, window, block=16)
    Qp, KVp = bm.seq_lengths
    Tp = KVp - Qp
    assert (Qp, Tp) == (flex_bucket(Q), flex_bucket(Tn))
    grid = bm.mask_mod(0, 0, torch.arange(Qp)[:, None], torch.arange(KVp)[None, :])
    real = batch.allowed(torch.arange(Q)[:, None], torch.arange(Tn + Q)[None, :], window)
    assert torch.equal(grid[:Q, :Tn], real[:, :Tn]) and torch.equal(grid[:Q, Tp : Tp + Q], real[:, Tn:])
    assert not grid[Q:].any() and not grid[:, Tn:Tp].any() and not grid[:, Tp + Q :].any()


def test_flex_and_dense_agree_with_sliding_layers():
    torch.manual_seed(0)
    arch = DrafterArch(
        32,
        4,
        2,
        8,
        64,
        3,
        2,
        1e-6,
        10000.0,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        sliding_window=6,
    )
    model = DFlashDrafter(arch, torch.randn(128, 32), torch.randn(128, 32))
    lengths = [37, 20, 5]
    Tn = sum(lengths)
    batch = build_draft_batch(
        torch.randint(0, 120, (Tn,)),
        (torch.rand(Tn) > 0.2).to(torch.uint8),
        torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        anchors_per_seq=7,
        block_size=4,
        mask_token_id=127,
        gamma=4.0,
        generator=torch.Generator().manual_seed(3),
    )
    args = (torch.randn(Tn, 2 * 32), batch.ctx_pos, batch.block_ids, batch.block_pos)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = model(*args, attention_masks(batch, arch.attention_layers, 6, flex=False))
        flex = model(*args, attention_masks(batch, arch.attention_layers, 6, flex=True))
        no_window = model(*args, {"full_attention": dense_mask(batch), "sliding_attention": dense_mask(batch)})
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    assert (dense - no_window).abs().max() > 1e-3  # the window changes what layers see


def batch_of(lengths: list[int], g: torch.Generator, **kw):
    Tn = sum(lengths)
    batch = build_draft_batch(
        torch.randint(0, 120, (Tn,), generator=g),
        (torch.rand(Tn, generator=g) > 0.1).to(torch.uint8),
        torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        block_size=4,
        mask_token_id=127,
        gamma=4.0,
        generator=g,
        anchors_per_seq=6,
        **kw,
    )
    return batch, torch.randn(Tn, 64, generator=g)


@pytest.mark.slow
def test_compiled_flex_compiles_the_planned_graphs_only_and_a_fallback_is_counted():
    """30 batches of varying lengths, sequence and anchor counts, through torch.compile(flex_attention)
    on the CPU (forward: FlexAttention has no CPU backward; tests/consumer/test_drafter_cuda.py trains on a GPU).
    Padded to the run's one planned shape they compile exactly the plan's graphs (full + sliding layers),
    counted by Dynamo, never fall back, and give the dense path's output. The old per-batch buckets would
    have compiled a graph per (bucket, layer kind). Then a batch beyond the plan, refused by Dynamo's
    recompile limit, runs eagerly: counted (unplanned, fallback) and still right."""
    from torch._dynamo.utils import counters

    from common.profile import ProfileStats
    from consumer.kernels.flex import CompiledFlex, FlexPlan

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    arch = DrafterArch(
        32, 4, 2, 8, 64, 2, 2, 1e-6, 1e6, layer_types=("sliding_attention", "full_attention"), sliding_window=16
    )
    model = DFlashDrafter(arch, torch.randn(128, 32), torch.randn(128, 32))
    plan = FlexPlan.for_run(max_tokens=250, max_anchors=60, block_size=4, layer_kinds=2)
    assert (plan.ctx_rows, plan.block_rows, plan.graphs) == (256, 256, 2)
    prof = ProfileStats()
    kernel = CompiledFlex(plan, prof)
    g = torch.Generator().manual_seed(0)

    def run(batch, features):
        args = (features, batch.ctx_pos, batch.block_ids, batch.block_pos)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eager fallback's "flex_attention called without torch.compile"
            flex = model(*args, attention_masks(batch, arch.attention_layers, 16, flex=True, kernel=kernel))
            dense = model(*args, attention_masks(batch, arch.attention_layers, 16, flex=False))
        torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)

    shapes, old_buckets = set(), set()
    for _ in range(30):
        lengths = torch.randint(5, 32, (int(torch.randint(1, 9, (), generator=g)),), generator=g).tolist()
        batch, features = batch_of(lengths, g, max_anchors=60)
        shapes.add((batch.num_tokens, batch.num_anchors))
        old_buckets.add((flex_bucket(batch.num_tokens), flex_bucket(batch.num_anchors * 4)))
        run(batch, features)
    assert len(shapes) >= 20 and len(old_buckets) >= 3  # the batches differ; the old plan: >= 6 graphs
    assert counters["stats"]["unique_graphs"] == plan.graphs, dict(counters["stats"])
    assert kernel.unplanned_shapes == kernel.eager_fallbacks == 0
    assert "flex_eager_fallbacks" not in prof.snapshot()["counters"]

    kernel.recompile_limit = plan.graphs  # as if the headroom for unplanned shapes were spent
    big, features = batch_of([30] * 10, g)  # T = 300 > 256: outside the plan, and refused by Dynamo
    run(big, features)
    # refused, so run eagerly (torch's eager flex traces its own eager-backend wrapper: no inductor graph)
    assert kernel.unplanned_shapes == kernel.eager_fallbacks == 2  # one call per layer kind
    assert prof.snapshot()["counters"]["flex_eager_fallbacks"] == 2
    assert prof.snapshot()["counters"]["flex_unplanned_shapes"] == 2
