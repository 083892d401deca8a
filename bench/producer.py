"""The producer's target forward on the CPU: truncated capture vs a naive full forward, and the pipeline.

    .venv/bin/python -m bench.producer [--json] [--batches N] [--threads N]

Target: a random Qwen3 (hidden 256, 8 layers, 4 heads × 64, intermediate 768, vocab 16,384: the
vocabulary-to-hidden ratio of a real model, so the LM head costs what it costs there), fp32, sdpa; five
DFlash features → layers [1, 2, 3, 4, 5]. Data: synthetic multi-turn chats tokenized with the ChatML
template, packed by the batch plan (2,048 tokens a batch, max length 512).

- capture: producer.target (stops after layer 5, no LM head, features written into one buffer);
- naive: the full model on the same packed batch and mask, output_hidden_states=True and logits, features
  concatenated from hidden_states. Variants alternate over the same batches, `--repeats` times; each
  batch's fastest run counts (a shared machine only adds noise upward).
- per_sequence: the capture run once per sequence (plain causal attention each) instead of one forward
  with a block-diagonal mask; `packed_over_per_sequence` > 1 means the packed forward is faster.
- pipeline: background tokenizer (Prefetcher) + capture over the whole plan, as the producer runs it;
  `tokenize_stall_pct` is the share of the wall time the forward waited for a tokenized batch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer, write_jsonl
from producer.data import ChatEncoder, JsonlDataset
from producer.plan import BatchPlan
from producer.prefetch import Prefetcher, pack_batch
from producer.target import load_target

TOKENS_PER_BATCH = 2048
MAX_LENGTH = 512


def build_assets(root: Path, num_chats: int):
    tok = train_tokenizer(corpus_texts(synthetic_chats(200)), 2000, root / "tok")
    model_dir = build_tiny_target(
        root / "model", tok, hidden_size=256, num_layers=8, heads=4, kv_heads=2, head_dim=64,
        intermediate_size=768, vocab_size=16384,
    )  # fmt: skip
    data = write_jsonl(root / "chats.jsonl", synthetic_chats(num_chats, seed=1, max_turns=4, max_words=40))
    return tok, model_dir, data


def time_variants(cap, full, batches, per_sequence_batches: int, repeats: int) -> dict[str, float]:
    """Seconds per variant: the sum over batches of each batch's fastest of `repeats` alternating runs."""

    def per_sequence(b):
        out = torch.empty(b.num_tokens, cap.feature_width)
        for s, e in itertools.pairwise(b.cu_seqlens.tolist()):
            cap(b.input_ids[s:e], torch.tensor([0, e - s]), out=out[s:e])

    variants = {
        "capture": lambda b: cap(b.input_ids, b.cu_seqlens),
        "naive": lambda b: naive_forward(cap, full, b),
        "per_sequence": per_sequence,
    }
    best: dict[tuple[str, int], float] = {}
    for _ in range(repeats):
        for k, b in enumerate(batches):
            for name, run in variants.items():
                if name == "per_sequence" and k >= per_sequence_batches:
                    continue
                t0 = time.perf_counter()
                run(b)
                dt = time.perf_counter() - t0
                best[name, k] = min(best.get((name, k), dt), dt)
    totals = {name: sum(v for (n, _), v in best.items() if n == name) for name in variants}
    totals["packed"] = sum(best["capture", k] for k in range(min(per_sequence_batches, len(batches))))
    return totals


@torch.inference_mode()
def naive_forward(cap, full, b) -> torch.Tensor:
    ids = b.input_ids.view(1, -1)
    lengths = torch.diff(b.cu_seqlens.long())
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), lengths).view(1, -1)
    positions = torch.cat([torch.arange(int(n)) for n in lengths]).view(1, -1)
    mask = cap.packed_attention_mask(full.get_input_embeddings()(ids), seq_idx)
    out = full(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
    assert out.logits.shape[-1] == full.config.vocab_size
    return torch.cat([out.hidden_states[i + 1][0] for i in cap.layer_ids], dim=-1)


def run_pipeline(cap, ds, planned, depth: int) -> dict:
    tokens = 0
    with Prefetcher(ds, planned, depth=depth) as pf:
        start = time.perf_counter()
        while (b := pf.get(timeout=60)) is not None:
            cap(b.input_ids, b.cu_seqlens)
            tokens += b.num_tokens
        wall = time.perf_counter() - start
        return {"tokens": tokens, "wall_s": wall, "wait_s": pf.wait_s}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--batches", type=int, default=4, help="batches timed per variant")
    p.add_argument("--repeats", type=int, default=2, help="alternating runs per batch; the fastest counts")
    p.add_argument("--pipeline-batches", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    with tempfile.TemporaryDirectory(prefix="bench-producer-") as tmp:
        tok, model_dir, data = build_assets(Path(tmp), num_chats=600)
        t0 = time.perf_counter()
        ds = JsonlDataset(data, "chat", ChatEncoder(tok, MAX_LENGTH))
        index_s = time.perf_counter() - t0
        plan = BatchPlan(
            ds.lengths, seed=0, epochs=1, tokens_per_batch=TOKENS_PER_BATCH, length_group_window=8
        )
        cap = load_target(model_dir, num_features=5, dtype="float32", attn_implementation="sdpa")
        full = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        planned = list(plan.batches_from(0))
        reader = ds.reader()
        batches = [pack_batch(reader, pb) for pb in planned[: args.batches + 1]]
        reader.close()
        time_variants(cap, full, batches[:1], 1, repeats=1)  # warm-up
        timed = batches[1:]
        n_seq = max(1, args.batches // 3)
        best = time_variants(cap, full, timed, per_sequence_batches=n_seq, repeats=args.repeats)
        timed_tokens = sum(b.num_tokens for b in timed)
        seq_tokens = sum(b.num_tokens for b in timed[:n_seq])
        pipe_plan = BatchPlan(
            ds.lengths, seed=1, epochs=1, tokens_per_batch=TOKENS_PER_BATCH, length_group_window=8
        )
        pipe = run_pipeline(
            cap, ds, itertools.islice(pipe_plan.batches_from(0), args.pipeline_batches), depth=8
        )

    capture_tps = timed_tokens / best["capture"]
    naive_tps = timed_tokens / best["naive"]
    result = {
        "target": "qwen3 h256 L8 vocab16384 fp32 sdpa",
        "layer_ids": cap.layer_ids,
        "layers_run": cap.layers_run,
        "tokens_per_batch": TOKENS_PER_BATCH,
        "threads": args.threads,
        "capture_tokens_per_s": round(capture_tps, 1),
        "naive_tokens_per_s": round(naive_tps, 1),
        "ratio_capture_over_naive": round(capture_tps / naive_tps, 3),
        "packed_over_per_sequence": round(best["per_sequence"] / best["packed"], 3),
        "per_sequence_tokens_per_s": round(seq_tokens / best["per_sequence"], 1),
        "producer_tokens_per_s": round(pipe["tokens"] / pipe["wall_s"], 1),
        "tokenize_stall_pct": round(100 * pipe["wait_s"] / pipe["wall_s"], 3),
        "pipeline_tokens": pipe["tokens"],
        "index_tokens_per_s": round(ds.stats.tokens / index_s, 1),
    }
    print(
        f"capture {capture_tps:.0f} tok/s vs naive {naive_tps:.0f} tok/s:"
        f" ratio {result['ratio_capture_over_naive']:.2f} (runs {cap.layers_run} of 8 layers, no LM head)"
    )
    print(f"packed block-diagonal forward vs per-sequence loop: {result['packed_over_per_sequence']:.2f}x")
    print(
        f"pipeline: {result['producer_tokens_per_s']:.0f} tok/s,"
        f" tokenizer stall {result['tokenize_stall_pct']:.2f}% of wall time"
    )
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
