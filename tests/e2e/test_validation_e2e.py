"""A job with a held-out split, its telemetry, producer and consumers as real processes: the validation passes
reach metrics.jsonl and the plot, `best` follows the highest held-out τ, the audit passes. Drafter d0 has one
replica; d1 has two (a gloo group): its passes reach one replica, and the writer keeps `best`."""

from __future__ import annotations

import json
import signal

import pytest

from bench.harness import free_port, spawn
from common.accounting_check import check_run, read_records
from common.checkpoint_pointer import BEST, read_pointer
from producer.validation import split_held_out
from telemetry.plot import plot_training, read_series
from tests.jobs import tiny_assets, wait_all, write_job

DRAFTER = {
    "name": "d0",
    "block_size": 8,
    "num_layers": 1,
    "anchors_per_seq": 16,
    "loss_chunk_rows": 64,
    "checkpoint_every": 1000,
    "log_every": 4,
    "total_steps": 100,
    "lr": 3e-3,
}
EVAL_EVERY = 6
GROUP = {**DRAFTER, "name": "d1", "replicas": 2}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"))


@pytest.mark.slow
def test_a_job_with_a_held_out_split_logs_val_metrics_keeps_the_best_and_audits(assets, tmp_path):
    job = write_job(
        assets,
        drafters=[DRAFTER, GROUP],
        tokens_per_batch=2048,
        name="val",
        overrides={
            "transport": {"heartbeat_timeout_s": 20.0},  # a loaded machine
            "data": {"validation": 0.1, "eval_every": EVAL_EVERY, "validation_max_records": 8},
        },
    )
    run = job.parent
    logs = {name: tmp_path / f"{name}.log" for name in ("telemetry", "producer", "consumer", "d1_r0", "d1_r1")}
    telemetry = spawn(["-m", "telemetry", "--job", job], logs["telemetry"])
    group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    workers = [
        spawn(["-m", "producer", "--job", job], logs["producer"]),
        spawn(["-m", "consumer", "--job", job, "--drafter", "d0"], logs["consumer"]),
        *(
            spawn(["-m", "consumer", "--job", job, "--drafter", "d1", "--replica", r], logs[f"d1_r{r}"], env=group)
            for r in (0, 1)
        ),
    ]
    out = "".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in logs.values())
    try:
        assert wait_all(workers, timeout=420) == [0] * 4, out
    finally:
        telemetry.send_signal(signal.SIGTERM)  # its final window, then exit
        assert wait_all([telemetry], timeout=60) == [0]
    out = "".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in logs.values())
    records, _ = read_records([run])
    plan = next(r for r in records if r["kind"] == "plan")
    total = plan["total_batches"]
    held = split_held_out(240, 0.1, 7).tolist()
    assert plan["validation"]["held_out_ids"] == held and plan["validation"]["samples"] == 8
    trained = {s for r in records if r["kind"] == "batch" for s in r["samples"]}
    assert trained == set(range(240)) - set(held)  # every other record trained, no held-out one

    passes = [r for r in records if r["kind"] == "evaluation" and r["drafter"] == "d0"]
    want_steps = [*range(EVAL_EVERY, total, EVAL_EVERY), total]  # one batch a step; the end of the data has one
    # (a consumer that stalls past the heartbeat bound right after a boundary has that pass again: same step)
    assert sorted({(r["pass"], r["step"]) for r in passes}) == list(enumerate(want_steps, start=1)), out[-3000:]
    assert all(sorted(r["samples"]) == sorted(passes[0]["samples"]) and len(r["samples"]) == 8 for r in passes)

    report = check_run(run)
    d0 = report.drafters["d0"]
    assert report.ok and d0.complete, out[-3000:]
    v = d0.validation
    assert (v.held_out, v.pass_samples, v.passes_sent, v.passes_exact, v.held_out_trained) == (
        24,
        8,
        len(want_steps),
        len(passes),
        0,
    )

    ckpts = run / "checkpoints" / "d0"
    best = max(passes, key=lambda r: (r["tau"], -r["step"]))  # the highest τ; a tie keeps the earlier
    assert json.loads((ckpts / "best.json").read_text())["step"] == best["step"]
    assert read_pointer(ckpts, BEST) == f"step_{best['step']}" and (ckpts / "best" / "model.safetensors").is_file()

    metrics = [json.loads(line)["metrics"] for line in (run / "telemetry" / "metrics.jsonl").read_text().splitlines()]
    seen = {k for m in metrics for k in m}
    assert {
        "consumer/d0_r0/val_loss",
        "consumer/d0_r0/val_tau_est",
        "consumer/d0_r0/val_acc_slot_1",
        "consumer/d0_r0/val_step",
        "producer/val_batches",
        "producer/validation_ms",
    } <= seen, sorted(seen)
    series, _ = read_series(run / "telemetry" / "metrics.jsonl")
    curve = series["d0_r0"].val_tau
    assert curve and {s for s, _ in curve} <= set(want_steps)  # the held-out curve: one point per pass
    assert all(abs(tau - next(r["tau"] for r in passes if r["step"] == s)) < 1e-9 for s, tau in curve)
    assert plot_training(run / "telemetry" / "metrics.jsonl", tmp_path / "training.png").stat().st_size > 10_000

    # d1, two replicas: each pass evaluated once (by one replica), its best kept by the writer, audited
    group_passes = [r for r in records if r["kind"] == "evaluation" and r["drafter"] == "d1"]
    assert sorted({r["pass"] for r in group_passes}) == list(range(1, len(want_steps) + 1)), out[-3000:]
    d1 = report.drafters["d1"]
    assert d1.complete and (d1.validation.passes_sent, d1.validation.held_out_trained) == (len(want_steps), 0)
    top = max(group_passes, key=lambda r: (r["tau"], -r["step"]))
    record = json.loads((run / "checkpoints" / "d1" / "best.json").read_text())
    assert (record["step"], record["tau"]) == (top["step"], top["tau"]), out[-3000:]
    assert (run / "checkpoints" / "d1" / "best" / "model.safetensors").is_file()
