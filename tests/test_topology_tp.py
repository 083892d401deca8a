"""Target tensor parallelism (producer/tp.py): a TP 2 producer group writes the same features into the ring as a
TP 1 producer, for a dense and a MoE target; the launch plan gives each rank torchrun's variables; bad set-ups
are refused with a message naming the key or the variable."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.config import ConfigError, load_job
from common.launch_plan import plan
from tests.jobs import tiny_assets, write_job
from tests.target_zoo import build_target

ROOT = Path(__file__).resolve().parent.parent
DRAFTER = '[[drafters]]\nname = "d0"\nblock_size = 8\nnum_layers = 1\n'


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"))


def zoo_job(assets: Path, target: Path, tp: int, name: str) -> Path:
    """The tests' job on a zoo target (its byte-level tokenizer), `tp` ranks on the CPU."""
    job = write_job(assets, drafters=DRAFTER, name=name, tokens_per_batch=1024)
    text = job.read_text().replace(f'path = "{assets / "target"}"', f'path = "{target}"\ntp_size = {tp}')
    job.write_text(text.replace("[data]\n", f'[data]\ntokenizer = "{target}"\n'))
    return job


def spawn(args, log, env=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=open(log, "a"),
                            stderr=subprocess.STDOUT)


def wait_all(procs, timeout=240):
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()


def ring_batches(job: Path, tmp: Path, tag: str, n: int = 3) -> list[dict]:
    """Start the job's producer process(es) exactly as the launch plan says, read `n` batches from the ring."""
    procs = [p for p in plan(load_job(job), str(job), sys.executable, master_port=29600 + os.getpid() % 500 * 10)
             if p.name.startswith("producer")]
    started = [spawn(p.argv[1:], tmp / f"{tag}-{p.name}.log", p.env) for p in procs]
    out = tmp / f"{tag}.pt"
    probe = spawn(["-m", "tests.procs.probe_consumer", job, "d0", str(n), out], tmp / f"{tag}-probe.log")
    assert wait_all([probe])[0] == 0, (tmp / f"{tag}-probe.log").read_text()[-3000:]
    started[0].send_signal(signal.SIGTERM)  # rank 0 ends; it stops its followers
    codes = wait_all(started)
    assert codes == [0] * len(started), [(tmp / f"{tag}-{p.name}.log").read_text()[-2000:] for p in procs]
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_tp2_ring_features_equal_tp1(assets, tmp_path, arch):
    target = build_target(arch, tmp_path / arch, num_layers=3)
    one = ring_batches(zoo_job(assets, target, 1, f"tp1{arch}"), tmp_path, "tp1")
    two_job = zoo_job(assets, target, 2, f"tp2{arch}")
    two = ring_batches(two_job, tmp_path, "tp2")
    assert [b["seq"] for b in two] == [b["seq"] for b in one] == [0, 1, 2]
    assert all(len(b["cu_seqlens"]) > 2 for b in one)  # packed batches of several sequences
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["cu_seqlens"], b["cu_seqlens"])
        assert a["hidden"].abs().max() > 0.1
        torch.testing.assert_close(b["hidden"], a["hidden"], atol=1e-5, rtol=0)
    follower_log = (tmp_path / "tp2-producer-tp1.log").read_text()
    assert "rank 0 ended the group after" in follower_log and "tensor-parallel rank 1 of 2" in follower_log


def test_launch_plan_gives_every_rank_torchruns_variables(assets, tmp_path):
    job = write_job(assets, drafters=DRAFTER, extra="")
    text = job.read_text().replace("num_features = 3", 'num_features = 3\ntp_size = 2\ndevices = ["cuda:2", "cuda:3"]')
    job.write_text(text.replace("[transport]\n", '[transport]\nkind = "cuda"\n'))
    procs = {p.name: p for p in plan(load_job(job), str(job), "py", master_port=30000)}
    assert procs["producer"].env == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "30001", "WORLD_SIZE": "2",
                                     "RANK": "0", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}
    assert procs["producer-tp1"].env["RANK"] == "1" and procs["producer-tp1"].env["LOCAL_RANK"] == "3"
    assert procs["producer-tp1"].critical and procs["producer-tp1"].log.endswith("producer-tp1.log")


@pytest.mark.parametrize(("target_keys", "message"), [
    ('tp_size = 2\ndevices = ["cpu"]', "target: devices lists 1 entries but replicas × tp_size is 2"),
    ('tp_size = 2\ndevices = ["cuda:0", "cuda:0"]', "needs its own numbered CUDA device"),
    ('tp_size = 2\ndevices = ["cuda:0", "cpu"]', "runs on CPUs or on CUDA devices"),
    ("tp_size = 3", "tp_size = 3 does not divide"),
])
def test_bad_tp_settings_name_the_key(assets, target_keys, message):
    job = write_job(assets, drafters=DRAFTER)
    job.write_text(job.read_text().replace("num_features = 3", f"num_features = 3\n{target_keys}"))
    with pytest.raises(ConfigError, match=message):
        load_job(job)


def test_tp_producer_without_its_group_variables_says_so(assets, tmp_path):
    job = write_job(assets, drafters=DRAFTER)
    job.write_text(job.read_text().replace("num_features = 3", "num_features = 3\ntp_size = 2"))
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    res = subprocess.run([sys.executable, "-m", "producer", "--job", str(job)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**clean, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 2
    assert "target.tp_size = 2 but $RANK is not set" in res.stderr and "Traceback" not in res.stderr
