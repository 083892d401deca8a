"""bench.gpu_check without a GPU: its plan fits the lend, it prints the plan and exits 0; a failing stage still
gives its JSON line; its parsers and report writer on known input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check, gpu_check_plan, gpu_check_stages
from bench.gpu_check_plan import PLAN, size_for
from common.config import load_job
from common.memory_plan import WARN_FRACTION

ROOT = Path(__file__).resolve().parents[2]


def test_without_cuda_it_prints_the_plan_with_budgets_exits_0_and_writes_nothing():
    md = ROOT / "docs" / "gpu.md"
    before = md.read_bytes()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device is visible" in proc.stdout and "an H200's, no device seen" in proc.stdout
    assert "  pipeline     60 s   50 s   110 s  88.3 GiB  telemetry (NVML) + producer + 2 consumers" in proc.stdout
    for stage, p in PLAN.items():
        assert f"  {stage:9s} {p.compile_s:5d} s {p.run_s:4d} s {p.budget_s:5d} s " in proc.stdout
    assert "  total       220 s  295 s   515 s" in proc.stdout
    assert md.read_bytes() == before


def _planned(out: str) -> dict[str, float]:
    """stage → planned GiB from --plan's lines."""
    rows = [li.split() for li in out.splitlines() if li.startswith("  ") and li.split()[0] in PLAN]
    return {r[0]: float(r[7]) for r in rows if r[8] == "GiB"}


@pytest.mark.parametrize(
    ("gib", "pipeline", "pipeline_tokens"), [(79, 68.4, "8,192"), (139.7, 88.3, "12,288"), (143.8, 88.3, "12,288")]
)
def test_plan_sizes_every_stage_to_the_given_memory(gib, pipeline, pipeline_tokens):
    """An H100 (79 GiB) gets a smaller pipeline batch, every stage within 92 % of it; an H200 today's plan."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--plan", "--device-memory", str(gib)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    planned = _planned(proc.stdout)
    assert planned == {
        "ipc": 1.0, "memory": 0.5, "assets": 5.0, "producer": 16.0, "consumer": 50.1, "pipeline": pipeline, "export": 8.1
    }  # fmt: skip
    assert max(planned.values()) <= WARN_FRACTION * gib and "skipped" not in proc.stdout
    assert f"for 40 s at {pipeline_tokens} tokens" in proc.stdout


def test_a_device_too_small_for_a_stage_skips_it_and_says_why():
    sizing = size_for(40)
    assert (sizing.stage_tokens, sizing.pipeline_tokens) == (8192, None)
    assert sizing.does_not_fit() == {"pipeline": "does not fit 40 GiB (49.0 GiB planned at 4096 tokens; 36.8 usable)"}
    assert size_for(79).stage_tokens == 16384 and size_for(139.7).pipeline_tokens == 12288


def test_the_plan_fits_the_lend_every_stage_its_budget_and_the_gpu_its_memory():
    budgets = [p.budget_s for p in PLAN.values()]
    limits = (gpu_check_plan.STAGE_LIMIT_S, gpu_check_plan.TOTAL_LIMIT_S)
    assert max(budgets) <= limits[0] == 240 and sum(budgets) <= limits[1] == 540
    assert set(PLAN) == set(gpu_check_stages.STAGES)  # every stage is planned, every planned one runs
    assert next(iter(PLAN)) == "ipc" and [s for s, p in PLAN.items() if p.needs_ipc] == ["pipeline"]
    # the pipeline's own wait fits its budget: start, the measured window, and the kill
    assert gpu_check.budget("pipeline") >= gpu_check.PIPELINE_START_S + gpu_check.PIPELINE_S + 10


@pytest.mark.slow
def test_the_planned_memory_is_the_planners_output_at_the_stages_shapes():
    replanned = gpu_check_plan.planned_memory()
    assert replanned == {
        "fixed": gpu_check_plan.FIXED_GIB,
        "stages": gpu_check_plan.STAGE_SHAPES,
        "pipeline": gpu_check_plan.PIPELINE_SHAPES,
    }


def test_ipc_probe_without_cuda_says_no_cuda():
    from bench.ipc_probe import probe, verdict

    answer = probe()
    assert answer["cuda"] is False and answer["cuda_ipc"] is False
    assert answer["says"].startswith("no CUDA: ") and "the ring cannot run here" in answer["says"]
    failed = verdict(True, False, "export: RuntimeError: CUDA error: operation not supported")
    assert failed["says"] == (
        "CUDA IPC does not work here (export: RuntimeError: CUDA error: operation not supported): the ring cannot"
        " run; the single-process stages still run, the pipeline stage and the ring's CUDA tests are skipped"
    )
    assert verdict(True, True)["says"].endswith("the ring can run")


def _fake_stages(ipc: dict, calls: list):
    def run(name, workdir, args):
        calls.append((name, args))
        if name == "ipc":
            return {"stage": "ipc", "ok": True, **ipc}
        return {"stage": name, "ok": True, "wall_s": 1.0}

    return run


def test_without_cuda_ipc_the_single_process_stages_run_and_the_report_says_what_was_skipped(tmp_path, capsys):
    from bench.ipc_probe import verdict

    calls = []
    ipc = verdict(True, False, "the other process: RuntimeError: invalid device context")
    results = gpu_check.run_stages(tmp_path, size_for(79), set(), run=_fake_stages(ipc, calls))
    assert [n for n, _ in calls] == ["ipc", "imports", "tests", "memory", "assets", "producer", "consumer", "export"]
    assert dict(calls)["tests"] == ["--device-memory", "79", "--no-ipc"]
    assert results["pipeline"] == {
        "stage": "pipeline",
        "ok": None,
        "skipped": "no CUDA IPC between processes here (the other process: RuntimeError: invalid device context):"
        " the slot ring cannot run",
    }
    assert "CUDA IPC does not work here" in capsys.readouterr().err
    table = gpu_check.render_table({"started": "now", "device": "H100", **results})
    assert "| pipeline, 2 drafters, tokens/s (slowest drafter) | skipped: no CUDA IPC between processes here" in table
    assert "| CUDA IPC between two processes (the ring) | False |" in table


def test_with_cuda_ipc_every_stage_runs_and_the_tests_keep_the_ring_files(tmp_path):
    from bench.ipc_probe import verdict

    calls = []
    results = gpu_check.run_stages(tmp_path, size_for(139.7), {"memory"}, run=_fake_stages(verdict(True, True), calls))
    assert [n for n, _ in calls] == [s for s in PLAN if s != "memory"]
    assert dict(calls)["tests"] == ["--device-memory", "139.7"] and results["memory"]["skipped"] == "--skip"


def test_the_tests_stage_collects_the_cuda_test_files_only():
    files = gpu_check_stages.cuda_test_files()
    assert "tests/consumer/test_drafter_cuda.py" in files and "tests/common/test_ring.py" in files
    assert "tests/e2e/test_launch.py" not in files and all(f.startswith("tests/") for f in files)
    assert set(gpu_check_stages.IPC_TEST_FILES) <= set(files)


def test_a_failing_stage_still_gives_its_json_line(tmp_path):
    result = gpu_check.run_stage("memory", tmp_path, [])  # no CUDA here: the stage fails inside, as on a broken GPU
    assert result["stage"] == "memory" and result["ok"] is False
    assert result["error"].split(":")[0] in {"RuntimeError", "AssertionError"} and result["wall_s"] >= 0


def test_the_stage_plan_has_batches_the_warmup_never_sees(tmp_path):
    from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer, write_jsonl

    assets = tmp_path / "assets"
    tok = train_tokenizer(corpus_texts(synthetic_chats(600, seed=0)), 2000, assets / "tokenizer")
    build_tiny_target(assets / "target", tok, num_layers=2)  # a stand-in: the plan needs the tokenizer only
    write_jsonl(assets / "stage_chats.jsonl", synthetic_chats(gpu_check.STAGE_CHATS, seed=1))
    gpu_check.write_job(
        tmp_path / "stages" / "job.toml",
        tmp_path / "stages",
        assets,
        "stage_chats.jsonl",
        1,
        max(gpu_check_plan.STAGE_SHAPES),
    )
    _, batches = gpu_check_stages._batches(tmp_path)
    timed = batches[gpu_check.WARMUP_BATCHES :]
    assert len(timed) >= 8 and all(b.num_tokens <= max(gpu_check_plan.STAGE_SHAPES) for b in batches)
    assert len({b.num_tokens for b in timed}) > 1  # varying lengths: the compile counters see new shapes


def test_unknown_stage_to_skip_is_refused_with_the_stages_named(capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--skip", "tests,warp"])
    assert exc.value.code == 2
    assert "unknown stage(s) ['warp']" in capsys.readouterr().err


def test_junit_counts(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text("""<?xml version="1.0"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="ok1"/><testcase classname="tests.test_a" name="ok2"/>
<testcase classname="tests.test_a" name="bad"><failure message="x"/></testcase>
<testcase classname="tests.test_b" name="boom"><error message="y"/></testcase>
<testcase classname="tests.test_b" name="gpu2"><skipped message="needs 2 GPUs"/></testcase>
</testsuite></testsuites>""")
    counts = gpu_check_stages.junit_counts(xml)
    assert counts == {
        "passed": 2,
        "failed": 1,
        "errors": 1,
        "skipped": 1,
        "failing": ["tests.test_a::bad", "tests.test_b::boom"],
    }


def test_window_figures_are_medians_after_the_first_third(tmp_path):
    rates = [1.0, 2.0, 100.0, 110.0, 90.0, 105.0]  # the first two windows: start-up
    rows = [
        {
            "metrics": {
                "drafter/b16_0/tokens_per_s": r,
                "drafter/b16_1/tokens_per_s": r - 5,
                "pipeline/tokens_per_s": r + 1,
                "gpu/0/util_pct": 99.0,
            }
        }
        for r in rates
    ]
    rows.insert(0, {"metrics": {"gpu/0/util_pct": 0.0}})  # before anything trained: not a window
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = gpu_check_stages.window_figures(path)
    assert figures == {
        "windows": 4,
        "drafter/b16_0/tokens_per_s": 102.5,
        "drafter/b16_1/tokens_per_s": 97.5,
        "pipeline/tokens_per_s": 103.5,
    }


def test_the_table_goes_between_the_markers_and_a_failed_stage_says_why(tmp_path):
    md = tmp_path / "gpu.md"
    md.write_text(f"# title\n\n{gpu_check.MD_BEGIN}\nold\n{gpu_check.MD_END}\ntail\n")
    results = {
        "started": "2026-01-01 00:00 UTC",
        "device": "NVIDIA H200",
        "tests": {"ok": True, "passed": 31, "failed": 0, "errors": 0, "skipped": 2, "wall_s": 95.0},
        "producer": {
            "ok": True,
            "tokens_per_s": 51234.5,
            "gpu_mem_peak_gib": 16.1,
            "graphs_in_timed_batches": 0,
            "compile_s": 12.5,
            "run_s": 30.0,
            "wall_s": 50.0,
        },
        "consumer": {
            "ok": True,
            "tokens_per_s": 40000.0,
            "gpu_mem_peak_gib": 58.2,
            "nvml_on_over_off_step_time": 1.002,
            "graphs_in_timed_batches": 1,
            "wall_s": 90.0,
        },
        "pipeline": {"ok": False, "error": "RuntimeError: the pipeline did not start training", "wall_s": 70.0},
        "export": {"ok": True, "weights_equal": True, "wall_s": 20.0},
    }
    gpu_check.write_markdown(md, gpu_check.render_table(results))
    text = md.read_text()
    assert text.startswith("# title\n\n") and text.endswith(f"{gpu_check.MD_END}\ntail\n")
    assert "old" not in text
    assert "stage wall s: tests 95, producer 50, consumer 90, pipeline 70, export 20." in text
    assert "| compile s / run s, producer | 12.5 / 30 |" in text
    assert "| CUDA-marked tests (Triton compiled) | 31 passed, 0 failed, 0 errors, 2 skipped |" in text
    assert "| producer alone (36-layer 8B-shaped target), tokens/s | 51234.5 |" in text
    assert "| GPU memory peak, consumer (torch allocator) | 58.2 GiB |" in text
    assert "| Dynamo graphs compiled in the timed (unseen) batches, consumer | 1 |" in text
    assert "| pipeline, 2 drafters, tokens/s (slowest drafter) | failed: RuntimeError: the pipeline did not" in text
    assert "| CUDA context of one process (NVML), MiB | n/a |" in text
    assert "NVIDIA H200" in text


def test_dynamo_counts_see_a_recompile_on_a_new_shape():
    """The timed batches' "graphs compiled" figure counts a recompile: a static-shape function called at a new
    shape builds a second graph (torch's counters["recompiles"] stays 0, which the report read before)."""
    import torch
    import torch._dynamo

    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    f(torch.ones(3))
    warm = gpu_check_stages.dynamo_counts()
    f(torch.ones(3))  # the same shape: no new graph
    assert gpu_check_stages.dynamo_counts() == warm
    f(torch.ones(5))  # a new shape: a recompile
    after = gpu_check_stages.dynamo_counts()
    assert after["graphs"] - warm["graphs"] == 1 and after["frames"] - warm["frames"] == 1


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
    job = load_job(
        gpu_check.write_job(
            tmp_path / "pipe" / "job.toml",
            tmp_path / "pipe",
            assets,
            "chats.jsonl",
            gpu_check.PIPELINE_EPOCHS,
            max(gpu_check_plan.PIPELINE_SHAPES),
        )
    )
    assert job.target.layer_ids == [1, 2, 3, 4, 5] and job.target.dtype == "bfloat16"
    assert job.transport.kind == "cuda" and job.data.tokens_per_batch == 12288
    assert [(d.num_layers, d.block_size, d.devices) for d in job.drafters] == [(5, 16, ["cuda:0"])] * 2


def test_pipeline_stages_takes_the_default_layer_ids_when_the_job_names_none(tmp_path):
    """issue 23: bench.pipeline_stages did list(job.target.layer_ids), which fails on the default None."""
    from bench.pipeline_stages import target_layer_ids
    from common.config import dflash_layer_ids, parse_job
    from consumer.target_parts import load_target_parts
    from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer

    tok = train_tokenizer(corpus_texts(synthetic_chats(50, seed=0)), 400, tmp_path / "tok")
    target = build_tiny_target(tmp_path / "target", tok, num_layers=8)
    doc = {
        "target": {"path": str(target), "num_features": 3},
        "data": {"path": str(tmp_path / "d.jsonl")},
        "drafters": [{"name": "d", "num_layers": 1}],
    }
    parts = load_target_parts(target)
    assert target_layer_ids(parse_job(doc), parts) == dflash_layer_ids(8, 3) == [1, 3, 5]
    doc["target"]["layer_ids"] = [0, 7]
    assert target_layer_ids(parse_job(doc), parts) == [0, 7]
