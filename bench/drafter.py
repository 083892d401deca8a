"""One drafter training step on the CPU: chunked lm_head + weighted CE vs the naive full-logits loss.

    .venv/bin/python -m bench.drafter [--json] [--quick] [--layers N] [--repeats N]

Shape (defaults): hidden 256, vocab 32,000, 8 sequences × 256 tokens, 128 anchors each = 1,024
anchors × block 16 = 16,384 query rows; 2 drafter layers; loss chunks of 2,048 rows. Both variants
run the same model on the same anchors (one DraftBatch): forward, backward, AdamW step; only the loss
call differs (consumer.loss.chunked_lm_head_loss vs full_logits_loss).

Peak memory, measured honestly: torch's profiler with profile_memory=True records every CPU tensor
allocation and free (size, time) made during the step; their running sum, from zero at the step's
start, peaks at the step's working memory (activations, logits, gradients, temporaries) above what
already lived. What already lived is the same for both (weights, the batch; with the Adam state it is
reported as `resident_mb`); the Adam state is created inside the first profiled step, the chunked
one, so it counts against the chunked variant only. `peak_mem_ratio_naive_over_chunked` divides the
two working-memory peaks; `peak_total_ratio` adds the resident bytes to both. The count sees tensors,
not the allocator's cached pages.
Many short sequences (`short_*` keys; --no-short skips it): 100 sequences × 160 tokens (a 32-token
prompt each), anchors_per_seq 512, block 16, on a smaller drafter (hidden 64, vocab 2,048, 1 layer: the
old step runs 819,200 query rows). Three steps on the same batch, timed in alternation: `old` = the
anchors before the batch budget (nseq × 512, padding anchors included, rebuilt here by padding the real
anchors out to that count: the padding rows cost what they cost then), `no_cut` = every real anchor (a
budget above the candidates), `new` = the default budget (consumer.objective.anchor_budget of the batch's
tokens). `rows_per_candidate` = the new step's query rows ÷ (B × candidate positions);
`short_seqs_step_speedup` = old step time ÷ new, `short_seqs_step_speedup_no_cut` = old ÷ no_cut (padding
removed, nothing cut).
Time: the profiled steps double as warm-ups; then `repeats` rounds of one timed step per variant, in
alternation (no profiler). `step_time_ratio_chunked_over_naive` is the median over the rounds of each
round's chunked/naive ratio (the two steps of a round share the machine's state, so a noisy neighbour
moves both); the step times are the medians of each variant's steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from consumer.loss import chunked_lm_head_loss, full_logits_loss
from consumer.model import DFlashDrafter, DrafterArch
from consumer.objective import anchor_budget, build_draft_batch, dense_mask


def make_case(args):
    torch.manual_seed(0)
    H, V, n = args.hidden, args.vocab, 3
    arch = DrafterArch(
        hidden_size=H,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=3 * H,
        num_layers=args.layers,
        num_features=n,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
    )
    embed, lm_head = torch.randn(V, H) * 0.5, torch.randn(V, H) * 0.5
    model = DFlashDrafter(arch, embed, lm_head)
    T = args.seqs * args.seq_len
    input_ids = torch.randint(0, V - 1, (T,))
    loss_mask = torch.ones(T, dtype=torch.uint8)
    for s in range(args.seqs):
        loss_mask[s * args.seq_len : s * args.seq_len + 32] = 0  # a 32-token prompt per sequence
    cu = torch.arange(args.seqs + 1, dtype=torch.int32) * args.seq_len
    batch = build_draft_batch(
        input_ids,
        loss_mask,
        cu,
        anchors_per_seq=args.anchors // args.seqs,
        block_size=args.block,
        mask_token_id=V - 1,
        gamma=7.0,
        generator=torch.Generator().manual_seed(0),
    )
    features = torch.randn(T, n * H)
    return model, batch, dense_mask(batch), features


def with_padding_anchors(batch, total: int, mask_token_id: int):
    """The batch with padding anchors appended up to `total` (at packed 0: they see only their own block and
    carry no loss), as the per-sequence anchor count ran them before the batch budget."""
    pad, B = total - batch.num_anchors, batch.block_size
    tok = batch.anchor_tok
    return dataclasses.replace(
        batch,
        anchor_tok=torch.cat([tok, tok.new_zeros(pad)]),
        anchor_seq=torch.cat([batch.anchor_seq, tok.new_zeros(pad)]),
        block_ids=torch.cat([batch.block_ids, batch.block_ids.new_full((pad * B,), mask_token_id)]),
        block_pos=torch.cat([batch.block_pos, torch.arange(B).repeat(pad)]),
        labels=torch.cat([batch.labels, batch.labels.new_zeros(pad * B)]),
        weights=torch.cat([batch.weights, batch.weights.new_zeros(pad * B)]),
    )


def short_sequences_case(repeats: int, seqs: int = 100, seq_len: int = 160, per_seq: int = 512, block: int = 16):
    """Old (per-sequence anchors, padding included) vs new (batch budget) steps on one batch of short sequences."""
    torch.manual_seed(0)
    H, V = 64, 2048
    arch = DrafterArch(
        hidden_size=H,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=2 * H,
        num_layers=1,
        num_features=3,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
    )
    model = DFlashDrafter(arch, torch.randn(V, H) * 0.5, torch.randn(V, H) * 0.5)
    T = seqs * seq_len
    input_ids = torch.randint(0, V - 1, (T,))
    loss_mask = (torch.arange(T) % seq_len >= 32).to(torch.uint8)  # a 32-token prompt per sequence
    cu = torch.arange(seqs + 1, dtype=torch.int32) * seq_len
    features = torch.randn(T, 3 * H)

    def batch_with(budget):
        return build_draft_batch(
            input_ids,
            loss_mask,
            cu,
            anchors_per_seq=per_seq,
            block_size=block,
            mask_token_id=V - 1,
            gamma=7.0,
            generator=torch.Generator().manual_seed(0),
            max_anchors=budget,
        )

    every = batch_with(None)
    budget = anchor_budget(T, None, per_seq)
    batches = {"old": with_padding_anchors(every, seqs * per_seq, V - 1), "no_cut": every, "new": batch_with(budget)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    steps = {}
    for name, b in batches.items():
        loss = functools.partial(
            chunked_lm_head_loss, lm_head=model.lm_head, labels=b.labels, weights=b.weights, chunk_rows=2048
        )
        steps[name] = make_step(model, b, dense_mask(b), features, loss, opt)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up
    for _ in range(repeats):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    rows = {name: b.num_anchors * block for name, b in batches.items()}
    return {
        "rows_per_candidate": rows["new"] / (block * every.num_candidates),
        "short_seqs_step_speedup": statistics.median(o / n for o, n in zip(times["old"], times["new"], strict=True)),
        "short_seqs_step_speedup_no_cut": statistics.median(
            o / n for o, n in zip(times["old"], times["no_cut"], strict=True)
        ),
        "short_seqs_rows": rows,
        "short_seqs_step_s": {name: statistics.median(ts) for name, ts in times.items()},
        "short_seqs_candidates": every.num_candidates,
        "short_seqs_anchor_budget": budget,
    }


def make_step(model, batch, mask, features, loss_fn, opt):
    weight_sum = batch.weights.sum()

    def step():
        h = model(features, batch.ctx_pos, batch.block_ids, batch.block_pos, mask)
        loss_sum, _correct = loss_fn(h)
        (loss_sum / weight_sum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def peak_bytes(fn) -> int:
    """Peak of the running sum of tensor allocations minus frees recorded while fn runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=1024)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--chunk-rows", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5, quick 3)")
    ap.add_argument("--quick", action="store_true", help="3 timed rounds instead of 5 (short sequences: 1, not 3)")
    ap.add_argument("--no-short", action="store_true", help="skip the many-short-sequences case")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 5)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")

    model, batch, mask, features = make_case(args)
    lm_head, labels, weights = model.lm_head, batch.labels, batch.weights
    losses = {
        "chunked": lambda h: chunked_lm_head_loss(h, lm_head, labels, weights, args.chunk_rows),
        "naive": lambda h: full_logits_loss(h, lm_head, labels, weights),
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    steps = {name: make_step(model, batch, mask, features, fn, opt) for name, fn in losses.items()}
    peaks = {name: peak_bytes(step) for name, step in steps.items()}  # also each variant's warm-up
    adam_state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    resident = sum(t.numel() * t.element_size() for t in [*model.state_dict().values(), *adam_state, features])
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    best = {name: statistics.median(ts) for name, ts in times.items()}
    ratio = statistics.median(c / n for c, n in zip(times["chunked"], times["naive"], strict=True))
    T, Q = batch.num_tokens, batch.num_anchors * batch.block_size
    result = {
        "peak_mem_ratio_naive_over_chunked": peaks["naive"] / peaks["chunked"],
        "step_time_ratio_chunked_over_naive": ratio,
        "step_time_ratio_rounds": [round(c / n, 3) for c, n in zip(times["chunked"], times["naive"], strict=True)],
        "drafter_tokens_per_s": T / best["chunked"],
        "query_rows_per_s": Q / best["chunked"],
        "peak_total_ratio": (peaks["naive"] + resident) / (peaks["chunked"] + resident),
        "peak_mb_chunked": peaks["chunked"] / 2**20,
        "peak_mb_naive": peaks["naive"] / 2**20,
        "resident_mb": resident / 2**20,
        "step_s_chunked": best["chunked"],
        "step_s_naive": best["naive"],
        "tokens": T,
        "query_rows": Q,
        "layers": args.layers,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
    }
    print(
        f"one step, {T} tokens, {Q} query rows ({batch.num_anchors} anchors × {args.block}), "
        f"hidden {args.hidden}, vocab {args.vocab}, {args.layers} layer(s), {torch.get_num_threads()} threads"
    )
    for name in steps:
        print(f"  {name:8s} peak step memory {peaks[name] / 2**20:8.1f} MiB   step {best[name]:6.2f} s")
    print(
        f"  peak memory naive/chunked {result['peak_mem_ratio_naive_over_chunked']:.2f}x"
        f" (with {resident / 2**20:.0f} MiB resident: {result['peak_total_ratio']:.2f}x),"
        f" step time chunked/naive {result['step_time_ratio_chunked_over_naive']:.3f},"
        f" {result['drafter_tokens_per_s']:.0f} tokens/s"
    )
    if not args.no_short:
        short = short_sequences_case(1 if args.quick else 3)
        result.update(short)
        rows, secs = short["short_seqs_rows"], short["short_seqs_step_s"]
        print(
            f"many short sequences (100 × 160 tokens, 512 anchors per sequence asked, block 16):"
            f" query rows old {rows['old']} / every anchor {rows['no_cut']} / budget {rows['new']};"
            f" rows per candidate {short['rows_per_candidate']:.3f}; step old {secs['old']:.2f} s,"
            f" every anchor {secs['no_cut']:.2f} s, budget {secs['new']:.2f} s: speedup"
            f" {short['short_seqs_step_speedup']:.1f}x ({short['short_seqs_step_speedup_no_cut']:.1f}x without the cut)"
        )
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
