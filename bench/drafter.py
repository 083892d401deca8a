"""One drafter training step on the CPU: the chunked loss (decayed CE, D-PACE; DFlash1 and DFlash2) vs the full logits.

    .venv/bin/python -m bench.drafter [--json] [--quick] [--vocab V] [--variants a,b] [--mem-budget-gib G]

Shape (defaults): hidden 256, vocab 32,000, 8 sequences × 256 tokens, 128 anchors each = 1,024
anchors × block 16 = 16,384 query rows; 2 drafter layers; loss chunks of 2,048 rows. Every variant runs
on the same anchors (one DraftBatch), each step wired as the trainer wires it (bench/drafter_steps.py):
forward, the loss, backward, the normaliser, clip, AdamW step. Variants (--variants, default all):
`chunked` (DFlash1, consumer.loss.chunked_lm_head_loss, loss = "decay"), `naive` (the same with
full_logits_loss: the baseline), `dpace` (chunked, loss = "dpace"), `dflash2` (arch = "dflash2": the
chunked unary loss with its top-k, plus selector_loss; D-PACE, the default loss) and `dflash2_unary` (the
same drafter without the selector loss: dflash2 / dflash2_unary is the selector's cost, dflash2_unary /
dpace the convolutions').

Memory budget: at a real vocabulary the baseline's [Q, V] logits do not fit a small machine (16,384 rows ×
151,936 are 9.3 GiB, held 3× at its peak), so the run's peak is estimated from the shape before anything is
allocated (bench/drafter_memory.py) against --mem-budget-gib (default 8): when --anchors is not given, the
anchors are the most (up to 1,024, whole anchors per sequence) whose estimate fits, and the bench prints
the budget, the estimate and the anchors it chose; a shape given with --anchors that does not fit, or an
estimate above what the machine has available (/proc/meminfo), is refused in one line (exit 2). At vocab
151,936 the default budget gives 232 anchors (3,712 query rows), at 201,088 168 (2,688).

Peak memory, measured honestly: torch's profiler with profile_memory=True records every CPU tensor
allocation and free (size, time) made during the step; their running sum, from zero at the step's
start, peaks at the step's working memory (activations, logits, gradients, temporaries) above what
already lived. What already lived is the same for all (weights, the batch; with the Adam state it is
reported as `resident_mb`, DFlash2's as `resident_mb_dflash2`); DFlash1's Adam state is created inside its
first profiled step, the chunked one, so it counts against the chunked variant only; DFlash2 takes one
unprofiled step first (its codebooks' moments are 4·V·r·4 bytes: 622 MiB at V = 151,936), so its peaks are
steady-state. `peak_mem_ratio_naive_over_chunked` divides the two working-memory peaks; `peak_total_ratio`
adds the resident bytes to both; `peak_mem_ratio_A_over_B` for the other pairs. Each variant's estimate is
printed next to its measured peak. The count sees tensors, not the allocator's cached pages.
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
alternation (no profiler). `step_time_ratio_A_over_B` (chunked_over_naive, dpace_over_chunked,
dflash2_over_dpace, ...) is the median over the rounds of each round's A/B ratio (the steps of a round
share the machine's state, so a noisy neighbour moves both); the step times are the medians of each
variant's steps. `cpu_time_ratio_A_over_B` and `cpu_s_*` are the same for the process's CPU time
(time.process_time, all threads): on a machine shared with other jobs it moves less than the wall clock,
above all with OMP_NUM_THREADS=1 (no thread waits for another that was descheduled).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.drafter_memory import StepShape, anchors_that_fit, gib, mem_available, resident_bytes, run_bytes, step_bytes
from bench.drafter_steps import DEFAULTS, VARIANTS, dflash2_shape, make_step
from consumer.dflash2 import DFlash2Drafter
from consumer.model import DFlashDrafter, DrafterArch
from consumer.objective import anchor_budget, build_draft_batch, dense_mask

DEFAULT_ANCHORS = 1024
# (A, B) pairs whose step-time and peak-memory ratios A/B are reported when both ran
RATIOS = [
    ("dpace", "chunked"),
    ("dpace", "naive"),
    ("dflash2", "dpace"),
    ("dflash2", "naive"),
    ("dflash2", "dflash2_unary"),
    ("dflash2_unary", "dpace"),
]


def make_arch(args) -> DrafterArch:
    H = args.hidden
    return DrafterArch(
        hidden_size=H,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=3 * H,
        num_layers=args.layers,
        num_features=3,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
    )


def make_case(args, dflash2: bool = False):
    """The DFlash1 drafter (and DFlash2's, on the same frozen embedding and head), one batch, its mask, features."""
    torch.manual_seed(0)
    H, V, n = args.hidden, args.vocab, 3
    arch = make_arch(args)
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
    # built last: its modules' init draws from the global generator, which the batch above must not see move
    model2 = DFlash2Drafter(arch, dflash2_shape(args.block), embed, lm_head) if dflash2 else None
    return {"dflash1": model, "dflash2": model2}, batch, dense_mask(batch), features


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
        steps[name] = make_step(model, b, dense_mask(b), features, VARIANTS["chunked"], opt, chunk_rows=2048)
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


def refuse(message: str):
    """A shape this machine cannot run: one line on stderr, exit 2 (before anything large is allocated)."""
    print(f"bench.drafter: {message}", file=sys.stderr)
    raise SystemExit(2)


def plan_memory(args, names: list[str]) -> tuple[StepShape, str]:
    """The shape to run (anchors sized to the budget when --anchors is not given) and the line that says so;
    refuses (exit 2) a shape whose estimated peak is above the budget or what the machine has available."""
    kinds = [VARIANTS[n].memory for n in names]
    budget = int(args.mem_budget_gib * 2**30)
    shape = StepShape(
        hidden=args.hidden,
        vocab=args.vocab,
        layers=args.layers,
        tokens=args.seqs * args.seq_len,
        max_seqlen=args.seq_len,
        anchors=args.anchors or DEFAULT_ANCHORS,
        block=args.block,
        chunk_rows=args.chunk_rows,
        selector_rank=DEFAULTS["selector_rank"],
        selector_top_k=DEFAULTS["selector_top_k"],
    )
    need = run_bytes(shape, kinds)
    sized = ""
    if need > budget:
        fit = anchors_that_fit(shape, kinds, args.seqs, budget)
        logits = f"[{shape.rows} × {args.vocab}] float32 logits are {gib(shape.rows * args.vocab * 4)}"
        why = f"; the baseline's {logits}, held 3× at its peak" if "naive" in names else ""
        if args.anchors is not None or fit == 0:
            hint = f"--anchors {fit} fits it" if fit else f"even {args.seqs} anchors (one a sequence) do not fit"
            refuse(
                f"--anchors {shape.anchors} at vocab {args.vocab} needs an estimated {gib(need)}"
                f" ({','.join(names)}{why}), over the {gib(budget)} budget (--mem-budget-gib): {hint}"
            )
        sized = f"; {shape.anchors} anchors would need {gib(need)}{why}: sized to {fit}"
        shape = dataclasses.replace(shape, anchors=fit)
        need = run_bytes(shape, kinds)
    available = mem_available()
    if available is not None and need > available:
        refuse(
            f"the run needs an estimated {gib(need)} at {shape.anchors} anchors, vocab {args.vocab}, but only"
            f" {gib(available)} is available (/proc/meminfo MemAvailable): lower --mem-budget-gib or --anchors"
        )
    free = f", {gib(available)} available" if available is not None else ""
    return shape, f"memory: estimated peak {gib(need)} of the {gib(budget)} budget{free}{sized}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument(
        "--anchors", type=int, default=None, help=f"default: {DEFAULT_ANCHORS}, or the most that fit the budget"
    )
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--chunk-rows", type=int, default=2048)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--mem-budget-gib", type=float, default=8.0, help="the run's estimated peak must fit (default 8)")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5, quick 3)")
    ap.add_argument("--quick", action="store_true", help="3 timed rounds instead of 5 (short sequences: 1, not 3)")
    ap.add_argument("--no-short", action="store_true", help="skip the many-short-sequences case")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 5)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        ap.error(f"--variants: unknown {unknown or 'none given'}; choose from {','.join(VARIANTS)}")
    names = [n for n in VARIANTS if n in names]  # run order
    if args.anchors is not None and args.anchors < args.seqs:
        ap.error(f"--anchors must be at least --seqs ({args.seqs}: whole anchors per sequence), got {args.anchors}")
    shape, memory_line = plan_memory(args, names)
    args.anchors = shape.anchors
    print(memory_line, flush=True)

    drafters = {VARIANTS[n].drafter for n in names}
    models, batch, mask, features = make_case(args, dflash2="dflash2" in drafters)
    opts = {d: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for d, m in models.items() if d in drafters}
    steps = {
        n: make_step(models[v.drafter], batch, mask, features, v, opts[v.drafter], args.chunk_rows)
        for n, v in ((n, VARIANTS[n]) for n in names)
    }
    if "dflash2" in drafters:  # its moments exist before its first profiled step (steady-state peaks)
        steps[next(n for n in names if VARIANTS[n].drafter == "dflash2")]()
    peaks = {name: peak_bytes(step) for name, step in steps.items()}  # also each variant's warm-up
    resident = {}
    for d, opt in opts.items():
        adam_state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
        tensors = [*models[d].state_dict().values(), *adam_state, features]
        resident[d] = sum(t.numel() * t.element_size() for t in tensors)
    times: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    best = {name: statistics.median(ts) for name, ts in times.items()}

    def ratio(a, b, of=times):
        return statistics.median(x / y for x, y in zip(of[a], of[b], strict=True))

    T, Q = batch.num_tokens, batch.num_anchors * batch.block_size
    estimates = {n: step_bytes(shape, VARIANTS[n].memory) for n in names}
    result = {}
    if {"chunked", "naive"} <= set(names):
        res1 = resident["dflash1"]
        result |= {
            "peak_mem_ratio_naive_over_chunked": peaks["naive"] / peaks["chunked"],
            "step_time_ratio_chunked_over_naive": ratio("chunked", "naive"),
            "step_time_ratio_rounds": [round(c / n, 3) for c, n in zip(times["chunked"], times["naive"], strict=True)],
            "peak_total_ratio": (peaks["naive"] + res1) / (peaks["chunked"] + res1),
            "cpu_time_ratio_chunked_over_naive": ratio("chunked", "naive", cpu),
        }
    if "chunked" in names:
        result |= {"drafter_tokens_per_s": T / best["chunked"], "query_rows_per_s": Q / best["chunked"]}
    for a, b in RATIOS:
        if {a, b} <= set(names):
            result[f"step_time_ratio_{a}_over_{b}"] = ratio(a, b)
            result[f"cpu_time_ratio_{a}_over_{b}"] = ratio(a, b, cpu)
            result[f"peak_mem_ratio_{a}_over_{b}"] = peaks[a] / peaks[b]
    for name in names:
        result[f"peak_mb_{name}"] = peaks[name] / 2**20
        result[f"est_peak_mb_{name}"] = estimates[name] / 2**20
        result[f"step_s_{name}"] = best[name]
        result[f"cpu_s_{name}"] = statistics.median(cpu[name])
    if "dflash1" in resident:
        result["resident_mb"] = resident["dflash1"] / 2**20
    if "dflash2" in resident:
        result["resident_mb_dflash2"] = resident["dflash2"] / 2**20
    result |= {
        "est_resident_mb": resident_bytes(shape, "dflash2" in drafters) / 2**20,
        "est_run_gib": run_bytes(shape, [VARIANTS[n].memory for n in names]) / 2**30,
        "mem_budget_gib": args.mem_budget_gib,
        "vocab": args.vocab,
        "anchors": batch.num_anchors,
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
        print(
            f"  {name:13s} peak step memory {peaks[name] / 2**20:8.1f} MiB (estimated {estimates[name] / 2**20:8.1f})"
            f"   step {best[name]:6.2f} s   {VARIANTS[name].about}"
        )
    if "peak_mem_ratio_naive_over_chunked" in result:
        print(
            f"  peak memory naive/chunked {result['peak_mem_ratio_naive_over_chunked']:.2f}x"
            f" (with {resident['dflash1'] / 2**20:.0f} MiB resident: {result['peak_total_ratio']:.2f}x),"
            f" step time chunked/naive {result['step_time_ratio_chunked_over_naive']:.3f}"
            f" (cpu {result['cpu_time_ratio_chunked_over_naive']:.3f}),"
            f" {result['drafter_tokens_per_s']:.0f} tokens/s"
        )
    pairs = [(a, b) for a, b in RATIOS if {a, b} <= set(names)]
    if pairs:
        print(
            "  "
            + ", ".join(
                f"{a}/{b} step {result[f'step_time_ratio_{a}_over_{b}']:.3f}"
                f" (cpu {result[f'cpu_time_ratio_{a}_over_{b}']:.3f}) peak {result[f'peak_mem_ratio_{a}_over_{b}']:.2f}"
                for a, b in pairs
            )
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
