"""The public benchmarks every DFlash paper and trainer reports, with their prompts built as z-lab builds them.

Source of the prompt templates, dataset ids, fields and splits: z-lab/dflash `dflash/benchmark.py`
(`DATASETS`, `_limit_dataset`, `_apply_chat_template`, `_run_transformers`), for gsm8k, math500, humaneval,
mbpp and mt-bench; alpaca (not in z-lab's script) as SpecForge builds it, `benchmarks/benchmarker/alpaca.py`
(`format_alpaca_prompt`, the train split shuffled with seed 42). A benchmark record becomes a list of user
turns (mt-bench has two; the others one); a turn is rendered with the target's chat template, the
generation prompt and `chat_template_kwargs` (z-lab: `enable_thinking`, off by default), then encoded.

Records come from the Hugging Face hub through `datasets` (its cache; HF_HUB_OFFLINE honoured) or from a
local file or folder in the same schema (`NAME=PATH`). Which records: z-lab's transformers backend seeds
`random` with 0 and shuffles the whole set when it has more records than asked for; the same
`random.Random(0).shuffle` here picks the same records in the same order. Alpaca takes the first N of the
seed-42 permutation (numpy's default_rng, which `datasets.Dataset.shuffle` uses).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class BenchmarkSpec:
    hub_id: str
    config: str | None
    split: str
    fields: tuple[str, ...]  # the record fields the template reads
    turns: Callable[[dict], list[str]]  # one record -> its user turns
    shuffle_seed: int | None = None  # SpecForge-style: the first N of a seeded permutation


def _alpaca(rec: dict) -> list[str]:
    if rec["input"]:
        return [f"### Instruction:\n{rec['instruction']}\n\n### Input:\n{rec['input']}\n\n### Response:"]
    return [f"### Instruction:\n{rec['instruction']}\n\n### Response:"]


BENCHMARKS: dict[str, BenchmarkSpec] = {
    "gsm8k": BenchmarkSpec("openai/gsm8k", "main", "test", ("question",), lambda r: [r["question"] + REASON]),
    "math500": BenchmarkSpec("HuggingFaceH4/MATH-500", None, "test", ("problem",), lambda r: [r["problem"] + REASON]),
    "humaneval": BenchmarkSpec(
        "openai/openai_humaneval",
        None,
        "test",
        ("prompt",),
        lambda r: [
            "Write a solution to the following problem and make sure that it passes the tests:\n"
            f"```python\n{r['prompt']}\n```"
        ],
    ),
    "mbpp": BenchmarkSpec("google-research-datasets/mbpp", "sanitized", "test", ("prompt",), lambda r: [r["prompt"]]),
    "mt-bench": BenchmarkSpec(
        "HuggingFaceH4/mt_bench_prompts", None, "train", ("prompt",), lambda r: list(r["prompt"])
    ),
    "alpaca": BenchmarkSpec("tatsu-lab/alpaca", None, "train", ("instruction", "input"), _alpaca, shuffle_seed=42),
}


class BenchmarkDataError(Exception):
    """A benchmark's records cannot be had: the message is one line naming the data and how to provide it."""


@dataclass
class BenchPrompt:
    benchmark: str
    index: int  # the record's index in its dataset
    turns: list[str]  # user turns, in order


def _read_local(path: Path, spec: BenchmarkSpec | None) -> list[dict]:
    """Records of a .jsonl/.json/.parquet file, or of a folder saved with `save_to_disk` or laid out like
    the hub repository (then the spec's config and split choose the files)."""
    if path.is_file() and path.suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise BenchmarkDataError(f"{path}:{lineno}: not a JSON record ({err.msg})") from None
        return rows
    import datasets

    if path.is_file():
        kind = {".json": "json", ".parquet": "parquet"}.get(path.suffix)
        if kind is None:
            raise BenchmarkDataError(f"{path}: a benchmark file must be .jsonl, .json or .parquet")
        return list(datasets.load_dataset(kind, data_files=str(path), split="train"))
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[spec.split if spec else next(iter(ds))]
        return list(ds)
    args = (str(path), spec.config) if spec and spec.config else (str(path),)
    return list(datasets.load_dataset(*args, split=spec.split if spec else "train"))


def _read_hub(name: str, spec: BenchmarkSpec) -> list[dict]:
    where = f"{spec.hub_id}" + (f" (config {spec.config})" if spec.config else "") + f", split {spec.split}"
    how = (
        f"download it once with network access, or pass --bench {name}=PATH (a .jsonl/.json/.parquet file or a"
        f" folder in the dataset's schema, records with field(s) {', '.join(spec.fields)})"
    )
    try:
        import datasets
    except ImportError:
        raise BenchmarkDataError(f"benchmark {name}: the `datasets` package is not installed; {how}") from None
    try:
        args = (spec.hub_id, spec.config) if spec.config else (spec.hub_id,)
        return list(datasets.load_dataset(*args, split=spec.split))
    except Exception as err:  # offline and not cached, hub unreachable, renamed: all the same to the user
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise BenchmarkDataError(f"benchmark {name}: cannot load dataset {where} ({why[:200]}); {how}") from None


def _custom_prompts(path: Path) -> list[BenchPrompt]:
    """A user's own prompts: {"turns": [...]} (z-lab's cache layout), {"messages": [...]} (user turns; a
    trailing assistant turn dropped) or {"prompt": str}."""
    out = []
    for i, rec in enumerate(_read_local(path, None)):
        if "turns" in rec:
            turns = list(rec["turns"])
        elif "messages" in rec:
            turns = [m["content"] for m in rec["messages"] if m["role"] == "user"]
        elif "prompt" in rec:
            turns = [rec["prompt"]]
        else:
            raise BenchmarkDataError(f"{path}: record {i} needs 'turns', 'messages' or 'prompt'")
        if not turns or not all(isinstance(t, str) for t in turns):
            raise BenchmarkDataError(f"{path}: record {i} has no user turn to answer")
        out.append(BenchPrompt(path.stem, i, turns))
    return out


def build_prompts(name: str, records: list[dict]) -> list[BenchPrompt]:
    """Every record of a named benchmark as its user turns (the template of z-lab's `DATASETS[name]`)."""
    spec = BENCHMARKS[name]
    out = []
    for i, rec in enumerate(records):
        missing = [f for f in spec.fields if f not in rec]
        if missing:
            raise BenchmarkDataError(
                f"benchmark {name}: record {i} lacks field(s) {', '.join(missing)} (has {', '.join(sorted(rec))})"
            )
        out.append(BenchPrompt(name, i, spec.turns(rec)))
    return out


def select(prompts: list[BenchPrompt], num_prompts: int | None, shuffle_seed: int | None = None) -> list[BenchPrompt]:
    """The records z-lab's transformers backend evaluates (random.seed(0), then a shuffle when there are
    more than asked for), or the first N of a seeded numpy permutation for a SpecForge-style benchmark."""
    if shuffle_seed is not None:
        order = np.random.default_rng(shuffle_seed).permutation(len(prompts))
        return [prompts[i] for i in order[: num_prompts if num_prompts is not None else len(prompts)]]
    if num_prompts is None or len(prompts) <= num_prompts:
        return list(prompts)
    chosen = list(prompts)
    random.Random(0).shuffle(chosen)
    return chosen[:num_prompts]


def load_benchmark(arg: str, num_prompts: int | None = None) -> tuple[str, list[BenchPrompt]]:
    """One --bench entry: NAME (from the hub), NAME=PATH (the same schema, local) or FILE.jsonl (own
    prompts) -> (its name, its selected prompts)."""
    name, _, local = arg.partition("=")
    if name not in BENCHMARKS:
        path = Path(arg)
        if local or not path.exists():
            raise BenchmarkDataError(
                f"--bench {arg}: neither a benchmark ({', '.join(BENCHMARKS)}) nor an existing prompts file"
            )
        return path.stem, select(_custom_prompts(path), num_prompts)
    spec = BENCHMARKS[name]
    if local:
        if not Path(local).exists():
            raise BenchmarkDataError(f"--bench {arg}: {local} does not exist")
        records = _read_local(Path(local), spec)
    else:
        records = _read_hub(name, spec)
    return name, select(build_prompts(name, records), num_prompts, spec.shuffle_seed)


def render_text(tokenizer, messages: list[dict], chat_template_kwargs: dict) -> str:
    """The prompt as z-lab renders it: the chat template as text, with the generation prompt and the
    template's keyword arguments (`enable_thinking`, …)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **chat_template_kwargs)


def render(tokenizer, messages: list[dict], chat_template_kwargs: dict) -> list[int]:
    """The prompt ids as z-lab makes them: `tokenizer.encode` of `render_text` (special tokens added as
    encode adds them: a template that writes its own BOS then has two, as in z-lab's runs)."""
    return tokenizer.encode(render_text(tokenizer, messages, chat_template_kwargs))
