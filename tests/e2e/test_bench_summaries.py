"""The benchmarks' own arithmetic and plumbing on known input (their figures are not asserted: no timing)."""

import ast
import importlib
from pathlib import Path

import pytest

from bench import all as bench_all
from bench import pipeline, scaleout, transport

ROOT = Path(__file__).resolve().parents[2]


def test_transport_summary_ratios_floor_and_growth():
    ms = 1e-3
    sizes = {k: transport.SIZES[k] for k in ("1MiB", "64MiB", "256MiB")}
    ring = {
        "e2e": {"1MiB": [0.5 * ms] * 3, "64MiB": [20 * ms, 21 * ms, 19 * ms], "256MiB": [80 * ms]},
        "write": {k: [1 * ms] for k in sizes},
        "copy_out": {k: [2 * ms] for k in sizes},
        "ping": [0.1 * ms, 0.3 * ms, 0.2 * ms],
    }
    mpq = {"1MiB": [0.6 * ms], "64MiB": [30 * ms], "256MiB": [90 * ms]}
    zcopy = {"1MiB": [0.7 * ms], "64MiB": [60 * ms], "256MiB": [240 * ms]}
    memcpy = {"1MiB": [0.05 * ms], "64MiB": [5 * ms], "256MiB": [20 * ms]}
    r = transport.summarise(sizes, ring, mpq, zcopy, memcpy, 30.0)
    assert r["e2e_ms"]["ring"]["64MiB"] == 20.0  # medians
    assert r["e2e_ratio_mpqueue_pool_over_ring_64MiB"] == 1.5
    assert r["e2e_ratio_zmqcopy_over_ring_64MiB"] == 3.0
    assert r["zmq_roundtrip_ms"] == 0.2
    assert r["e2e_ms_two_copy_floor"]["64MiB"] == 10.2  # 2 x memcpy + round trip
    assert r["e2e_growth_1_to_256MiB"] == 160.0
    assert r["memcpy_growth_1_to_256MiB"] == 400.0
    assert r["targets_met"] == {
        "e2e_ratio_mpqueue_pool_over_ring_64MiB": True,
        "e2e_ratio_zmqcopy_over_ring_64MiB": True,
    }


def test_transport_fp8_key_halves_the_bytes_per_batch():
    f = transport.run_fp8({"1MiB": 1 << 20}, reps=1)
    # 204 tokens × 2560 features: bf16 1,044,480 B of features; fp8 522,240 B plus 816 B of float32 scales
    assert f["bytes_per_batch"] == {"bf16": {"1MiB": 1_046_792}, "fp8": {"1MiB": 525_576}}
    assert f["fp8_over_bf16_bytes"] == {"1MiB": 0.5021}
    assert f["quantize_ms"]["1MiB"] > 0 and f["dequantize_ms"]["1MiB"] > 0


def test_transport_ring_copy_out_keeps_the_consumers_own_bytes():
    batch = transport.make_batch(1 << 20, seq=12)
    mine = transport.copy_out(transport.own_buffers(4 << 20), batch)
    assert transport.holds(mine, 12) and not transport.holds(mine, 13)
    batch["input_ids"][0] = 99  # the slot is rewritten after release: the consumer's copy is unchanged
    assert transport.holds(mine, 12)
    assert all(m.data_ptr() != b.data_ptr() for m, b in zip(mine.values(), batch.values(), strict=True))


def test_pipeline_serial_baseline_on_both_cores_is_the_faster_thread_count():
    assert (
        pipeline.best_serial_same_cores({"serial_2_threads": 900.0, "serial_1_thread_2_cores": 1000.0})
        == "serial_1_thread_2_cores"
    )
    assert (
        pipeline.best_serial_same_cores({"serial_2_threads": 1500.0, "serial_1_thread_2_cores": 1000.0})
        == "serial_2_threads"
    )


def _pipeline_run(rate: float) -> dict:
    detail = {
        k: 1.0
        for k in (
            "window_tokens",
            "consumer_wait_batch_pct",
            "producer_wait_slot_pct",
            "producer_forward_tokens_per_s",
            "consumer_train_tokens_per_s",
            "target_core_busy_pct",
            "drafter_core_busy_pct",
            "other_load_cores",
        )
    }
    return detail | {
        "tokens_per_s": rate,
        "producer_cpu_tokens_per_s": 2 * rate,
        "drafter_core_cpu_tokens_per_s": 3 * rate,
        "limited_by": "producer",
        "affinity": {},
    }


def test_pipeline_summary_sets_the_pipeline_against_its_stages_alone_and_co_run():
    rates = {
        "producer_alone": 1000.0,
        "consumer_alone": 1200.0,
        "serial": 500.0,
        "serial_2_threads": 700.0,
        "serial_1_thread_2_cores": 600.0,
        "heavy_producer_alone": 300.0,
        "heavy_consumer_alone": 900.0,
        "co_run_producer": 800.0,
        "co_run_consumer": 1100.0,
    }
    stages = [
        {
            "tokens_per_s": dict(rates),
            "cpu_tokens_per_s": {k: 2 * v for k, v in rates.items()},
            "other_load_cores": 0.1,
            "co_run_other_load_cores": 0.2,
        }
        for _ in range(3)
    ]
    runs = {
        "pipeline": [_pipeline_run(r) for r in (700.0, 720.0, 2000.0)],  # the median, not the mean
        "heavy_pipeline_1_drafter": [_pipeline_run(280.0)] * 3,
        "heavy_pipeline_2_drafters": [_pipeline_run(250.0)] * 3,
    }
    r = pipeline.summarise(stages, runs, (0, 1), [0, 1])
    assert r["tokens_per_s"]["pipeline"] == 720.0
    assert r["pipeline_efficiency"] == 0.72  # 720 / min(1000, 1200): the definition, kept
    assert r["pipeline_efficiency_vs_co_run"] == 0.9  # 720 / min(800, 1100)
    assert r["co_run_slowdown_producer"] == 1.25 and r["co_run_slowdown_consumer"] == round(1200 / 1100, 3)
    assert r["speedup_over_serial_same_cores"] == round(720 / 700, 3)  # the faster of the two serial loops
    assert r["fanout_2_drafters_cost"] == 1.12 and r["targets_met"]["fanout_2_drafters_cost"] is False
    assert r["co_run_other_load_cores"] == 0.2
    assert r["cpu_time_view"]["pipeline_efficiency_vs_co_run"] == round(1440 / 1600, 3)


def test_scaleout_reads_the_steady_profile_lines(tmp_path):
    lines = [
        "12:00:00 producer INFO prof 5.0s | forward 10×100.00ms (max 120.00) 90.0% | tokens=100/s",  # start-up
        "12:00:05 producer INFO prof 5.0s | forward 10×50.00ms (max 60.00) 10.0% | wait_slot 1×1.00ms (max 1) 1.0%",
        "12:00:07 producer INFO batch 3 sent",
        "12:00:10 producer INFO prof 10.0s | forward 10×50.00ms (max 60.00) 40.0%",
        "12:00:12 producer INFO prof 2.0s | forward 1×1.00ms (max 1.00) 0.1%",  # the drain
    ]
    (tmp_path / "producer.out").write_text("\n".join(lines) + "\n")
    (tmp_path / "consumer0.out").write_text("no profile lines\n")
    shares = scaleout.profile_shares(tmp_path, 1)
    assert shares["producer_forward_pct"] == 30.0  # (0.5 s + 4 s) / 15 s
    assert shares["allreduce_wait_pct"] == 0.0


@pytest.mark.slow  # six interpreters importing torch
def test_bench_all_quick_passes_each_bench_only_flags_it_has(capsys):
    """Each benchmark's own --help (its main, in this process: eight interpreters importing torch cost CI
    about a minute) names every flag bench.all --quick passes, and `python -m bench.NAME` runs that main."""
    assert set(bench_all.QUICK_ARGS) == set(bench_all.BENCHES)
    for name, args in bench_all.QUICK_ARGS.items():
        module = importlib.import_module(f"bench.{name}")
        with pytest.raises(SystemExit) as exited:
            module.main(["--help"])
        assert exited.value.code == 0, f"bench.{name} --help exited {exited.value.code}"
        usage = capsys.readouterr().out
        for flag in (a for a in args if a.startswith("--")):
            assert flag in usage, f"bench.{name} has no {flag} (bench.all --quick passes it)"
        tree = ast.parse(Path(module.__file__).read_text())
        guards = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'"]
        assert guards and "main(" in ast.unparse(guards[0]), f"python -m bench.{name} does not run its main"


def test_bench_all_refuses_an_unknown_bench(capsys):
    with pytest.raises(SystemExit):
        bench_all.main(["--only", "transport,warp"])
    assert "unknown benchmark(s) ['warp']" in capsys.readouterr().err
