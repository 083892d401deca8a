"""The systemd units are valid and start the same processes launch.sh starts."""

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_units_verify_without_warnings(tmp_path):
    for unit in UNITS.iterdir():
        shutil.copy(unit, tmp_path)
    shutil.copy(UNITS / "dflash-consumer@.service", tmp_path / "dflash-consumer@d0-1.service")
    names = ["dflash.target", "dflash-producer.service", "dflash-telemetry.service", "dflash-consumer@d0-1.service"]
    out = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *[tmp_path / n for n in names]], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stderr.strip() == "" and out.stdout.strip() == "", out.stdout + out.stderr


def unit(name):
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str
    cp.read(UNITS / name)
    return cp


def test_stop_and_restart_policy():
    for name in ("dflash-producer.service", "dflash-consumer@.service", "dflash-telemetry.service"):
        u = unit(name)
        assert u["Unit"]["PartOf"] == "dflash.target"
        assert "StartLimitBurst" in u["Unit"] and "StartLimitIntervalSec" in u["Unit"]  # [Unit], not [Service]
        assert u["Service"]["KillMode"] == "mixed" and u["Service"]["Restart"] in ("on-failure", "always")
    assert int(unit("dflash-consumer@.service")["Service"]["TimeoutStopSec"]) >= 120  # covers a checkpoint


def test_consumer_instance_names_drafter_and_replica(tmp_path):
    exec_start = unit("dflash-consumer@.service")["Service"]["ExecStart"]
    script = exec_start.split("'")[1]
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/sh\necho "$@"\n')
    fake_python.chmod(0o755)
    env = {"DFLASH_PYTHON": str(fake_python), "DFLASH_JOB": "/etc/dflash/job.toml", "DFLASH_INSTANCE": "draft_b16-3"}
    out = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [
        "-m",
        "consumer",
        "--job",
        "/etc/dflash/job.toml",
        "--drafter",
        "draft_b16",
        "--replica",
        "3",
        "--node-rank",
        "0",
        "--nnodes",
        "1",
    ]
