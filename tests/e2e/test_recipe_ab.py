"""bench/recipe_ab.py without training: the job it writes (one drafter per variant × block, the overrides as
drafter keys, the demo's shared keys, --epochs), the table's Δ against the first variant and each drafter's
cost read from its consumer log (bench/ab_logs.py)."""

from __future__ import annotations

import json
import tomllib

import pytest

import bench.recipe_ab as recipe_ab
from bench.ab_logs import drafter_cost
from bench.recipe_ab import VARIANTS, table, write_job
from common.config import DrafterConfig


def test_the_ab_job_has_one_drafter_per_variant_and_block_with_its_overrides(tmp_path):
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "READY").write_text(json.dumps({"train_batches": 720}))
    job = tomllib.loads(write_job(tmp_path / "ab", assets, VARIANTS, [16, 8], quick=False).read_text())
    drafters = [DrafterConfig(**d) for d in job["drafters"]]
    assert [(d.name, d.block_size, d.loss, d.optimizer) for d in drafters] == [
        ("decay_adamw_b16", 16, "decay", "adamw"),
        ("decay_adamw_b8", 8, "decay", "adamw"),
        ("dpace_adamw_b16", 16, "dpace", "adamw"),
        ("dpace_adamw_b8", 8, "dpace", "adamw"),
        ("dpace_muon_b16", 16, "dpace", "muon"),
        ("dpace_muon_b8", 8, "dpace", "muon"),
        ("dflash2_dpace_b16", 16, "dpace", "adamw"),
        ("dflash2_dpace_b8", 8, "dpace", "adamw"),
        ("swa_causal_b16", 16, "dpace", "adamw"),
        ("swa_causal_b8", 8, "dpace", "adamw"),
        ("swa_bidir_b16", 16, "dpace", "adamw"),
        ("swa_bidir_b8", 8, "dpace", "adamw"),
    ]
    assert [(d.arch, d.block_attention) for d in drafters[6:]] == [("dflash2", "bidirectional")] * 2 + [
        ("dflash1", "causal")
    ] * 2 + [("dflash1", "bidirectional")] * 2
    assert {(d.lr, d.total_steps, d.seed, d.num_layers) for d in drafters} == {(3e-3, 720, None, 2)}  # the same
    assert job["job"]["name"] == "recipe_ab" and (tmp_path / "ab" / "assets").resolve() == assets.resolve()
    with pytest.raises(SystemExit, match="no complete demo build"):
        write_job(tmp_path / "ab2", tmp_path, VARIANTS, [16], quick=False)


def test_a_dspark_variant_is_a_drafter_of_its_own_arch(tmp_path):
    """bench.recipe_ab --quick --variants '{"dspark": {"arch": "dspark"}}': the head A/B's DSpark entry, its row
    "block b" trained at block b - 1 so that it drafts b - 1 tokens verified b wide, as a DFlash block of b does."""
    from bench.recipe_ab import main

    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "READY").write_text(json.dumps({"train_batches": 40}))
    variants = {"dflash1": {}, "dspark": {"arch": "dspark"}}
    job = tomllib.loads(write_job(tmp_path / "ab", assets, variants, [16, 8], quick=True).read_text())
    drafters = [DrafterConfig(**d) for d in job["drafters"]]
    assert [(d.name, d.arch, d.block_size) for d in drafters] == [
        ("dflash1_b16", "dflash1", 16),
        ("dflash1_b8", "dflash1", 8),
        ("dspark_b16", "dspark", 15),
        ("dspark_b8", "dspark", 7),
    ]
    assert drafters[2].markov_rank == 256 and drafters[2].loss_gamma == 4.0  # DeepSpec's recipe defaults
    with pytest.raises(SystemExit, match="no complete demo build"):  # the command line parses the same variants
        main(["--quick", "--variants", '{"dspark": {"arch": "dspark"}}', "--assets", str(tmp_path / "none")])


def test_epochs_sets_the_data_passes_and_the_schedule_to_that_plan(tmp_path, monkeypatch):
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "READY").write_text(json.dumps({"train_batches": 720}))
    planned = []
    monkeypatch.setattr(recipe_ab, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(
        recipe_ab, "planned_batches", lambda path, tok, size, seed, validation: planned.append(size.epochs) or 361
    )
    job = tomllib.loads(write_job(tmp_path / "ab", assets, {"a": {}}, [16], quick=False, epochs=1).read_text())
    assert planned == [1] and job["data"]["epochs"] == 1
    assert [d["total_steps"] for d in job["drafters"]] == [361]


LOG = (
    "2026-12-06 09:13:22,577 a_b16.r0 INFO consumer step=2 cpu=8% | prof 2.0s | forward 2×100.00ms (max 150.00)"
    " 10.0% | backward 2×200.00ms (max 210.00) 20.0% | optimizer 2×50.00ms (max 60.00) 5.0% | wait_batch 2×900.00ms"
    " (max 990.00) 90.0% | anchors 2×1.00ms (max 1.00) 0.1% | anchors=50/s candidates=100/s batches=1/s steps=1/s\n"
    "2026-12-06 09:13:22,577 a_b16.r0 INFO a line without timers\n"
    "2026-12-06 09:13:24,577 a_b16.r0 INFO consumer step=3 cpu=8% | prof 1.0s | forward 1×400.00ms (max 400.00)"
    " 40.0% | optimizer 1×100.00ms (max 100.00) 10.0% | anchors=10/s candidates=40/s batches=1/s steps=1/s\n"
)


def test_the_cost_of_a_drafter_sums_its_work_timers_and_counters_over_its_log(tmp_path):
    (tmp_path / "log").write_text(LOG)
    cost = drafter_cost(tmp_path / "log")
    # (2·(100+200+50+1) + 400 + 100) ms over 3 steps, waits left out; (100 + 10) anchors, (200 + 40) candidates
    # over 3 batches
    assert (cost.steps, cost.ms_per_step) == (3, pytest.approx(1202 / 3))
    assert (cost.anchors_per_batch, cost.candidates_per_batch) == (pytest.approx(110 / 3), pytest.approx(80.0))
    (tmp_path / "empty").write_text("no periodic line\n")
    with pytest.raises(ValueError, match="no timed optimizer step"):
        drafter_cost(tmp_path / "empty")


def test_the_table_gives_each_variant_its_delta_against_the_first_at_the_same_block(tmp_path):
    reports = {
        "a_b16": {"tau": 8.0, "lossless": True},
        "b_b16": {"tau": 8.8, "lossless": True},
        "a_b8": {"tau": 5.0, "lossless": True},
        "b_b8": {"tau": 4.5, "lossless": False},
    }
    for name in reports:
        (tmp_path / f"consumer-{name}-r0.log").write_text(LOG)
    rows = table(reports, {"a": {}, "b": {}}, [16, 8], tmp_path)
    assert [
        (r["variant"], r["block"], round(r["delta"], 6), round(r["delta_pct"], 6), r["lossless"]) for r in rows
    ] == [("a", 16, 0.0, 0.0, True), ("b", 16, 0.8, 10.0, True), ("a", 8, 0.0, 0.0, True), ("b", 8, -0.5, -10.0, False)]
    assert {r["steps"] for r in rows} == {3}
