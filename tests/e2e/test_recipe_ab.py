"""bench/recipe_ab.py without training: the job it writes (one drafter per variant × block, the overrides as
drafter keys, the demo's shared keys) and the table's Δ against the first variant."""

from __future__ import annotations

import json
import tomllib

import pytest

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


def test_the_table_gives_each_variant_its_delta_against_the_first_at_the_same_block():
    reports = {
        "a_b16": {"tau": 8.0, "lossless": True},
        "b_b16": {"tau": 8.8, "lossless": True},
        "a_b8": {"tau": 5.0, "lossless": True},
        "b_b8": {"tau": 4.5, "lossless": False},
    }
    rows = table(reports, {"a": {}, "b": {}}, [16, 8])
    assert [
        (r["variant"], r["block"], round(r["delta"], 6), round(r["delta_pct"], 6), r["lossless"]) for r in rows
    ] == [("a", 16, 0.0, 0.0, True), ("b", 16, 0.8, 10.0, True), ("a", 8, 0.0, 0.0, True), ("b", 8, -0.5, -10.0, False)]
