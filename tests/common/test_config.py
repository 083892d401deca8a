import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from common.config import ConfigError, dflash_layer_ids, load_job, parse_job
from common.packed_batch import required_slot_bytes

ROOT = Path(__file__).resolve().parents[2]

MINIMAL = """
[target]
path = "{target}"
[data]
path = "train.jsonl"
max_length = 256
tokens_per_batch = 1024
[[drafters]]
name = "d0"
"""


def write(tmp_path, text, target="/nonexistent"):
    p = tmp_path / "job.toml"
    p.write_text(text.format(target=target))
    return p


def test_minimal_job_gets_defaults(tmp_path):
    job = load_job(write(tmp_path, MINIMAL))
    assert job.transport.slots == 4 and job.transport_kind == "cpu"
    assert job.drafters[0].block_size == 16 and job.drafters[0].loss_gamma == 7.0
    assert job.telemetry.wandb_mode == "offline"
    with pytest.raises(ValidationError, match="frozen"):
        job.transport.slots = 9


@pytest.mark.parametrize(
    ("extra", "key", "reason"),
    [
        ("[transport]\nslotz = 3\n", "transport.slotz", "unknown key"),
        ("[transport]\nslots = 'many'\n", "transport.slots", "valid integer"),
        ("[transport]\nslots = 1\n", "transport.slots", "greater than or equal to 2"),
        ("[transport]\nheartbeat_interval_s = 5\nheartbeat_timeout_s = 6\n", "transport", "at least twice"),
        (
            "[telemetry]\nwandb_mode = 'sometimes'\n",
            "telemetry.wandb_mode",
            "unknown value 'sometimes'; this version knows: online, offline, disabled",
        ),
        ("[[drafters]]\nname = 'd0'\n", "drafters", "duplicate name"),
        ("[[drafters]]\nname = 'd1'\nreplicas = 2\ndevices = ['cpu']\n", "drafters.1", "replicas is 2"),
        ("[[drafters]]\nname = 'bad name'\n", "drafters.1.name", "pattern"),
    ],
)
def test_bad_values_name_key_and_reason(tmp_path, extra, key, reason):
    with pytest.raises(ConfigError) as err:
        load_job(write(tmp_path, MINIMAL + extra))
    text = str(err.value)
    assert str(tmp_path / "job.toml") in text
    assert f"  {key}" in text and reason in text


def test_an_unknown_key_names_the_nearest_valid_one(tmp_path):
    """A misspelt key says which key was meant, at every depth (a section, a key in it, a drafter's key); a key
    like none of its table's lists that table's keys."""
    text = MINIMAL.replace("max_length", "max_lenght") + "[[drafters]]\nname = 'd1'\nblok_size = 8\n[telemtry]\n"
    with pytest.raises(ConfigError) as err:
        load_job(write(tmp_path, text + "[transport]\nzzzz = 1\n"))
    lines = str(err.value).splitlines()
    assert "  data.max_lenght: unknown key (did you mean 'max_length'?)" in lines
    assert "  drafters.1.blok_size: unknown key (did you mean 'block_size'?)" in lines
    assert "  telemtry: unknown key (did you mean 'telemetry'?)" in lines
    transport = next(line for line in lines if line.startswith("  transport.zzzz: unknown key (the keys here: "))
    assert "slots, " in transport and "slot_bytes" in transport


def test_an_unknown_head_loss_optimizer_or_other_name_lists_the_valid_ones(tmp_path):
    """An enumerated key given a value this version does not know (a head, loss, optimizer from another version
    or trainer): one line per key with the value, the nearest valid name when one is close, and every valid one."""
    text = MINIMAL.replace('name = "d0"', 'name = "d0"\narch = "lilicorr"\nloss = "ce"\noptimizer = "adam"')
    with pytest.raises(ConfigError) as err:
        load_job(write(tmp_path, text + "[transport]\nkind = 'tpu'\n"))
    lines = str(err.value).splitlines()
    assert lines[0] == f"{tmp_path / 'job.toml'}: invalid job file (4 error(s))"
    assert sorted(lines[1:]) == [
        "  drafters.0.arch: unknown value 'lilicorr'; this version knows: dflash1, dflash2, dspark",
        "  drafters.0.loss: unknown value 'ce'; this version knows: dpace, decay",
        "  drafters.0.optimizer: unknown value 'adam' (did you mean 'adamw'?); this version knows: adamw, muon",
        "  transport.kind: unknown value 'tpu' (did you mean 'cpu'?); this version knows: auto, cpu, cuda",
    ]


def test_missing_required_key_and_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"target: required key is missing"):
        load_job(write(tmp_path, "[data]\npath='x'\n[[drafters]]\nname='d'\n"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_job(write(tmp_path, "[target\npath="))
    with pytest.raises(ConfigError, match="cannot read job file"):
        load_job(tmp_path / "absent.toml")


def test_budget_smaller_than_max_length_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"tokens_per_batch .* smaller than max_length"):
        load_job(write(tmp_path, MINIMAL.replace("max_length = 256", "max_length = 4096")))


def test_slot_smaller_than_largest_batch_rejected(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 64}))
    need = required_slot_bytes(1024, 5 * 64, "bfloat16")
    ok = MINIMAL + f"[transport]\nslot_bytes = {need}\n"
    assert load_job(write(tmp_path, ok, target)).transport.slot_bytes == need
    with pytest.raises(ConfigError, match=r"transport.slot_bytes: .* smaller than the largest batch"):
        load_job(write(tmp_path, MINIMAL + f"[transport]\nslot_bytes = {need - 1}\n", target))


def test_long_run_dir_rejected_for_ipc(tmp_path):
    text = MINIMAL + f"[job]\nrun_dir = '{'x' * 120}'\n"
    with pytest.raises(ConfigError, match=r"job\.run_dir: socket paths"):
        parse_job(__import__("tomllib").loads(text.format(target="/t")), "job.toml")


def test_dflash_layer_ids_formula():
    assert dflash_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert dflash_layer_ids(36, 1) == [18]
    assert dflash_layer_ids(6, 3) == [1, 2, 3]
    assert dflash_layer_ids(6, 5) == [0, 1, 2, 4, 5]  # too shallow for the formula: spread, still distinct


def test_ring_name_separates_run_folders_of_one_job_name(tmp_path):
    # two demos (both named "demo") in two folders once fought over one /dev/shm ring
    one, two = tmp_path / "a", tmp_path / "b"
    one.mkdir(), two.mkdir()
    job_a = load_job(write(one, f'[job]\nname = "demo"\nrun_dir = "{one}/run"\n' + MINIMAL))
    job_b = load_job(write(two, f'[job]\nname = "demo"\nrun_dir = "{two}/run"\n' + MINIMAL))
    assert job_a.ring_name(0) != job_b.ring_name(0)
    assert job_a.ring_name(0) == load_job(one / "job.toml").ring_name(0)  # a restart finds its stale ring
    assert job_a.ring_name(0).startswith("demo-") and job_a.ring_name(0).endswith("-n0")
    assert job_a.ring_name(1, replica=2).endswith("-n1p2") and job_a.ring_name(0, replica=0).endswith("-n0")


def test_the_schema_does_not_import_transformers():
    """Every process and tool reads the job file first: the schema must not cost transformers' import. The
    probes that need it (common/target_probe.py) import it only when a target's config.json asks for them."""
    code = (
        "import common.config, sys; loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers');"
        " assert not loaded, loaded"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_launch_sh_job_info_imports_no_torch(tmp_path):
    """launch.sh runs `python -m common.joblock info` on every start: with torch imported it cost ~2.7 s of CPU
    a start (~90 starts in this suite); the ring file's name comes from common/ring_file.py, torch-free."""
    job = tmp_path / "job.toml"
    job.write_text(
        f'[job]\nname = "j"\nrun_dir = "{tmp_path}/run"\n[target]\npath = "t"\n[data]\npath = "d"\n'
        '[transport]\nkind = "cpu"\n[[drafters]]\nname = "d0"\n'
    )
    code = (
        "import sys; sys.argv = ['joblock', 'info', sys.argv[1]];"
        " import common.joblock as j; rc = j.main(sys.argv[1:]);"
        " loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'));"
        " assert not loaded, loaded[:5]; sys.exit(rc)"
    )
    run = subprocess.run([sys.executable, "-c", code, str(job)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "dflash-ring-j" in run.stdout


def test_reclaim_waits_for_a_descendant_that_inherited_a_dead_launchs_lock(tmp_path):
    """A launch that died leaves the job lock held by what inherited its descriptor after its own processes
    have released their locks (seen once `joblock info` stopped importing torch and launch.sh reached its
    flock 2.5 s sooner): reclaim waits for it within the grace instead of refusing the new launch (75)."""
    from common.joblock import job_lock_path, reclaim

    lock = job_lock_path(tmp_path, 0)
    (tmp_path / "locks").mkdir()
    lock.write_text("pid=999999999 start=x launch=deadbeef\n")  # a launch.sh pid that is gone
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX);"
            " print('held', flush=True); time.sleep(1.5)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        assert reclaim(tmp_path, 0, grace_s=30.0, log=lambda *_: None)  # the old code returned False at once
        assert time.monotonic() - start > 1.0  # it returned when the holder let go (1.5 s after "held")
    finally:
        holder.kill()
        holder.wait(10)
