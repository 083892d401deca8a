"""Regenerate the assistant answers of a chat dataset with the target itself (the paper's training data).

The drafter learns the target's own distribution, so each prompt's last assistant turn (if any) is dropped
and the target answers instead. The output is chat JSONL; every record also carries `prompt_line` (the
input line it answers) and `finish` ("stop" at EOS, "length" at max_new_tokens).

Resumable: each record is appended with one write on an O_APPEND descriptor and fsynced per batch; on start
a truncated last line (a crash mid-write) is cut off and prompts already written are skipped. Prompts are
batched by their position in the input, never by what is left to do, and sampling is seeded per batch, so a
resumed run recomputes exactly the batches an uninterrupted one would and writes the same file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from producer.data import DataError, Message, iter_messages
from producer.target import DTYPES, TargetLoadError

log = logging.getLogger(__name__)


@dataclass
class RegenerateStats:
    prompts: int = 0  # usable prompts in the input
    already_done: int = 0  # found in the output at start
    written: int = 0  # written by this run
    new_tokens: int = 0
    seconds: float = 0.0


def load_prompts(path: Path) -> list[tuple[int, list[Message]]]:
    """(input line, conversation without its last assistant turn) for every usable record."""
    prompts = []
    for line_no, messages in iter_messages(path, "chat", require_assistant=False):
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            log.warning("%s:%d: skipped record: nothing left to prompt with", path, line_no)
            continue
        prompts.append((line_no, messages))
    return prompts


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
            raise DataError(
                f"{out_path}: an existing line is not a regenerated record; refusing to append"
            ) from None
    if keep < len(data):
        log.warning(
            "%s: dropping a truncated last line (%d bytes) before resuming", out_path, len(data) - keep
        )
        with out_path.open("r+b") as f:
            f.truncate(keep)
    return done


def load_generator(target_dir: Path, dtype: str, device: str, attn_implementation: str):
    if not (target_dir / "config.json").is_file():
        raise TargetLoadError(f"{target_dir}: no config.json (not a local model directory)")
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True, padding_side="left")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{target_dir}: the tokenizer has no chat template")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        model = AutoModelForCausalLM.from_pretrained(
            target_dir, local_files_only=True, dtype=DTYPES[dtype], attn_implementation=attn_implementation
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
    attn_implementation: str = "sdpa",
) -> RegenerateStats:
    """Answer every prompt of `prompts_jsonl` with the target into `out_jsonl`; temperature 0 is greedy."""
    target_dir, prompts_path, out_path = Path(target_dir), Path(prompts_jsonl), Path(out_jsonl)
    if not prompts_path.is_file():
        raise DataError(f"{prompts_path}: prompts file does not exist")
    prompts = load_prompts(prompts_path)
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
            answers = _generate(tokenizer, model, [m for _, m in batch], gen_config, set(stop_ids))
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
    tokenizer, model, conversations: list[list[Message]], gen_config: GenerationConfig, stop_ids: set[int]
):
    """→ [(answer text, new tokens up to and including EOS, "stop" | "length")] for a batch of prompts."""
    texts = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="producer regenerate", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="local HF model directory")
    p.add_argument("--prompts", required=True, help="chat JSONL; a last assistant turn is dropped")
    p.add_argument("--out", required=True, help="chat JSONL to append to (resumes if it exists)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--attn-implementation", default="sdpa")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
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
        )
    except (DataError, TargetLoadError) as err:
        print(f"producer regenerate: {err}", file=sys.stderr)
        return 2
    print(
        f"regenerate: done, {stats.written} written, {stats.already_done} already present,"
        f" {stats.prompts} prompts in {args.prompts}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
