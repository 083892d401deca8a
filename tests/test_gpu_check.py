"""bench.gpu_check without a GPU: it prints its plan and exits 0; its parsers and report writer on known input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check
from common.config import load_job

ROOT = Path(__file__).resolve().parent.parent


def test_without_cuda_it_prints_the_plan_exits_0_and_writes_nothing():
    md = ROOT / "docs" / "gpu.md"
    before = md.read_bytes()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device is visible" in proc.stdout
    for step, _ in gpu_check.PLAN:
        assert f"  {step} " in proc.stdout
    assert "36 layers, hidden 4096" in proc.stdout
    assert md.read_bytes() == before


def test_unknown_step_to_skip_is_refused_with_the_steps_named(capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--skip", "tests,warp"])
    assert exc.value.code == 2
    assert "unknown step(s) ['warp']" in capsys.readouterr().err


def test_junit_counts(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text("""<?xml version="1.0"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="ok1"/><testcase classname="tests.test_a" name="ok2"/>
<testcase classname="tests.test_a" name="bad"><failure message="x"/></testcase>
<testcase classname="tests.test_b" name="boom"><error message="y"/></testcase>
<testcase classname="tests.test_b" name="gpu2"><skipped message="needs 2 GPUs"/></testcase>
</testsuite></testsuites>""")
    counts = gpu_check.junit_counts(xml)
    assert counts == {"passed": 2, "failed": 1, "errors": 1, "skipped": 1,
                      "failing": ["tests.test_a::bad", "tests.test_b::boom"]}


def test_window_figures_are_medians_after_the_first_third(tmp_path):
    rates = [1.0, 2.0, 100.0, 110.0, 90.0, 105.0]  # the first two windows: start-up
    rows = [{"metrics": {"drafter/b16_0/tokens_per_s": r, "drafter/b16_1/tokens_per_s": r - 5,
                         "pipeline/tokens_per_s": r + 1, "gpu/0/util_pct": 99.0}} for r in rates]
    rows.insert(0, {"metrics": {"gpu/0/util_pct": 0.0}})  # before anything trained: not a window
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = gpu_check.window_figures(path)
    assert figures == {"windows": 4, "drafter/b16_0/tokens_per_s": 102.5, "drafter/b16_1/tokens_per_s": 97.5,
                       "pipeline/tokens_per_s": 103.5}


def test_the_table_goes_between_the_markers_and_a_failed_step_says_why(tmp_path):
    md = tmp_path / "gpu.md"
    md.write_text(f"# title\n\n{gpu_check.MD_BEGIN}\nold\n{gpu_check.MD_END}\ntail\n")
    results = {
        "started": "2026-01-01 00:00 UTC", "device": "NVIDIA H200", "pipeline_s": 120.0,
        "tests": {"ok": True, "passed": 31, "failed": 0, "errors": 0, "skipped": 2},
        "stages": {"ok": True, "producer_alone_tokens_per_s": 51234.5, "consumer_alone_tokens_per_s": 40000.0,
                   "gpu_mem_peak_gib": 70.1, "nvml_on_over_off_step_time": 1.002,
                   "compiled_frames_in_timed_passes": 0},
        "pipeline": {"ok": False, "error": "RuntimeError: pipeline did not start training"},
        "export": {"ok": True},
    }
    gpu_check.write_markdown(md, gpu_check.render_table(results))
    text = md.read_text()
    assert text.startswith("# title\n\n") and text.endswith(f"{gpu_check.MD_END}\ntail\n")
    assert "old" not in text
    assert "| CUDA-marked tests (Triton compiled) | 31 passed, 0 failed, 0 errors, 2 skipped |" in text
    assert "| producer alone, tokens/s | 51234.5 |" in text
    assert "| GPU memory peak, stages (torch allocator) | 70.1 GiB |" in text
    assert "| pipeline, 2 drafters, tokens/s (slowest drafter) | failed: RuntimeError: pipeline did not" in text
    assert "NVIDIA H200" in text


def test_a_markdown_file_without_markers_is_refused_by_name(tmp_path):
    md = tmp_path / "gpu.md"
    md.write_text("no markers here\n")
    with pytest.raises(SystemExit, match=r"gpu\.md lacks the"):
        gpu_check.write_markdown(md, "| x |\n")


def test_docs_say_no_gpu_run_has_happened_until_one_has():
    text = (ROOT / "docs" / "gpu.md").read_text()
    table = text.split(gpu_check.MD_BEGIN, 1)[1].split(gpu_check.MD_END, 1)[0]
    if "not measured yet" in table:
        assert "No GPU run has happened yet" in text
    else:  # written by a real run: it names when and on what
        assert table.lstrip().startswith("Run ")


def test_the_job_files_it_writes_are_valid_jobs(tmp_path):
    assets = tmp_path / "assets"
    (assets / "target").mkdir(parents=True)
    (assets / "chats.jsonl").write_text("")
    job = load_job(gpu_check.write_job(tmp_path / "pipe" / "job.toml", tmp_path / "pipe", assets, "chats.jsonl",
                                       gpu_check.PIPELINE_EPOCHS))
    assert job.target.layer_ids == [1, 9, 17, 25, 33] and job.target.dtype == "bfloat16"
    assert job.transport.kind == "cuda" and job.data.tokens_per_batch == 16384
    assert [(d.num_layers, d.block_size, d.devices) for d in job.drafters] == [(5, 16, ["cuda:0"])] * 2
