"""The producer's memory plan for each target family the matrix covers, from a config.json alone, against what
the producer itself loads and allocates; and the worked example (Qwen3.6-27B, a qwen3_5 hybrid under a
multimodal wrapper) planned from deploy/examples/configs/qwen36-27b with the figures README shows.

The planned side reads nothing but the saved config. The measured side builds that config's model (random
bf16 weights), loads it through producer.target.load_target and runs its forward, recording the CPU
allocator's peak (tests/common/test_memory_plan.py's `measured_peak`). The zoo's widths are scaled up so the
layers' activations, not the CPU attention path's per-sequence masks, are what both sides count.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.harness import write_job
from common.config import load_job
from common.memory_plan import CUDA_CONTEXT_BYTES, gib
from common.packed_batch import required_slot_bytes
from producer.memory_plan import plan_target, read_text_config
from producer.target import load_target
from tests.common.test_memory_plan import measured_peak, within
from tests.target_zoo import text_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "examples" / "qwen36-27b-8gpu.toml"
EXAMPLE_CONFIG = ROOT / "deploy" / "examples" / "configs" / "qwen36-27b"
WIDTHS = (  # ×8: hidden 512, head_dim 128, linear-attention heads 128 wide, experts 256
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "head_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
)
# (zoo architecture, tokens per batch): above 1024 tokens the plan fits a line through its 512- and 1024-token runs
FAMILIES = {
    "dense": ("qwen3", 1536),
    "dense-sliding": ("gemma3_text", 256),  # sliding and full attention layers
    "moe": ("qwen3_moe", 256),
    "moe-sinks": ("gpt_oss", 256),  # eager attention with sinks, every layer MoE
    "moe-first-dense": ("deepseek_v3", 256),  # MLA; a dense first layer, then experts
    "hybrid-qwen3_5": ("qwen3_5_text", 1536),  # Gated DeltaNet linear attention + full attention
    "hybrid-qwen3_5-moe": ("qwen3_5_moe", 256),
    "hybrid-qwen3_next": ("qwen3_next", 1536),
}


def wide(arch: str):
    config = text_config(arch)
    for key in WIDTHS:
        if isinstance(value := getattr(config, key, None), int):
            setattr(config, key, 8 * value)
    return config


def job_for(tmp_path: Path, target: Path, layer_ids: list[int], tokens: int):
    return load_job(
        write_job(
            tmp_path / "job.toml",
            {
                "job": {"name": "fam", "run_dir": str(tmp_path / "run")},
                "target": {"path": str(target), "device": "cuda:0", "layer_ids": layer_ids, "num_features": 2},
                "data": {"path": str(tmp_path / "chats.jsonl"), "max_length": 256, "tokens_per_batch": tokens},
                "transport": {"kind": "cuda", "slots": 3},
                "drafters": [{"name": "d", "block_size": 8, "num_layers": 1, "devices": ["cuda:1"]}],
            },
        )
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_is_planned_from_its_config_as_the_producer_loads_and_runs_it(tmp_path, family):
    arch, tokens = FAMILIES[family]
    config = wide(arch)
    n = config.num_hidden_layers
    layer_ids = [0, n - 2]  # cut before the last layer: the producer drops it and the final norm
    config.save_pretrained(tmp_path / "config-only")
    assert [p.name for p in (tmp_path / "config-only").iterdir()] == ["config.json"]
    job = job_for(tmp_path, tmp_path / "config-only", layer_ids, tokens)
    (planned,) = plan_target(job, read_text_config(tmp_path / "config-only"))
    assert (planned.process, planned.device) == ("producer", "cuda:0")

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "model")
    target = load_target(tmp_path / "model", layer_ids, 2, "bfloat16", "cpu")
    loaded = sum(t.numel() * t.element_size() for t in [*target.model.parameters(), *target.model.buffers()])
    assert len(target.model.layers) == n - 1 and not any(p.requires_grad for p in target.model.parameters())
    assert planned.parts["weights"] == loaded  # the cut decoder, to the byte

    ids, cu = torch.randint(4, 300, (tokens,)), torch.tensor([0, tokens], dtype=torch.int32)
    target(ids, cu)  # first call: lazy buffers (rotary caches) are not the steady state
    measured = measured_peak(lambda: target(ids, cu))
    features = tokens * 2 * config.hidden_size * 2  # the forward's output [T, 2·H] in bf16 (a ring slot's view)
    assert measured > 2 * features  # the layers' activations dominate, not the output alone
    assert within(planned.parts["forward"] + features, measured, 0.1), (planned.parts["forward"], measured)

    width = 2 * config.hidden_size
    assert planned.parts["ring"] == 3 * required_slot_bytes(tokens, width, "bfloat16")
    assert planned.parts["cuda_context"] == CUDA_CONTEXT_BYTES


def test_the_worked_example_plans_each_target_rank_from_its_published_config():
    """Qwen3.6-27B (Qwen3_5ForConditionalGeneration) at TP 2 × 2 replicas, 16,384 tokens a batch: README's
    figures per rank, the ring on each replica's rank 0 only."""
    job = load_job(EXAMPLE)
    text = read_text_config(EXAMPLE_CONFIG)
    assert type(text).__name__ == "Qwen3_5TextConfig" and text.num_hidden_layers == 64
    entries = plan_target(job, text)
    assert [(e.process, e.device) for e in entries] == [
        ("producer", "cuda:0"),
        ("producer-tp1", "cuda:1"),
        ("producer-p1", "cuda:2"),
        ("producer-p1-tp1", "cuda:3"),
    ]
    ring = 8 * required_slot_bytes(16384, 5 * 5120, "bfloat16")
    assert [e.parts.get("ring", 0) for e in entries] == [ring, 0, ring, 0]
    assert len({(e.parts["weights"], e.parts["forward"]) for e in entries}) == 1  # every rank the same shard
    parts = {k: gib(v) for k, v in entries[0].parts.items()}
    assert parts == {"weights": "24.3 GiB", "forward": "2.9 GiB", "ring": "6.3 GiB", "cuda_context": "0.5 GiB"}
    assert (gib(entries[0].total), gib(entries[1].total)) == ("34.0 GiB", "27.8 GiB")


def _readme_dry_run() -> tuple[list[str], str]:
    """README's worked-example command (its arguments, from the sentence that quotes them) and that sentence."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("and then each GPU's planned peak")
    sentence = readme[start : readme.index("[docs/gpu.md]", start)]
    flags = " ".join(sentence.split("`")[1].split())  # "--device-memory 139.7 --target-config DIR"
    return ["deploy/examples/qwen36-27b-8gpu.toml", "--dry-run", *flags.split()], " ".join(sentence.split())


@pytest.mark.slow
def test_the_readme_dry_run_prints_the_figures_readme_shows():
    args, sentence = _readme_dry_run()
    assert args[2:] == ["--device-memory", "139.7", "--target-config", "deploy/examples/configs/qwen36-27b"]
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}  # nothing needs a GPU to plan
    res = subprocess.run(
        [str(ROOT / "launch.sh"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "planned GPU memory: not available" not in res.stdout, res.stdout
    totals = {
        ln.split(":")[0].strip() + ":" + ln.split(":")[1]: ln.split(": ")[1].split(" GiB")[0]
        for ln in res.stdout.splitlines()
        if ln.startswith("  cuda:")
    }
    assert totals == {f"cuda:{i}": v for i, v in enumerate(["36.0", "27.8"] * 2 + ["73.6"] * 2 + ["49.4"] * 2)}
    for gpus, figure in (("0`/`2", "36.0"), ("1`/`3", "27.8"), ("4`/`5", "73.6"), ("6`/`7", "49.4")):
        assert f"{figure} GiB on `cuda:{gpus}`" in sentence, (figure, sentence)
    assert not any(ln.startswith("WARNING") for ln in res.stdout.splitlines())
