"""dflash-eval --bench: several drafters side by side on the public benchmarks, one table and one JSON document.

Per benchmark, per prompt, per user turn (z-lab's loop, `dflash/benchmark.py` `_run_transformers`): the
turn is rendered with the chat template and `chat_template_kwargs`, the target decodes it plainly once,
then every drafter decodes it speculatively, interleaved so load changes hit all alike. The next turn's
context holds the plain decoding's text as the assistant reply (z-lab puts the speculative text there,
equal at temperature 0; the plain one keeps every drafter on the same prompts at T > 0 too). Each turn is
one response: τ is the mean over responses of each response's mean acceptance length, as z-lab reports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from evaluation.benchmarks import BenchPrompt, render
from evaluation.context_buckets import DEFAULT_EDGES, BucketTally, format_buckets
from evaluation.speculative import (
    Drafter,
    Generation,
    StopIds,
    TargetRunner,
    greedy_generate,
    speculative_generate,
)


@dataclass
class DrafterResult:
    """One drafter on one benchmark."""

    block_size: int
    responses: int
    generated_tokens: int
    tau: float  # mean over responses of each response's mean acceptance length
    tau_histogram: list[int]  # [k-1] = steps that committed k tokens, k = 1..B
    target_forwards_per_token: float
    seconds: float
    tokens_per_second: float
    speedup: float  # time per output token, plain ÷ speculative
    lossless: bool | None  # temperature 0: every response equals the plain one; None at T > 0
    mismatches: list[dict] = field(default_factory=list)  # {prompt, turn, position, plain, speculative}
    # τ by context length (evaluation/context_buckets.py): {label, low, high, steps, accepted, tau} per bucket
    context_buckets: list[dict] = field(default_factory=list)


@dataclass
class BenchmarkResult:
    prompts: int
    responses: int
    plain_tokens: int
    plain_seconds: float
    plain_tokens_per_second: float
    drafters: dict[str, DrafterResult]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class _Tally:
    def __init__(self, block_size: int, bucket_edges: Sequence[int] = DEFAULT_EDGES):
        self.block_size = block_size
        self.buckets = BucketTally(bucket_edges)
        self.hist = [0] * block_size
        self.taus: list[float] = []
        self.tokens = self.forwards = 0
        self.seconds = 0.0
        self.mismatches: list[dict] = []

    def add(self, g: Generation) -> None:
        self.tokens += len(g.tokens)
        self.forwards += g.target_forwards
        self.seconds += g.seconds
        for k in g.accept_lengths:
            self.hist[k - 1] += 1
        self.buckets.add(g.context_lengths, g.accept_lengths)
        if g.mean_accept is not None:
            self.taus.append(g.mean_accept)

    def result(self, responses: int, plain_tokens: int, plain_seconds: float, greedy: bool) -> DrafterResult:
        plain_tpot = plain_seconds / max(1, plain_tokens)
        tpot = self.seconds / max(1, self.tokens)
        return DrafterResult(
            block_size=self.block_size,
            responses=responses,
            generated_tokens=self.tokens,
            tau=sum(self.taus) / len(self.taus) if self.taus else 1.0,
            tau_histogram=self.hist,
            target_forwards_per_token=self.forwards / max(1, self.tokens),
            seconds=self.seconds,
            tokens_per_second=self.tokens / self.seconds if self.seconds > 0 else float("nan"),
            speedup=plain_tpot / tpot if tpot > 0 else float("nan"),
            lossless=(not self.mismatches) if greedy else None,
            mismatches=self.mismatches,
            context_buckets=[asdict(b) for b in self.buckets.buckets()],
        )


def run_benchmark(
    target: TargetRunner,
    drafters: dict[str, Drafter],
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[BenchPrompt],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    chat_template_kwargs: dict | None = None,
    stop_token_ids: StopIds = None,
    warmup: bool = True,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    bucket_edges: Sequence[int] = DEFAULT_EDGES,
) -> BenchmarkResult:
    """Every prompt's every turn: plain once, then each drafter. stop_token_ids None: the tokenizer's
    EOS (z-lab's `stop_token_ids=[tokenizer.eos_token_id]`)."""
    if not prompts:
        raise ValueError("run_benchmark: no prompts")
    kwargs = dict(chat_template_kwargs or {})
    stops = (
        [tokenizer.eos_token_id] if stop_token_ids is None and tokenizer.eos_token_id is not None else stop_token_ids
    )
    device = next(target.model.parameters()).device
    torch.manual_seed(seed)
    # one target, read at each drafter's own layers (a published drafter may fuse other layers than ours)
    runners = {
        name: target
        if list(getattr(d, "layer_ids", target.layer_ids)) == target.layer_ids
        else TargetRunner(target.model, d.layer_ids)
        for name, d in drafters.items()
    }
    if warmup:  # allocator and kernel set-up stay out of the timings
        ids = torch.tensor(render(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}], kwargs), device=device)
        greedy_generate(target, ids, min(8, max_new_tokens), stops, temperature)
        for name, d in drafters.items():
            speculative_generate(runners[name], d, ids, min(8, max_new_tokens), stops, temperature)
    tallies = {name: _Tally(d.block_size, bucket_edges) for name, d in drafters.items()}
    plain_tokens, plain_seconds, responses = 0, 0.0, 0
    for done, p in enumerate(prompts):
        if progress is not None:
            progress(done, len(prompts))
        messages: list[dict] = []
        for turn, text in enumerate(p.turns):
            messages.append({"role": "user", "content": text})
            ids = torch.tensor(render(tokenizer, messages, kwargs), device=device)
            plain = greedy_generate(target, ids, max_new_tokens, stops, temperature)
            plain_tokens += len(plain.tokens)
            plain_seconds += plain.seconds
            responses += 1
            for name, d in drafters.items():
                spec = speculative_generate(runners[name], d, ids, max_new_tokens, stops, temperature)
                tallies[name].add(spec)
                pos = first_difference(plain.tokens, spec.tokens) if temperature == 0.0 else None
                if pos is not None:
                    tallies[name].mismatches.append(
                        {
                            "prompt": p.index,
                            "turn": turn,
                            "position": pos,
                            "plain": plain.tokens[pos : pos + 8],
                            "speculative": spec.tokens[pos : pos + 8],
                        }
                    )
            messages.append({"role": "assistant", "content": tokenizer.decode(plain.tokens, skip_special_tokens=True)})
    return BenchmarkResult(
        prompts=len(prompts),
        responses=responses,
        plain_tokens=plain_tokens,
        plain_seconds=plain_seconds,
        plain_tokens_per_second=plain_tokens / plain_seconds if plain_seconds > 0 else float("nan"),
        drafters={n: t.result(responses, plain_tokens, plain_seconds, temperature == 0.0) for n, t in tallies.items()},
    )


def document(results: dict[str, BenchmarkResult], **settings) -> dict:
    """The JSON document: the settings (temperature, chat_template_kwargs, …) and every result."""
    return {
        **settings,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "benchmarks": {name: asdict(r) for name, r in results.items()},
    }


def _histogram_cell(hist: list[int]) -> str:
    """Share of steps per acceptance length 1..B, in percent (z-lab prints the same list)."""
    total = sum(hist) or 1
    return " ".join(f"{round(100 * n / total)}" for n in hist)


def format_table(results: dict[str, BenchmarkResult], temperature: float, chat_template_kwargs: dict) -> str:
    """One row per (benchmark, drafter); the histogram row under it gives % of steps accepting 1..B."""
    head = [
        f"temperature {temperature:g}, chat_template_kwargs {chat_template_kwargs or {}}",
        "tau: mean tokens per step (bonus included); speedup: time per token, plain / speculative;"
        " context length: prompt + generated tokens when the step drafts",
    ]
    cols = f"{'benchmark':<10} {'drafter':<14} {'resp':>5} {'tau':>6} {'tok/s':>8} {'plain':>8} {'speedup':>7} lossless"
    lines = [*head, cols, "-" * len(cols)]
    for bench, r in results.items():
        for name, d in r.drafters.items():
            lossless = "n/a" if d.lossless is None else ("yes" if d.lossless else f"NO ({len(d.mismatches)})")
            lines.append(
                f"{bench:<10} {name[:14]:<14} {d.responses:>5} {d.tau:>6.2f} {d.tokens_per_second:>8.1f}"
                f" {r.plain_tokens_per_second:>8.1f} {d.speedup:>6.2f}x {lossless}"
            )
            lines.append(
                f"{'':<10} {'':<14} accepted 1..{d.block_size} (% of steps): {_histogram_cell(d.tau_histogram)}"
            )
            lines.append(f"{'':<10} {'':<14} tau by context length (steps): {format_buckets(d.context_buckets)}")
    return "\n".join(lines)
