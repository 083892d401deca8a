"""Demo assets: a deterministic learnable corpus, a cached build that loads like any model, a valid job."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import demo.job as demo
from common.config import load_job
from demo.corpus import TASKS, generate_corpus, prompt_of, split_corpus


def test_corpus_is_deterministic_and_covers_every_task():
    a, b = generate_corpus(7, 500), generate_corpus(7, 500)
    assert a == b
    assert a != generate_corpus(8, 500)
    assert {r["task"] for r in a} == set(TASKS)
    for r in a:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert r["messages"][1]["content"]


def test_answers_are_a_function_of_the_prompt():
    answers: dict[str, str] = {}
    for r in generate_corpus(0, 3000):
        assert answers.setdefault(prompt_of(r), r["messages"][1]["content"]) == r["messages"][1]["content"]


def test_examples_of_the_templates():
    by_task = {}
    for r in generate_corpus(3, 400):
        by_task.setdefault(r["task"], r["messages"])
    user, answer = (m["content"] for m in by_task["count_up"])
    lo, hi = map(int, re.findall(r"\d+", user))
    assert answer == ", ".join(str(i) for i in range(lo, hi + 1)) + "."
    user, answer = (m["content"] for m in by_task["times_table"])
    k, first, last = map(int, re.findall(r"\d+", user))
    assert answer == ", ".join(f"{i} x {k} = {i * k}" for i in range(first, last + 1)) + "."


def test_split_keeps_every_prompt_in_one_part():
    records = generate_corpus(1, 3000)
    pretrain, drafter, held = split_corpus(records, 40, 100)
    parts = [{prompt_of(r) for r in part} for part in (pretrain, drafter, held)]
    assert len(drafter) == len(parts[1]) == 100 and len(held) == len(parts[2]) == 40
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    assert len(pretrain) > 0.7 * len(records)
    assert split_corpus(records, 40, 100) == (pretrain, drafter, held)  # a stable hash, not hash()
    with pytest.raises(ValueError, match="distinct held-out prompts"):
        split_corpus(records[:30], 40, 0)


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("demo")
    return run_dir, demo.prepare_demo(run_dir, quick=True, threads=1)


def test_quick_demo_builds_loadable_assets_and_a_valid_job(quick_demo):
    run_dir, job_path = quick_demo
    job = load_job(job_path)
    assert [(d.name, d.block_size) for d in job.drafters] == [("d_b8", 8), ("d_b16", 16)]
    assert job.target.dtype == "float32" and job.target.device == "cpu" and job.telemetry.wandb_mode == "offline"
    assert job.data.format == "chat" and job.job.run_dir == str(run_dir.resolve())
    model = AutoModelForCausalLM.from_pretrained(job.target.path, local_files_only=True)
    assert max(job.target.layer_ids) < model.config.num_hidden_layers
    tok = AutoTokenizer.from_pretrained(job.target.path, local_files_only=True)
    assert tok.chat_template and tok.mask_token_id is not None
    assert tok.mask_token_id < model.config.vocab_size
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    train = [json.loads(line) for line in Path(job.data.path).read_text().splitlines()]
    assert len(train) == demo.QUICK.regenerated
    assert all(r["messages"][-1]["role"] == "assistant" for r in train)
    held = [json.loads(line) for line in (run_dir / "assets" / "heldout.jsonl").read_text().splitlines()]
    pretrain = [json.loads(line) for line in (run_dir / "assets" / "corpus.jsonl").read_text().splitlines()]
    assert len(held) == demo.QUICK.held_out
    held_prompts = {prompt_of(r) for r in held}
    assert not held_prompts & {r["messages"][0]["content"] for r in train}
    assert not (held_prompts | {r["messages"][0]["content"] for r in train}) & {prompt_of(r) for r in pretrain}
    ready = json.loads((run_dir / "assets" / demo.READY).read_text())
    assert 0.0 <= ready["heldout_greedy"]["token_accuracy"] <= 1.0
    assert ready["pretrain"]["steps"] == demo.QUICK.pretrain_steps
    assert job.data.length_group_window == demo.LENGTH_GROUP_WINDOW
    assert [d.total_steps for d in job.drafters] == [ready["train_batches"]] * 2  # the lr schedule spans the plan


def test_a_second_call_rebuilds_nothing_and_a_missing_marker_rebuilds(quick_demo, monkeypatch):
    run_dir, job_path = quick_demo
    weights = next((run_dir / "assets" / "target").glob("*.safetensors"))
    stamp = (weights.stat().st_mtime_ns, job_path.stat().st_mtime_ns)
    calls = []
    real_build = demo.build_assets
    monkeypatch.setattr(demo, "build_assets", lambda *a, **k: calls.append(a) or real_build(*a, **k))
    assert demo.prepare_demo(run_dir, quick=True, threads=1) == job_path
    assert calls == [] and (weights.stat().st_mtime_ns, job_path.stat().st_mtime_ns) == stamp
    (run_dir / "assets" / demo.READY).unlink()  # as after a crash mid-build
    (run_dir / "assets" / "corpus.jsonl").write_text("partial")
    assert demo.prepare_demo(run_dir, quick=True, threads=1) == job_path
    assert len(calls) == 1 and (run_dir / "assets" / demo.READY).is_file()
    assert (run_dir / "assets" / "corpus.jsonl").read_text() != "partial"


def test_prepare_cli_prints_only_the_job_path(quick_demo, capsys):
    run_dir, job_path = quick_demo
    assert demo.main(["prepare", str(run_dir), "--quick", "--threads", "1"]) == 0
    assert capsys.readouterr().out == f"{job_path}\n"


def test_evaluate_runs_every_drafter_of_the_job(quick_demo, capsys):
    from consumer.export.layout import export_config, write_export
    from consumer.model import DFlashDrafter, DrafterArch
    from consumer.target_parts import load_target_parts

    run_dir, job_path = quick_demo
    job = load_job(job_path)
    parts = load_target_parts(job.target.path)
    for d in job.drafters:  # random drafters in the trainer's checkpoint layout
        arch = DrafterArch.from_target(parts, d, len(job.target.layer_ids))
        model = DFlashDrafter(arch, parts.embed_tokens, parts.lm_head)
        export = job.run_paths.checkpoints(d.name) / "step_1"
        export.mkdir(parents=True)
        cfg = export_config(
            arch,
            parts,
            block_size=d.block_size,
            mask_token_id=parts.vocab_size - 1,
            target_layer_ids=list(job.target.layer_ids),
            dtype="float32",
        )
        write_export(export, model.state_dict(), cfg)
        (export.parent / "latest").write_text("step_1\n")
    torch.manual_seed(0)
    assert demo.main(["evaluate", str(job_path), "--limit", "2", "--json"]) == 0
    reports = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(reports) == {"d_b8", "d_b16"}
    assert all(r["lossless"] and r["prompts"] == 2 for r in reports.values())
    assert json.loads((run_dir / "eval.json").read_text()) == reports


def _digests(folder: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != demo.READY}  # fmt: skip


def _figures(ready: dict) -> dict:
    """READY without the wall times: what must be the same on this machine (its CPU kernels)."""
    drop = {"seconds", "build_seconds", "accuracy_seconds"}
    return json.loads(json.dumps(ready), object_hook=lambda d: {k: v for k, v in d.items() if k not in drop})


def test_same_seed_same_assets_byte_for_byte(quick_demo, tmp_path, monkeypatch):
    """A fixed step count and a fixed thread count: a second build on a machine 1000× slower (its clock runs
    1000 s per step) writes the same weights, tokenizer and data, and the same figures."""
    from demo import pretrain

    run_dir, _ = quick_demo
    clock = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(pretrain.time, "perf_counter", lambda: float(next(clock)))
    again = demo.build_assets(tmp_path / "assets", demo.QUICK, seed=0)
    monkeypatch.undo()
    first = json.loads((run_dir / "assets" / demo.READY).read_text())
    assert again["torch_threads"] == first["torch_threads"] == demo.BUILD_THREADS == 1
    assert again["cpu_kernels"] == f"{torch.backends.cpu.get_cpu_capability()} (torch {torch.__version__})"
    assert _figures(again) == _figures(first)
    digests = _digests(tmp_path / "assets")
    assert {"target/model.safetensors", "tokenizer/tokenizer.json", "train.jsonl"} <= set(digests)
    assert digests == _digests(run_dir / "assets")
    other = demo.build_assets(tmp_path / "other", dataclasses.replace(demo.QUICK, pretrain_steps=9), seed=0)
    assert other["pretrain"]["steps"] == 9
    assert _digests(tmp_path / "other")["target/model.safetensors"] != digests["target/model.safetensors"]


def test_other_cpu_kernels_build_other_weights(quick_demo, tmp_path):
    """Why docs/demo.md says which demo figures vary by machine: the same recipe on another CPU kernel set (here
    ATen's portable kernels and MKL's AVX2 path instead of this machine's own) sums in another order, so the
    target's weights differ; what holds no float sum (the tokenizer, the corpus) is the same."""
    run_dir, _ = quick_demo
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU runs the portable kernels already: no second kernel set to compare with")
    root = Path(__file__).resolve().parents[2]
    code = f"import demo.job as d, pathlib; d.build_assets(pathlib.Path({str(tmp_path / 'a')!r}), d.QUICK, seed=0)"
    env = {**os.environ, "PYTHONPATH": str(root), "ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True, capture_output=True, timeout=600)
    other, ours = _digests(tmp_path / "a"), _digests(run_dir / "assets")
    assert json.loads((tmp_path / "a" / demo.READY).read_text())["cpu_kernels"].startswith("DEFAULT (torch ")
    assert other["target/model.safetensors"] != ours["target/model.safetensors"]
    assert other["tokenizer/tokenizer.json"] == ours["tokenizer/tokenizer.json"]
    assert other["corpus.jsonl"] == ours["corpus.jsonl"]
