"""dflash-eval: trained or published drafters against their target, by real speculative decoding.

    dflash-eval --target TARGET --drafter CKPT [--drafter NAME=CKPT ...] --bench gsm8k,mt-bench,FILE.jsonl
                [--num-prompts N] [--max-new-tokens N] [--temperature T] [--thinking on|off] [--output R.json]
                [--context-buckets 1024,4096,16384]
    dflash-eval --server URL --target TARGET --bench ...          a serving engine's own figures (eval_server)
    dflash-eval --target TARGET --drafter CKPT --prompts PROMPTS.jsonl [--limit N] [--json]

CKPT is an export directory (config.json + model.safetensors, ours or z-lab's layout) or a checkpoint root
holding `latest`. --bench runs the public benchmarks with z-lab's prompt construction (evaluation/benchmarks.py)
and prints one row per benchmark and drafter (evaluation/side_by_side.py). --prompts is the single-drafter
report on one's own chat records. At temperature 0 every speculative output must equal the plain one token
for token; any difference is a failure and the exit status is 1. Bad input exits 2 with one line. Both report
τ by context length (prompt + generated tokens when a step drafts; evaluation/context_buckets.py) in the
buckets the edges of --context-buckets make (default <1K, 1K–4K, 4K–16K, ≥16K).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoTokenizer

from evaluation.benchmarks import BENCHMARKS, BenchmarkDataError, load_benchmark
from evaluation.block_size import check_block_size
from evaluation.context_buckets import DEFAULT_EDGES, check_edges
from evaluation.evaluate import DTYPES, format_report, load_drafter, load_target, resolve_export_dir, run_eval
from evaluation.server import ServerError


def drafter_arg(arg: str) -> tuple[str, str]:
    """--drafter NAME=PATH or PATH (named after the directory; a checkpoint root's own name)."""
    name, sep, path = arg.partition("=")
    if sep and name and not Path(arg).exists():
        return name, path
    p = Path(arg)
    return (p.parent.name if p.name in ("latest", "best") else p.name) or arg, arg


def context_edges(text: str) -> tuple[int, ...]:
    """--context-buckets 1024,4096,16384 -> the edges (ValueError naming the option when malformed)."""
    try:
        return check_edges([int(e) for e in text.split(",") if e.strip()])
    except ValueError as err:
        raise ValueError(f"--context-buckets {text}: {err}") from None


def chat_kwargs(thinking: str, extra: str | None) -> dict:
    """chat_template_kwargs: enable_thinking from --thinking (z-lab's default: off), then the JSON object."""
    kwargs: dict = {"enable_thinking": thinking == "on"}
    if extra:
        try:
            more = json.loads(extra)
        except json.JSONDecodeError as err:
            raise ValueError(f"--chat-template-kwargs: not JSON ({err.msg})") from None
        if not isinstance(more, dict):
            raise ValueError("--chat-template-kwargs: must be a JSON object")
        kwargs.update(more)
    return kwargs


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dflash-eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="target model directory (HF format, local); for --server: its tokenizer")
    ap.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="[NAME=]CKPT",
        help="drafter export directory (ours or z-lab's layout) or checkpoint root; repeat to compare",
    )
    ap.add_argument(
        "--bench",
        help="comma list of " + ", ".join(BENCHMARKS) + ", NAME=PATH (local copy in the"
        " dataset's schema) or FILE.jsonl (own prompts)",
    )
    ap.add_argument("--prompts", help="single-drafter report on a JSONL of chat records or {'prompt': ...}")
    ap.add_argument("--server", metavar="URL", help="an OpenAI-compatible SGLang or vLLM server running DFlash")
    ap.add_argument("--engine", choices=["auto", "sglang", "vllm"], default="auto")
    ap.add_argument("--model", help="--server with vLLM: the served model name (default: the first listed)")
    ap.add_argument(
        "--num-prompts",
        "--limit",
        dest="num_prompts",
        type=int,
        default=None,
        help="prompts per benchmark (z-lab's choice of records: random.seed(0) then a shuffle)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 2048 for --bench (z-lab's), 128 else")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=None, help="--server: default 1 at temperature 0, else -1 (off)")
    ap.add_argument(
        "--thinking",
        choices=["on", "off"],
        default="off",
        help="chat_template_kwargs enable_thinking (z-lab's default: off)",
    )
    ap.add_argument("--chat-template-kwargs", help="a JSON object merged into chat_template_kwargs")
    ap.add_argument("--seed", type=int, default=0, help="torch seed for sampling (temperature > 0)")
    ap.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="the block size to serve the drafters at; it must be the one each was trained with (the default)",
    )
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument(
        "--context-buckets",
        default=",".join(str(e) for e in DEFAULT_EDGES),
        metavar="EDGES",
        help="comma list of context-length bucket edges in tokens (default %(default)s: <1K, 1K-4K, 4K-16K, >=16K)",
    )
    ap.add_argument("--output", help="write the JSON document here")
    ap.add_argument("--json", action="store_true", help="print the JSON document as one line, last")
    return ap


def _emit(doc: dict, text: str, args) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc))


def _bench_main(args, kwargs: dict) -> int:
    from evaluation.side_by_side import document, format_table, run_benchmark

    if not args.drafter:
        raise ValueError("--bench needs at least one --drafter (or --server URL)")
    benches = [load_benchmark(b.strip(), args.num_prompts) for b in args.bench.split(",") if b.strip()]
    named = [drafter_arg(d) for d in args.drafter]
    drafters = {name: load_drafter(path, args.target, args.dtype, args.device) for name, path in named}
    if len(drafters) != len(named):
        raise ValueError("--drafter: two drafters share a name; give them NAME=CKPT")
    target = load_target(args.target, next(iter(drafters.values())).layer_ids, args.dtype, args.device)
    tokenizer = AutoTokenizer.from_pretrained(str(args.target), local_files_only=True)
    max_new = args.max_new_tokens or 2048
    results = {}
    for name, prompts in benches:

        def progress(done: int, total: int, name: str = name) -> None:  # long runs say where they are
            if done % 16 == 0:
                print(f"dflash-eval: {name}: {done}/{total} prompts", file=sys.stderr, flush=True)

        results[name] = run_benchmark(
            target,
            drafters,
            tokenizer,
            prompts,
            max_new_tokens=max_new,
            temperature=args.temperature,
            chat_template_kwargs=kwargs,
            seed=args.seed,
            progress=progress,
            bucket_edges=args.edges,
        )
    doc = document(
        results,
        target=str(args.target),
        drafters=dict(named),
        temperature=args.temperature,
        max_new_tokens=max_new,
        num_prompts=args.num_prompts,
        chat_template_kwargs=kwargs,
    )
    _emit(doc, format_table(results, args.temperature, kwargs), args)
    bad = [(b, n) for b, r in results.items() for n, d in r.drafters.items() if d.lossless is False]
    if bad:
        print(f"dflash-eval: FAILED: speculative output differs from plain decoding for {bad}", file=sys.stderr)
        return 1
    return 0


def _server_main(args, kwargs: dict) -> int:
    from evaluation.server import format_server, run_server

    if not args.bench:
        raise ValueError("--server needs --bench (the prompts to send)")
    tokenizer = AutoTokenizer.from_pretrained(str(args.target), local_files_only=True) if args.target else None
    max_new = args.max_new_tokens or 2048
    results, texts = {}, []
    for b in args.bench.split(","):
        name, prompts = load_benchmark(b.strip(), None)
        prompts = prompts[: args.num_prompts]  # z-lab's server path: the first N records, first turns
        r = run_server(
            args.server,
            prompts,
            engine=args.engine,
            tokenizer=tokenizer,
            model=args.model,
            max_new_tokens=max_new,
            temperature=args.temperature,
            top_k=args.top_k,
            chat_template_kwargs=kwargs,
        )
        results[name] = asdict(r)
        texts.append(format_server(name, r))
    doc = {
        "server": args.server,
        "temperature": args.temperature,
        "max_new_tokens": max_new,
        "chat_template_kwargs": kwargs,
        "benchmarks": results,
    }
    _emit(doc, "\n".join(texts), args)
    return 0


def _prompts_main(args) -> int:
    if len(args.drafter) != 1 or not args.target:
        raise ValueError("--prompts takes --target and exactly one --drafter (use --bench FILE.jsonl to compare)")
    report = run_eval(
        args.target,
        args.drafter[0],
        args.prompts,
        limit=args.num_prompts,
        max_new_tokens=args.max_new_tokens or 128,
        dtype=args.dtype,
        device=args.device,
        bucket_edges=args.edges,
    )
    print(format_report(report, Path(args.drafter[0]).name), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report.to_dict()))
    if not report.lossless:
        print(
            f"dflash-eval: FAILED: speculative output differs from plain greedy on {len(report.mismatches)} prompt(s)",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if sum(x is not None for x in (args.prompts, args.bench)) != 1:
            raise ValueError("give one of --bench LIST or --prompts FILE")
        if not args.server and not args.target:
            raise ValueError("--target is required (the target model directory)")
        if not args.temperature >= 0.0:
            raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
        kwargs = chat_kwargs(args.thinking, args.chat_template_kwargs)
        args.edges = context_edges(args.context_buckets)  # the arguments first, then the folders they name
        for _, path in map(drafter_arg, args.drafter or []):  # another block than the trained one: refused
            check_block_size(resolve_export_dir(path), args.block_size)
        if args.server:
            return _server_main(args, kwargs)
        return _bench_main(args, kwargs) if args.bench else _prompts_main(args)
    except (BenchmarkDataError, ServerError, FileNotFoundError, ValueError, KeyError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"dflash-eval: {msg}", file=sys.stderr)
        return 2
