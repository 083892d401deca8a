"""dflash-eval --bench: z-lab's prompt construction per benchmark (literal prompts on records in the real
schema), z-lab's choice of records, τ and histograms against a hand count with scripted drafters, and the
CLI end to end with our export next to a drafter directory in z-lab's published layout."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from evaluation.benchmarks import (
    BENCHMARKS,
    BenchmarkDataError,
    BenchPrompt,
    build_prompts,
    load_benchmark,
    select,
)
from evaluation.side_by_side import format_table, run_benchmark
from evaluation.speculative import TargetRunner, greedy_generate

REPO = Path(__file__).resolve().parents[2]
LAYER_IDS = [1, 3]

# Two records per benchmark, in each dataset's own schema (fields and values as the hub serves them).
RECORDS = {
    "gsm8k": [
        {
            "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
            " How many clips did Natalia sell altogether in April and May?",
            "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
        },
        {
            "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting."
            " How much did she earn?",
            "answer": "#### 10",
        },
    ],
    "math500": [
        {
            "problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
            "solution": "",
            "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
            "subject": "Precalculus",
            "level": 2,
            "unique_id": "test/precalculus/807.json",
        },
        {
            "problem": "What is $1^{(2^{235423523})}$?",
            "solution": "",
            "answer": "1",
            "subject": "Prealgebra",
            "level": 1,
            "unique_id": "test/prealgebra/1747.json",
        },
    ],
    "humaneval": [
        {
            "task_id": "HumanEval/0",
            "prompt": 'def has_close_elements(numbers, threshold):\n    """ Check.\n    """\n',
            "canonical_solution": "",
            "test": "",
            "entry_point": "has_close_elements",
        },
        {
            "task_id": "HumanEval/2",
            "prompt": "def truncate_number(number: float) -> float:\n",
            "canonical_solution": "",
            "test": "",
            "entry_point": "truncate_number",
        },
    ],
    "mbpp": [
        {
            "source_file": "Benchmark Questions Verification V2.ipynb",
            "task_id": 2,
            "prompt": "Write a function to find the shared elements from the given two lists.",
            "code": "",
            "test_imports": [],
            "test_list": [],
        },
        {
            "source_file": "Benchmark Questions Verification V2.ipynb",
            "task_id": 3,
            "prompt": "Write a python function to identify non-prime numbers.",
            "code": "",
            "test_imports": [],
            "test_list": [],
        },
    ],
    "mt-bench": [
        {
            "prompt": [
                "Compose an engaging travel blog post about a recent trip to Hawaii.",
                "Rewrite your previous response. Start every sentence with the letter A.",
            ],
            "prompt_id": 81,
            "category": "writing",
            "reference": [],
        },
        {
            "prompt": ["Draft a professional email seeking your supervisor's feedback.", "Take a moment to evaluate."],
            "prompt_id": 82,
            "category": "writing",
            "reference": [],
        },
    ],
    "alpaca": [
        {"instruction": "Give three tips for staying healthy.", "input": "", "output": "1. Eat well."},
        {"instruction": "Identify the odd one out.", "input": "Twitter, Instagram, Telegram", "output": "Telegram"},
    ],
}
R = "\nPlease reason step by step, and put your final answer within \\boxed{}."
EXPECTED = {
    "gsm8k": [
        [
            "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How"
            " many clips did Natalia sell altogether in April and May?" + R
        ],
        [
            "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much"
            " did she earn?" + R
        ],
    ],
    "math500": [
        ["Convert the point $(0,3)$ in rectangular coordinates to polar coordinates." + R],
        ["What is $1^{(2^{235423523})}$?" + R],
    ],
    "humaneval": [
        [
            "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
            'def has_close_elements(numbers, threshold):\n    """ Check.\n    """\n\n```'
        ],
        [
            "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
            "def truncate_number(number: float) -> float:\n\n```"
        ],
    ],
    "mbpp": [
        ["Write a function to find the shared elements from the given two lists."],
        ["Write a python function to identify non-prime numbers."],
    ],
    "mt-bench": [
        [
            "Compose an engaging travel blog post about a recent trip to Hawaii.",
            "Rewrite your previous response. Start every sentence with the letter A.",
        ],
        ["Draft a professional email seeking your supervisor's feedback.", "Take a moment to evaluate."],
    ],
    "alpaca": [
        ["### Instruction:\nGive three tips for staying healthy.\n\n### Response:"],
        ["### Instruction:\nIdentify the odd one out.\n\n### Input:\nTwitter, Instagram, Telegram\n\n### Response:"],
    ],
}
# Qwen3's handling of enable_thinking=False: an empty think block after the generation prompt.
QWEN3_LIKE_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_prompt_builders_match_zlab_templates(name):
    assert [p.turns for p in build_prompts(name, RECORDS[name])] == EXPECTED[name]


def test_record_choice_is_zlabs_and_specforges():
    """z-lab's transformers backend: random.seed(0), then random.shuffle of the whole set when it is larger
    than asked for (its `_limit_dataset`, run here as written); alpaca: datasets' own shuffle(seed=42)."""
    import datasets

    prompts = [BenchPrompt("x", i, [str(i)]) for i in range(50)]
    random.seed(0)
    theirs = list(range(50))
    random.shuffle(theirs)
    assert [p.index for p in select(prompts, 7)] == theirs[:7]
    assert [p.index for p in select(prompts, 50)] == list(range(50))  # not larger: kept in order
    ds = datasets.Dataset.from_list([{"i": i} for i in range(50)]).shuffle(seed=42).select(range(7))
    assert [p.index for p in select(prompts, 7, shuffle_seed=42)] == [r["i"] for r in ds]


def test_local_copies_in_the_datasets_schema(tmp_path):
    import datasets

    rows = RECORDS["gsm8k"] * 3
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    name, prompts = load_benchmark(f"gsm8k={tmp_path / 'gsm8k.jsonl'}")
    assert name == "gsm8k" and [p.turns for p in prompts] == EXPECTED["gsm8k"] * 3
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS["mt-bench"])}).save_to_disk(tmp_path / "mt")
    _, prompts = load_benchmark(f"mt-bench={tmp_path / 'mt'}")
    assert [p.turns for p in prompts] == EXPECTED["mt-bench"]
    (tmp_path / "own.jsonl").write_text(json.dumps({"turns": ["a", "b"]}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    assert [p.turns for p in load_benchmark(str(tmp_path / "own.jsonl"))[1]] == [["a", "b"], ["c"]]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"problem": "x"}) + "\n")
    with pytest.raises(BenchmarkDataError, match=r"record 0 lacks field\(s\) question"):
        load_benchmark(f"gsm8k={tmp_path / 'bad.jsonl'}")
    with pytest.raises(BenchmarkDataError, match="neither a benchmark"):
        load_benchmark("gsm9k")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny target with a trained BPE tokenizer (Qwen3-like template), and two random drafters on disk:
    one exported by this project, one laid out as z-lab publishes (config keys as in its Qwen3 drafters,
    block size inside dflash_config, other target layers than ours, bf16 model.safetensors, a dflash.py)."""
    from consumer.export.layout import export_config, write_export
    from consumer.model import DFlashDrafter, DrafterArch
    from consumer.target_parts import load_target_parts
    from demo.tiny import build_tiny_target, train_tokenizer

    root = tmp_path_factory.mktemp("bench")
    texts = [f"count {i} {i + 1} {i + 2} and say hello world, reason step by step" for i in range(200)]
    tok = train_tokenizer(texts, 300, root / "tok")
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    target_dir = build_tiny_target(root / "target", tok, hidden_size=64, num_layers=4, seed=0)
    parts = load_target_parts(target_dir)
    arch = DrafterArch(64, 4, 2, 16, 128, 2, len(LAYER_IDS), 1e-6, 1e6)
    ours = root / "ours" / "step_3"
    ours.mkdir(parents=True)
    model = DFlashDrafter(arch, parts.embed_tokens, parts.lm_head, init_seed=3)
    cfg = export_config(
        arch, parts, block_size=4, mask_token_id=tok.mask_token_id, target_layer_ids=LAYER_IDS, dtype="float32"
    )
    write_export(ours, model.state_dict(), cfg)
    (root / "ours" / "latest").write_text("step_3\n")
    zlab = root / "zlab-b8"
    zlab.mkdir()
    other = DFlashDrafter(arch, parts.embed_tokens, parts.lm_head, init_seed=5)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in other.state_dict().items()}, str(zlab / "model.safetensors")
    )
    (zlab / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DFlashDraftModel"],
                "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
                "attention_bias": False,
                "attention_dropout": 0.0,
                "dflash_config": {
                    "block_size": 8,
                    "mask_token_id": tok.mask_token_id,
                    "target_layer_ids": [0, 2],
                },  # not ours
                "dtype": "bfloat16",
                "head_dim": 16,
                "hidden_act": "silu",
                "hidden_size": 64,
                "initializer_range": 0.02,
                "intermediate_size": 128,
                "layer_types": ["full_attention", "full_attention"],
                "max_position_embeddings": 4096,
                "max_window_layers": 2,
                "model_type": "qwen3",
                "num_attention_heads": 4,
                "num_hidden_layers": 2,
                "num_key_value_heads": 2,
                "num_target_layers": 4,
                "rms_norm_eps": 1e-6,
                "rope_scaling": None,
                "rope_theta": 1000000.0,
                "sliding_window": None,
                "tie_word_embeddings": False,
                "use_cache": True,
                "use_sliding_window": False,
                "vocab_size": parts.vocab_size,
            }
        )
    )
    (zlab / "dflash.py").write_text((REPO / "consumer" / "export" / "dflash.py").read_text())
    return {"tok": tok, "target": target_dir, "ours": root / "ours", "zlab": zlab, "root": root}


class ScriptedDrafter:
    """Knows the target's greedy continuation: right for the first `right` slots of every block, then wrong."""

    def __init__(self, target: TargetRunner, block_size: int, right: int):
        self.target, self.block_size, self.right = target, block_size, right

    def propose(self, context_features, tokens):
        oracle = torch.tensor(greedy_generate(self.target, tokens, self.block_size - 1, None).tokens)
        oracle[self.right :] = (oracle[self.right :] + 1) % self.target.model.config.vocab_size
        return oracle


class LayerCheckingDrafter(ScriptedDrafter):
    """Checks that the context it is given is the target's hidden states at its own layers [0, 2]."""

    layer_ids = (0, 2)
    checked = 0

    def propose(self, context_features, tokens):
        with torch.no_grad():
            hs = self.target.model(tokens[None, :-1], output_hidden_states=True).hidden_states
        want = torch.cat([hs[i + 1][0] for i in self.layer_ids], -1)
        torch.testing.assert_close(context_features, want, rtol=1e-4, atol=1e-4)
        self.checked += 1
        return super().propose(context_features, tokens)


def test_table_tau_and_histograms_against_a_hand_count(assets):
    """Two mt-bench records, two turns each: 4 responses of 31 tokens, stops off. Blocks of 8; a drafter
    right for 2 slots commits 3 tokens a step (10 steps after the prefill's token), one right for 5 commits 6
    (5 steps), one right for 3 commits 4 (8 steps, the last cut to 2 tokens but counted whole, as z-lab
    counts it; it also reads other target layers than the others): τ 3, 6 and 4 exactly, and the
    histograms are those step counts times 4."""
    model = AutoModelForCausalLM.from_pretrained(assets["target"], local_files_only=True)
    target = TargetRunner(model, LAYER_IDS)
    drafters = {f"right{k}": ScriptedDrafter(target, 8, k) for k in (2, 5, 3)}
    drafters["right3"] = LayerCheckingDrafter(target, 8, 3)  # other layers than the target runner's [1, 3]
    prompts = build_prompts("mt-bench", RECORDS["mt-bench"])
    r = run_benchmark(target, drafters, assets["tok"], prompts, max_new_tokens=31, stop_token_ids=[], warmup=False)
    assert drafters["right3"].checked == 4 * 8
    assert (r.prompts, r.responses, r.plain_tokens) == (2, 4, 4 * 31)
    want = {"right2": (3.0, 2, 10), "right5": (6.0, 5, 5), "right3": (4.0, 3, 8)}
    for name, (tau, slot, steps) in want.items():
        d = r.drafters[name]
        assert d.tau == tau and d.lossless is True and d.generated_tokens == 4 * 31
        assert d.tau_histogram == [4 * steps if k == slot else 0 for k in range(8)]
        assert d.target_forwards_per_token == pytest.approx((1 + steps) / 31)
        short = d.context_buckets[0]  # every prompt here is far under 1K tokens: one bucket holds every step
        assert (short["label"], short["steps"], short["tau"]) == ("<1K", 4 * steps, tau)
        assert [b["steps"] for b in d.context_buckets[1:]] == [0, 0, 0]
    table = format_table({"mt-bench": r}, 0.0, {"enable_thinking": False})
    rows = [line.split() for line in table.splitlines() if line.startswith("mt-bench")]
    assert [(row[1], row[2], row[3]) for row in rows] == [
        ("right2", "4", "3.00"),
        ("right5", "4", "6.00"),
        ("right3", "4", "4.00"),
    ]
    assert "accepted 1..8 (% of steps): 0 0 100 0 0 0 0 0" in table
    assert "tau by context length (steps): <1K 3.00 (40) | 1K–4K - (0) | 4K–16K - (0) | ≥16K - (0)" in table


def test_sampling_path_reports_no_losslessness(assets):
    from evaluation.evaluate import load_drafter, load_target

    drafter = load_drafter(assets["ours"], assets["target"])
    target = load_target(assets["target"], drafter.layer_ids)
    prompts = build_prompts("gsm8k", RECORDS["gsm8k"])
    r = run_benchmark(
        target, {"ours": drafter}, assets["tok"], prompts, max_new_tokens=12, temperature=1.0, warmup=False
    )
    d = r.drafters["ours"]
    assert d.lossless is None and 1.0 <= d.tau <= 4 and sum(d.tau_histogram) > 0


def test_cli_two_drafters_side_by_side_with_a_zlab_layout(assets, tmp_path, capsys):
    from evaluation.cli import main

    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS["gsm8k"]))
    (tmp_path / "mt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS["mt-bench"]))
    out = tmp_path / "eval.json"
    rc = main(
        [
            "--target",
            str(assets["target"]),
            "--drafter",
            str(assets["ours"]),
            "--drafter",
            f"zlab={assets['zlab']}",
            "--bench",
            f"gsm8k={tmp_path / 'gsm8k.jsonl'},mt-bench={tmp_path / 'mt.jsonl'}",
            "--max-new-tokens",
            "10",
            "--threads",
            "1",
            "--output",
            str(out),
            "--json",
        ]
    )
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and json.loads(out.read_text())["benchmarks"] == doc["benchmarks"]
    assert doc["chat_template_kwargs"] == {"enable_thinking": False} and doc["temperature"] == 0.0
    assert set(doc["benchmarks"]) == {"gsm8k", "mt-bench"}
    for bench, responses in (("gsm8k", 2), ("mt-bench", 4)):
        b = doc["benchmarks"][bench]
        assert set(b["drafters"]) == {"ours", "zlab"} and b["responses"] == responses
        assert b["drafters"]["ours"]["block_size"] == 4 and b["drafters"]["zlab"]["block_size"] == 8
        for d in b["drafters"].values():
            assert d["lossless"] is True and 1.0 <= d["tau"] <= d["block_size"]
            assert sum(d["tau_histogram"]) > 0 and d["responses"] == responses


@pytest.mark.slow  # one real process: ~6 s idle, 30 s on a loaded 2-core machine
def test_cli_user_errors_exit_2_with_one_line(assets, tmp_path, capsys):
    """A benchmark not in an empty HF cache with HF_HUB_OFFLINE=1 (a real process, so `datasets` reads the
    variable at import as a user's would), then in-process a bad drafter path and a bad JSON option."""
    from evaluation.cli import main

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(REPO)}
    args = ["--target", str(assets["target"]), "--drafter", str(assets["ours"])]
    proc = subprocess.run(
        [sys.executable, "-m", "evaluation", *args, "--bench", "gsm8k"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        "dflash-eval: benchmark gsm8k: cannot load dataset openai/gsm8k (config main), split test"
    ), lines
    assert "pass --bench gsm8k=PATH" in lines[0] and "field(s) question" in lines[0]  # how to provide it
    (tmp_path / "own.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n")
    dflash2 = tmp_path / "dflash2"
    dflash2.mkdir()
    (dflash2 / "model.safetensors").write_bytes((assets["zlab"] / "model.safetensors").read_bytes())
    cfg = json.loads((assets["zlab"] / "config.json").read_text())
    (dflash2 / "config.json").write_text(json.dumps({**cfg, "architectures": ["DFlash2DraftModel"]}))
    cases = [
        (
            ["--bench", str(tmp_path / "own.jsonl"), "--drafter", str(dflash2)],
            # a DFlash2 drafter evaluates here (consumer/dflash2.py) once its config carries the DFlash2 keys
            f"{dflash2 / 'config.json'}: required field dflash_config.conv_kernel_size is missing",
        ),
        (["--bench", str(tmp_path / "own.jsonl"), "--drafter", str(tmp_path / "nope")], "no config.json"),
        (["--bench", "gsm8k", "--chat-template-kwargs", "{x"], "--chat-template-kwargs: not JSON"),
        (["--bench", "gsm8k", "--prompts", "x.jsonl"], "give one of --bench LIST or --prompts FILE"),
    ]
    for extra, message in cases:
        capsys.readouterr()
        assert main([*args, *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dflash-eval: ") and message in lines[0], lines
