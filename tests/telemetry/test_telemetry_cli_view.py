"""What a user looks at: the live table fits 80 columns with whole headers and shows loss and τ per
drafter; the PNG pictures of a run (training curves, acceptance histogram) are drawn from metrics.jsonl."""

from __future__ import annotations

import io
import json
import time

import pytest
from rich.console import Console

from telemetry import cli, plot


def window(t: float, step: int, loss: float, tau: float) -> dict:
    """A telemetry window as telemetry/service.py builds it: a producer and two drafter replicas."""
    names = ("d_b16_r0", "verylongdrafternamethatgoesonandon_r0")
    sources = [{"source": "producer.producer", "role": "producer", "name": "producer", "state": "live", "step": None,
                "tokens_per_s": 123456.7, "wait_pct": 12.3, "busy_pct": 87.6, "age_s": 0.4, "gaps": 0}]  # fmt: skip
    sources += [{"source": f"consumer.{n}", "role": "consumer", "name": n, "state": "live", "step": step,
                 "tokens_per_s": 98765.4, "wait_pct": 1.2, "busy_pct": 99.1, "age_s": 1.5, "gaps": 2}
                for n in names]  # fmt: skip
    metrics = {"pipeline/tokens_per_s": 123456.7, "producer/tokens_per_s": 123456.7}
    for i, n in enumerate(names):
        metrics |= {f"consumer/{n}/step": float(step), f"consumer/{n}/loss": loss + i,
                    f"consumer/{n}/tau_est": tau + i, f"consumer/{n}/tokens_per_s": 1000.0 * (i + 1)}  # fmt: skip
    return {"time": t, "uptime_s": 10.0, "window_s": 5.0, "job": "demo", "run_dir": "/r", "metrics": metrics,
            "sources": sources, "gpus": [], "ring": {"slots_total": 4, "slots_in_use": 2}, "health": {}}  # fmt: skip


def test_the_table_fits_80_columns_with_whole_headers_and_shows_loss_and_tau():
    state = cli.view(window(time.time(), 123456, 2.3456, 7.891))
    assert [(p["loss"], p["tau_est"]) for p in state["processes"]] == [(None, None), (2.3456, 7.891), (3.3456, 8.891)]
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(cli.render(state))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "process" in line)
    assert header.split() == ["process", *list(cli.PROCESS_COLUMNS)[:-1], "age", "s"]
    row = next(line for line in lines if line.split()[:1] == ["d_b16_r0"])
    assert row.split() == ["d_b16_r0", "live", "123456", "98765", "1", "99", "2.346", "7.89", "1.5"]
    assert any(line.split()[:1] == ["verylongdrafternamet…"] and "3.346" in line for line in lines)
    producer = next(line for line in lines if line.split()[:1] == ["producer"])
    assert producer.split()[-3:] == ["-", "-", "0.4"]  # no loss or τ for a producer


def test_the_plain_line_carries_loss_and_tau():
    line = cli.plain_line(cli.view(window(time.time(), 7, 1.5, 3.25)))
    assert "d_b16_r0=live/step 7/98765 tok/s/loss 1.500/τ 3.25" in line
    assert "producer=live/step -/123457 tok/s d_b16_r0=" in line  # no loss or τ for a producer


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "telemetry").mkdir()
    lines = [json.dumps(window(1000.0 + 5 * k, 10 * k, 5.0 - k, 1.0 + k / 2)) for k in range(1, 5)]
    (tmp_path / "telemetry" / "metrics.jsonl").write_text("\n".join(lines) + '\n{"torn')
    return tmp_path


def test_series_come_from_metrics_jsonl(run_dir):
    series, pipeline = plot.read_series(run_dir / "telemetry" / "metrics.jsonl")
    s = series["d_b16_r0"]
    assert s.loss == [(10.0, 4.0), (20.0, 3.0), (30.0, 2.0), (40.0, 1.0)]
    assert s.tau == [(10.0, 1.5), (20.0, 2.0), (30.0, 2.5), (40.0, 3.0)]
    assert s.tokens_per_s == [(0.0, 1000.0), (5.0, 1000.0), (10.0, 1000.0), (15.0, 1000.0)]
    assert series["verylongdrafternamethatgoesonandon_r0"].loss[0] == (10.0, 5.0)
    assert pipeline == [(0.0, 123456.7), (5.0, 123456.7), (10.0, 123456.7), (15.0, 123456.7)]


def test_plot_writes_the_training_curves_and_the_acceptance_histogram(run_dir, capsys):
    report = {"block_size": 8, "tau": 4.5, "tau_histogram": [3, 1, 0, 0, 1, 2, 0, 5]}
    (run_dir / "eval.json").write_text(json.dumps({"d_b8": report, "d_b16": report | {"block_size": 16}}))
    assert plot.main([str(run_dir)]) == 0
    assert capsys.readouterr().out.split() == ["wrote", str(run_dir / "plots" / "training.png"),
                                               "wrote", str(run_dir / "plots" / "acceptance.png")]  # fmt: skip
    from PIL import Image

    for name, size in (("training.png", (1500, 420)), ("acceptance.png", (1100, 400))):
        with Image.open(run_dir / "plots" / name) as img:
            assert img.format == "PNG" and img.size == size
            assert len(img.convert("L").getcolors(1 << 16)) > 20  # drawn, not blank


def test_plot_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert plot.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"telemetry.plot: run directory {tmp_path / 'nope'} does not exist\n"
    assert plot.main([str(tmp_path)]) == 2
    want = f"telemetry.plot: no {tmp_path / 'telemetry' / 'metrics.jsonl'}: has this job's telemetry run?\n"
    assert capsys.readouterr().err == want
    assert cli.main([str(tmp_path), "--plot"]) == 2  # dflash-stats --plot: the same, with no telemetry socket
    assert capsys.readouterr().err == want
    (tmp_path / "telemetry").mkdir()
    (tmp_path / "telemetry" / "metrics.jsonl").write_text('{"time": 1, "metrics": {}}\n')
    (tmp_path / "bad.json").write_text('{"d0": {"tau": 2}}')
    assert plot.main([str(tmp_path), "--eval", str(tmp_path / "bad.json")]) == 2
    assert (
        capsys.readouterr().err == f"{tmp_path / 'bad.json'}: no tau_histogram in it (expected a dflash-eval report)\n"
    )
