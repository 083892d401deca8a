"""Regenerate the assistant answers of a chat dataset with the target itself (the paper's training data).

The drafter learns the target's own distribution, so each prompt's last assistant turn (if any) is dropped
and the target answers instead. Prompts are read from any data file the producer reads (JSONL, ShareGPT,
Parquet, Arrow). The output is chat JSONL; every record also carries `prompt_line` (the input line, or
table row, it answers) and `finish` ("stop" at EOS, "length" at max_new_tokens).

Two engines: `--target DIR` runs transformers' generate in this process (small jobs); `--server URL` sends
the prompts to an OpenAI-compatible server (vLLM, SGLang, `transformers serve`) with N requests in flight
(producer/regenerate_server.py). Both write the same records and resume the same way.

Local path: resumable: each record is appended with one write on an O_APPEND descriptor and fsynced per batch; on start
a truncated last line (a crash mid-write) is cut off and prompts already written are skipped. Prompts are
batched by their position in the input, never by what is left to do, and sampling is seeded per batch, so a
resumed run recomputes exactly the batches an uninterrupted one would and writes the same file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from producer.data import DataError, Format, Message, iter_messages, location, open_dataset_file
from producer.regenerate_server import (
    ServerError,
    ServerOptions,
    ServerStats,
    check_options,
    regenerate_via_server,
)
from producer.target import DTYPES, GENERATE_ORDER, TargetLoadError, choose_attn_implementation
from producer.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class RegenerateStats:
    prompts: int = 0  # usable prompts in the input
    already_done: int = 0  # found in the output at start
    written: int = 0  # written by this run
    new_tokens: int = 0
    seconds: float = 0.0


def iter_prompts(path: Path, fmt: Format = "chat") -> Iterator[tuple[int, list[Message]]]:
    """(input line or row, conversation without its last assistant turn) for every usable record."""
    records = iter_messages(path, fmt, require_assistant=False)  # opens now: a bad path fails here

    def prompts() -> Iterator[tuple[int, list[Message]]]:
        for number, messages in records:
            if messages[-1]["role"] == "assistant":
                messages = messages[:-1]
            if not messages:
                log.warning("%s: skipped record: nothing left to prompt with", location(path, number))
                continue
            yield number, messages

    return prompts()


def completed_lines(out_path: Path) -> set[int]:
    """`prompt_line`s already in the output; a trailing partial or unparsable line is cut off first."""
    if not out_path.exists():
        return set()
    data = out_path.read_bytes()
    keep = data.rfind(b"\n") + 1  # end of the last complete line
    done = set()
    for line in data[:keep].splitlines():
        try:
            done.add(int(json.loads(line)["prompt_line"]))
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{out_path}: an existing line is not a regenerated record; refusing to append") from None
    if keep < len(data):
        log.warning("%s: dropping a truncated last line (%d bytes) before resuming", out_path, len(data) - keep)
        with out_path.open("r+b") as f:
            f.truncate(keep)
    return done


def load_generator(target_dir: Path, dtype: str, device: str, attn_implementation: str):
    if not (target_dir / "config.json").is_file():
        raise TargetLoadError(f"{target_dir}: no config.json (not a local model directory)")
    tokenizer = load_tokenizer(target_dir, padding_side="left")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{target_dir}: the tokenizer has no chat template")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
        model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (OSError, ValueError, KeyError) as err:
        raise TargetLoadError(f"{target_dir}: not a causal LM transformers can generate with: {err}") from err
    # "auto": the model's own choice among what it supports (gemma2 has no sdpa: its soft-capping is eager's)
    attn = choose_attn_implementation(model_cls, attn_implementation, device, GENERATE_ORDER)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            target_dir, local_files_only=True, dtype=DTYPES[dtype], attn_implementation=attn
        )
    except OSError as err:
        raise TargetLoadError(f"{target_dir}: cannot load the target: {err}") from err
    return tokenizer, model.requires_grad_(False).eval().to(device)


def regenerate(
    target_dir: str | Path,
    prompts_jsonl: str | Path,
    out_jsonl: str | Path,
    batch_size: int = 8,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    dtype: str = "bfloat16",
    device: str = "cpu",
    attn_implementation: str = "auto",
    chat_template_kwargs: dict[str, Any] | None = None,
    fmt: Format = "chat",
) -> RegenerateStats:
    """Answer every prompt of `prompts_jsonl` with the target into `out_jsonl`; temperature 0 is greedy."""
    target_dir, prompts_path, out_path = Path(target_dir), Path(prompts_jsonl), Path(out_jsonl)
    prompts = list(iter_prompts(prompts_path, fmt))
    done = completed_lines(out_path)
    stats = RegenerateStats(prompts=len(prompts), already_done=sum(n in done for n, _ in prompts))
    tokenizer, model = load_generator(target_dir, dtype, device, attn_implementation)
    stop_ids = sorted(_stop_ids(tokenizer, model))
    gen_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_p=top_p if temperature > 0 else None,
        top_k=None,
        eos_token_id=stop_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    start = time.perf_counter()
    try:
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first : first + batch_size]
            if all(n in done for n, _ in batch):
                continue
            torch.manual_seed(seed * 1_000_003 + first // batch_size)  # sampling depends on the batch only
            answers = _generate(
                tokenizer, model, [m for _, m in batch], gen_config, set(stop_ids), chat_template_kwargs or {}
            )
            for (line_no, messages), (text, n_new, finish) in zip(batch, answers, strict=True):
                stats.new_tokens += n_new
                if line_no in done:
                    continue
                record = {
                    "messages": [*messages, {"role": "assistant", "content": text}],
                    "prompt_line": line_no,
                    "finish": finish,
                }
                os.write(fd, (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
                stats.written += 1
            os.fsync(fd)
            stats.seconds = time.perf_counter() - start
            finished = stats.already_done + stats.written
            print(
                f"regenerate: {finished}/{stats.prompts} prompts,"
                f" {stats.new_tokens / max(stats.seconds, 1e-9):.1f} new tokens/s",
                flush=True,
            )
    finally:
        os.close(fd)
    return stats


def _stop_ids(tokenizer, model) -> set[int]:
    """The tokenizer's EOS plus any the model's generation config lists (e.g. <|im_end|> and <|endoftext|>)."""
    ids = {tokenizer.eos_token_id}
    configured = model.generation_config.eos_token_id
    ids.update(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    return ids


@torch.inference_mode()
def _generate(
    tokenizer,
    model,
    conversations: list[list[Message]],
    gen_config: GenerationConfig,
    stop_ids: set[int],
    template_kwargs: dict[str, Any],
):
    """→ [(answer text, new tokens up to and including EOS, "stop" | "length")] for a batch of prompts."""
    texts = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True, **template_kwargs)
        for c in conversations
    ]
    enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt").to(model.device)
    out = model.generate(**enc, generation_config=gen_config)
    new = out[:, enc["input_ids"].shape[1] :].tolist()
    answers = []
    for tokens in new:
        end = next((k for k, t in enumerate(tokens) if t in stop_ids), None)
        if end is not None:
            tokens, finish = tokens[: end + 1], "stop"
        else:
            finish = "length"
        answers.append((tokenizer.decode(tokens, skip_special_tokens=True), len(tokens), finish))
    return answers


def regenerate_server(
    prompts_path: str | Path,
    out_jsonl: str | Path,
    opts: ServerOptions,
    fmt: Format = "chat",
    transport: httpx.AsyncBaseTransport | None = None,
) -> ServerStats:
    """Answer every prompt not yet in `out_jsonl` through the server; see producer/regenerate_server.py."""
    check_options(opts)
    prompts_path, out_path = Path(prompts_path), Path(out_jsonl)
    prompts = iter_prompts(prompts_path, fmt)
    total = open_dataset_file(prompts_path, fmt).count()
    done = completed_lines(out_path)
    stats = ServerStats(records=total)

    def todo() -> Iterator[tuple[int, str, list[Message]]]:
        for number, messages in prompts:
            if number in done:
                stats.already_done += 1
            else:
                yield number, location(prompts_path, number), messages

    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        asyncio.run(regenerate_via_server(todo(), fd, opts, stats, max(total - len(done), 0), transport))
    finally:
        os.close(fd)
    return stats


def _json_arg(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{flag}: not valid JSON ({err.msg} at column {err.colno}): {text!r}") from None
    if not isinstance(value, dict):
        raise DataError(f"{flag}: expected a JSON object, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="producer regenerate", description=__doc__.splitlines()[0])
    engine = p.add_mutually_exclusive_group(required=True)
    engine.add_argument("--target", help="local HF model directory: generate in this process")
    engine.add_argument("--server", help="OpenAI-compatible API base, e.g. http://127.0.0.1:8000/v1")
    p.add_argument(
        "--prompts", required=True, help="chat data (.jsonl, .parquet, .arrow); a last assistant turn is dropped"
    )
    p.add_argument("--format", choices=["chat", "prompt_response"], default="chat")
    p.add_argument("--out", required=True, help="chat JSONL to append to (resumes if it exists)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chat-template-kwargs",
        default="{}",
        help="JSON, e.g. '{\"enable_thinking\": false}'; use the job's data.chat_template_kwargs",
    )
    local = p.add_argument_group("local generation (--target)")
    local.add_argument("--batch-size", type=int, default=8)
    local.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    local.add_argument("--device", default="cpu")
    local.add_argument(
        "--attn-implementation",
        default="auto",
        help="auto (default): sdpa where the model supports it, else eager; or name one",
    )
    server = p.add_argument_group("server (--server)")
    server.add_argument("--model", help="model name to request (default: the one the server lists)")
    server.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    server.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    server.add_argument("--retries", type=int, default=5, help="retries of a failed request (with backoff)")
    server.add_argument("--backoff", type=float, default=1.0, help="first retry delay in seconds (doubles)")
    server.add_argument("--progress-interval", type=float, default=10.0, help="seconds between progress lines")
    server.add_argument("--extra-body", default="{}", help="JSON merged into every request, e.g. '{\"top_k\": 20}'")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        template_kwargs = _json_arg(args.chat_template_kwargs, "--chat-template-kwargs")
        if args.server:
            opts = ServerOptions(
                url=args.server,
                model=args.model,
                concurrency=args.concurrency,
                timeout_s=args.timeout,
                retries=args.retries,
                backoff_s=args.backoff,
                progress_s=args.progress_interval,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
                chat_template_kwargs=template_kwargs,
                extra_body=_json_arg(args.extra_body, "--extra-body"),
            )
            sstats = regenerate_server(args.prompts, args.out, opts, args.format)
        else:
            stats = regenerate(
                args.target,
                args.prompts,
                args.out,
                batch_size=args.batch_size,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
                dtype=args.dtype,
                device=args.device,
                attn_implementation=args.attn_implementation,
                chat_template_kwargs=template_kwargs,
                fmt=args.format,
            )
    except ServerError as err:
        print(
            f"producer regenerate: {err}; the records written so far are kept: rerun the same command to resume",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(
            "producer regenerate: interrupted; the records written so far are kept: rerun the same command to resume",
            file=sys.stderr,
        )
        return 130
    except (DataError, TargetLoadError) as err:
        print(f"producer regenerate: {err}", file=sys.stderr)
        return 2
    if args.server:
        print(
            f"regenerate: done, {sstats.written} written, {sstats.already_done} already present,"
            f" {len(sstats.failed)} failed, {sstats.records} records in {args.prompts}",
            flush=True,
        )
        if sstats.failed:
            for where, reason in sstats.failed:
                print(f"producer regenerate: {where}: failed: {reason}", file=sys.stderr)
            print(
                f"producer regenerate: {len(sstats.failed)} record(s) failed (listed above) and were not"
                " written; rerun the same command to retry them",
                file=sys.stderr,
            )
            return 1
        return 0
    print(
        f"regenerate: done, {stats.written} written, {stats.already_done} already present,"
        f" {stats.prompts} prompts in {args.prompts}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
