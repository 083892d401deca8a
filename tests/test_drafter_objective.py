"""Anchors, block inputs, labels, weights and the attention mask of the DFlash objective (dflash.md §2)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from consumer.model import DFlashDrafter, DrafterArch
from consumer.objective import (
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
    Every candidate is drawn whatever the RNG, so the anchors are known: [1, 2, 3, pad] and
    [0, 1, pad, pad]. (The partial-block rule's anchors of this batch: test_partial_block_anchors.)"""
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
        return batch.anchor_tok.view(-1, N), batch.anchor_valid.view(-1, N)

    def candidate(p: int, s: int) -> bool:
        if partial_blocks:  # supervised tokens at p and p+1 inside the sequence
            return bool(loss_mask[p]) and p + 1 < cu[s + 1] and bool(loss_mask[p + 1])
        return bool(loss_mask[p]) and p - cu[s] + Bs <= lengths[s]  # a whole block inside

    gen = torch.Generator().manual_seed(0)
    draws = [draw(gen) for _ in range(20)]
    cands = [[p for p in range(cu[s], cu[s + 1]) if candidate(p, s)] for s in range(4)]
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


def test_partial_block_anchors_and_weights_of_the_hand_batch():
    """The default rule: an anchor needs loss_mask 1 at p and p+1 inside its sequence; its block may run
    past the end. Seq 0 (S=6, loss_mask 0 only at p=0) -> p in {1, 2, 3, 4} (p=5 has no p+1);
    seq 1 (loss_mask [1, 1, 0, 1]) -> p=0 only (p=1: loss_mask[2]=0; p=3: no p+1)."""
    batch, _, _ = hand_batch(partial_blocks=True)
    assert batch.anchor_tok.tolist() == [1, 2, 3, 4, 6, 6, 6, 6]
    assert batch.anchor_valid.tolist() == [True, True, True, True, True, False, False, False]
    w1 = math.exp(-1 / 2.0)
    weights = batch.weights.view(-1, B).tolist()
    # p=4 of seq 0: slot 1 is x[5] (the last token, a label now), slot 2 would be position 6: past the end
    assert weights[3] == pytest.approx([0.0, 1.0, 0.0])
    assert batch.labels.view(-1, B)[3, :2].tolist() == [14, 15]
    assert batch.block_pos.view(-1, B)[3].tolist() == [4, 5, 6]
    assert weights[2] == pytest.approx([0.0, 1.0, w1])  # p=3: whole block inside, as before
    assert weights[4] == pytest.approx([0.0, 1.0, 0.0])  # seq 1 p=0: slot 2 lands on loss_mask 0
    assert weights[5:] == [[0.0] * B] * 3  # padding


def test_a_response_shorter_than_a_block_trains_its_end_of_turn_token():
    """[prompt, answer, <eot>] with B=4: the whole-block rule finds no anchor at all; the default rule
    anchors at the answer and makes <eot> the slot-1 label with full weight."""
    ids = torch.tensor([5, 6, 7])  # 7 stands for the end-of-turn token
    loss_mask = torch.tensor([0, 1, 1], dtype=torch.uint8)
    common = dict(anchors_per_seq=2, block_size=4, mask_token_id=MASK, gamma=4.0)
    old = build_draft_batch(
        ids, loss_mask, torch.tensor([0, 3]), generator=torch.Generator(), partial_blocks=False, **common
    )
    assert not old.anchor_valid.any() and old.weights.sum() == 0
    new = build_draft_batch(ids, loss_mask, torch.tensor([0, 3]), generator=torch.Generator(), **common)
    assert new.anchor_tok.tolist() == [1, 0] and new.anchor_valid.tolist() == [True, False]
    assert new.block_ids.view(-1, 4)[0].tolist() == [6, MASK, MASK, MASK]
    assert new.labels.view(-1, 4)[0, 1].item() == 7
    assert new.weights.view(-1, 4).tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0] * 4]


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
        128, 128, 192, 192, 256, 256, 384, 512, 6144,
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
    arch = DrafterArch(32, 4, 2, 8, 64, 3, 2, 1e-6, 10000.0, layer_types=("sliding_attention", "full_attention",
                       "sliding_attention"), sliding_window=6)
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
    valid = batch.anchor_valid.repeat_interleave(4)
    torch.testing.assert_close(flex[valid], dense[valid], rtol=1e-5, atol=1e-5)
    assert (dense[valid] - no_window[valid]).abs().max() > 1e-3  # the window changes what layers see


@pytest.mark.slow
def test_compiled_flex_compiles_once_per_bucket_and_window_on_the_cpu(monkeypatch):
    """torch.compile(flex_attention) over 8 batches of varying lengths and sequence counts (one length
    bucket) builds one graph per layer kind, not one per batch, and gives the dense path's output.
    (The old per-batch mask closure over the batch's token count recompiled for every new length.)
    Forward only: FlexAttention has no CPU backward; tests/test_drafter_cuda.py trains on a GPU."""
    from torch._dynamo.utils import counters

    import consumer.model as cm

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(cm, "_flex_attention", lambda device_type: cm.compiled_flex_attention())
    torch.manual_seed(0)
    arch = DrafterArch(32, 4, 2, 8, 64, 2, 2, 1e-6, 1e6, layer_types=("sliding_attention", "full_attention"),
                       sliding_window=16)
    model = DFlashDrafter(arch, torch.randn(128, 32), torch.randn(128, 32))
    g = torch.Generator().manual_seed(0)
    shapes = set()
    for _ in range(8):
        lengths = torch.randint(5, 40, (int(torch.randint(1, 4, (), generator=g)),), generator=g).tolist()
        Tn = sum(lengths)
        batch = build_draft_batch(
            torch.randint(0, 120, (Tn,), generator=g), torch.ones(Tn, dtype=torch.uint8),
            torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]), anchors_per_seq=6, block_size=4,
            mask_token_id=127, gamma=4.0, generator=g,
        )
        shapes.add((Tn, batch.num_anchors))
        args = (torch.randn(Tn, 64), batch.ctx_pos, batch.block_ids, batch.block_pos)
        with torch.no_grad():
            flex = model(*args, attention_masks(batch, arch.attention_layers, 16, flex=True))
            dense = model(*args, attention_masks(batch, arch.attention_layers, 16, flex=False))
        valid = batch.anchor_valid.repeat_interleave(4)
        torch.testing.assert_close(flex[valid], dense[valid], rtol=1e-4, atol=1e-4)
    assert len(shapes) >= 6  # the batches really differ
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # full and sliding, once each
