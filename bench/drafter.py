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
Time: the profiled steps double as warm-ups; then `repeats` rounds of one timed step per variant, in
alternation (no profiler). `step_time_ratio_chunked_over_naive` is the median over the rounds of each
round's chunked/naive ratio (the two steps of a round share the machine's state, so a noisy neighbour
moves both); the step times are the medians of each variant's steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from consumer.loss import chunked_lm_head_loss, full_logits_loss
from consumer.model import DFlashDrafter, DrafterArch
from consumer.objective import build_draft_batch, dense_mask


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
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
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
    ap.add_argument("--quick", action="store_true", help="3 timed rounds instead of 5")
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
    resident = sum(
        t.numel() * t.element_size() for t in [*model.state_dict().values(), *adam_state, features]
    )
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
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
