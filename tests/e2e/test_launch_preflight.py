"""launch.sh checks the job's target before it starts anything (common.launch_plan --check-target): a target
that is not a model folder is one line naming the job file, the key and what is wrong, exit 2, and no process,
run folder or lock was made."""

import json
import subprocess
from pathlib import Path

import pytest

from bench.harness import write_job
from tests.jobs import finish, launch


def target_job(tmp_path: Path, target: Path) -> Path:
    return write_job(
        tmp_path / "job.toml",
        {
            "job": {"name": "preflight", "run_dir": str(tmp_path / "run")},
            "target": {"path": str(target)},
            "data": {"path": str(tmp_path / "train.jsonl")},
            "drafters": [{"name": "d0"}],
        },
    )


def no_config(t: Path) -> None:
    t.mkdir()


def bad_json(t: Path) -> None:
    t.mkdir()
    (t / "config.json").write_text('{"model_type": "qwen3",')


def json_list(t: Path) -> None:
    t.mkdir()
    (t / "config.json").write_text(json.dumps([1, 2]))


def a_file(t: Path) -> None:
    t.write_text("weights?")


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (None, "'{t}' does not exist (a local model folder, or a hub id owner/name)"),
        (a_file, "'{t}' is not a folder (a model folder holds config.json and the weights)"),
        (no_config, "'{t}' has no config.json: not a Hugging Face model folder"),
        (bad_json, "{t}/config.json is not valid JSON: Expecting"),
        (json_list, "{t}/config.json holds a JSON list, not an object"),
    ],
)
def test_a_target_that_is_not_a_model_folder_stops_the_launch_before_anything_starts(tmp_path, make, reason):
    target = tmp_path / "models" / "missing"
    target.parent.mkdir()
    if make:
        make(target)
    job = target_job(tmp_path, target)
    proc = launch(job)
    out = finish(proc, timeout=60)
    assert proc.returncode == 2, out
    assert out.startswith(f"{job}: target.path: {reason.format(t=target)}"), out
    assert len(out.strip().splitlines()) == 1, out  # one line, and nothing was started
    assert not (tmp_path / "run").exists()  # no run folder, lock or log
    assert subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode == 1  # no process left


def test_a_dry_run_plans_a_target_that_is_not_on_this_machine(tmp_path):
    """--dry-run is the pre-flight of a job for another machine: the target need not be here."""
    job = target_job(tmp_path, tmp_path / "elsewhere")
    proc = launch(job, "--dry-run")
    out = finish(proc, timeout=60)
    assert proc.returncode == 0 and "producer" in out and "does not exist" not in out, out


def test_a_misspelt_key_stops_the_launch_naming_the_key_meant(tmp_path):
    job = target_job(tmp_path, tmp_path / "models" / "t")
    job.write_text(job.read_text().replace("[[drafters]]\n", "[[drafters]]\nblock_sise = 8\n"))
    proc = launch(job)
    out = finish(proc, timeout=60)
    assert proc.returncode == 2, out
    assert out.splitlines() == [
        f"{job}: invalid job file (1 error(s))",
        "  drafters.0.block_sise: unknown key (did you mean 'block_size'?)",
    ]
    assert not (tmp_path / "run").exists()


def test_a_head_loss_or_optimizer_this_version_does_not_know_stops_the_launch_listing_the_valid_names(tmp_path):
    job = target_job(tmp_path, tmp_path / "models" / "t")
    job.write_text(job.read_text().replace("[[drafters]]\n", "[[drafters]]\narch = 'eagle3'\noptimizer = 'lion'\n"))
    proc = launch(job)
    out = finish(proc, timeout=60)
    assert proc.returncode == 2, out
    assert sorted(out.splitlines()) == [
        "  drafters.0.arch: unknown value 'eagle3'; this version knows: dflash1, dflash2, dspark",
        "  drafters.0.optimizer: unknown value 'lion'; this version knows: adamw, muon",
        f"{job}: invalid job file (2 error(s))",
    ]
    assert not (tmp_path / "run").exists()  # nothing started: no run folder, lock or log
    assert subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode == 1
