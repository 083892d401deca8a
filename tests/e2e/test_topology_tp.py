"""Target tensor parallelism (producer/tp.py): a TP 2 producer group writes the same features into the ring as a
TP 1 producer, for a dense and a MoE target, and with expert parallelism (ep_size 2: each rank holds half the
experts whole) for two MoE families; the launch plan gives each rank torchrun's variables; bad set-ups are refused
with a message naming the key or the variable."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3MoeConfig

from bench.harness import spawn
from common.config import ConfigError, TargetConfig, load_job
from common.launch_plan import plan
from tests.jobs import tiny_assets, write_job
from tests.target_zoo import build_target

ROOT = Path(__file__).resolve().parents[2]
DRAFTER = [
    {"name": "d0", "block_size": 8, "num_layers": 1},
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"))


def zoo_job(assets: Path, target: Path, tp: int, name: str, ep: int = 1) -> Path:
    """The tests' job on a zoo target (its byte-level tokenizer), `tp` ranks on the CPU, `ep` of them sharing the
    experts."""
    job = write_job(assets, drafters=DRAFTER, name=name, tokens_per_batch=1024)
    text = job.read_text().replace(
        f'path = "{assets / "target"}"', f'path = "{target}"\ntp_size = {tp}\nep_size = {ep}'
    )
    job.write_text(text.replace("[data]\n", f'[data]\ntokenizer = "{target}"\n'))
    return job


def wait_all(procs, timeout=240):
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()


def ring_batches(job: Path, tmp: Path, tag: str, n: int = 3) -> list[dict]:
    """Start the job's producer process(es) exactly as the launch plan says, read `n` batches from the ring."""
    procs = [
        p
        for p in plan(load_job(job), str(job), sys.executable, master_port=29600 + os.getpid() % 500 * 10)
        if p.name.startswith("producer")
    ]
    started = [spawn(p.argv[1:], tmp / f"{tag}-{p.name}.log", p.env) for p in procs]
    out = tmp / f"{tag}.pt"
    probe = spawn(["-m", "tests.procs.probe_consumer", job, "d0", str(n), out], tmp / f"{tag}-probe.log")
    assert wait_all([probe])[0] == 0, (tmp / f"{tag}-probe.log").read_text()[-3000:]
    started[0].send_signal(signal.SIGTERM)  # rank 0 ends; it stops its followers
    codes = wait_all(started)
    assert codes == [0] * len(started), [(tmp / f"{tag}-{p.name}.log").read_text()[-2000:] for p in procs]
    return torch.load(out, weights_only=True)


SHARD_LOG = re.compile(r"rank (\d): expert parallel: (\S+) \(([\d, ]+)\) of \(([\d, ]+)\); ([\d.]+) % of the expert")


@pytest.mark.parametrize(
    ("arch", "ep"),
    [("qwen3", 1), ("qwen3_moe", 1), ("qwen3_moe", 2), pytest.param("gpt_oss", 2, marks=pytest.mark.slow)],
)
def test_tp2_ring_features_equal_tp1(assets, tmp_path, arch, ep):
    target = build_target(arch, tmp_path / arch, num_layers=3)
    one = ring_batches(zoo_job(assets, target, 1, f"tp1{arch}"), tmp_path, "tp1")
    two_job = zoo_job(assets, target, 2, f"tp2{arch}", ep)
    two = ring_batches(two_job, tmp_path, "tp2")
    assert [b["seq"] for b in two] == [b["seq"] for b in one] == [0, 1, 2]
    assert all(len(b["cu_seqlens"]) > 2 for b in one)  # packed batches of several sequences
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["cu_seqlens"], b["cu_seqlens"])
        assert a["hidden"].abs().max() > 0.1
        torch.testing.assert_close(b["hidden"], a["hidden"], atol=1e-5, rtol=0)
    follower_log = (tmp_path / "tp2-producer-tp1.log").read_text()
    assert "rank 0 ended the group after" in follower_log and "tensor-parallel rank 1 of 2" in follower_log
    if ep == 1:
        return
    # expert parallelism: each rank holds 2 of the 4 experts whole, i.e. half of every expert weight tensor
    for rank, name in enumerate(("producer", "producer-tp1")):
        found = SHARD_LOG.findall((tmp_path / f"tp2-{name}.log").read_text())
        assert len(found) == 1, found
        r, param, local, full, pct = found[0]
        local, full = [int(v) for v in local.split(",")], [int(v) for v in full.split(",")]
        assert (int(r), ".experts." in param, full[0], local[0], local[1:]) == (rank, True, 4, 2, full[1:])
        assert float(pct) == 50.0


def test_launch_plan_gives_every_rank_torchruns_variables(assets, tmp_path):
    job = write_job(assets, drafters=DRAFTER)
    text = job.read_text().replace("num_features = 3", 'num_features = 3\ntp_size = 2\ndevices = ["cuda:2", "cuda:3"]')
    job.write_text(text.replace("[transport]\n", '[transport]\nkind = "cuda"\n'))
    procs = {p.name: p for p in plan(load_job(job), str(job), "py", master_port=30000)}
    assert procs["producer"].env == {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "30001",
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "2",
    }
    assert procs["producer-tp1"].env["RANK"] == "1" and procs["producer-tp1"].env["LOCAL_RANK"] == "3"
    assert procs["producer-tp1"].critical and procs["producer-tp1"].log.endswith("producer-tp1.log")


@pytest.mark.parametrize(
    ("target_keys", "message"),
    [
        ('tp_size = 2\ndevices = ["cpu"]', "target: devices lists 1 entries but replicas × tp_size is 2"),
        ('tp_size = 2\ndevices = ["cuda:0", "cuda:0"]', "needs its own numbered CUDA device"),
        ('tp_size = 2\ndevices = ["cuda:0", "cpu"]', "runs on CPUs or on CUDA devices"),
        ("tp_size = 3", "tp_size = 3 does not divide"),
    ],
)
def test_bad_tp_settings_name_the_key(assets, target_keys, message):
    job = write_job(assets, drafters=DRAFTER)
    job.write_text(job.read_text().replace("num_features = 3", f"num_features = 3\n{target_keys}"))
    with pytest.raises(ConfigError, match=message):
        load_job(job)


@pytest.mark.parametrize(
    ("target_keys", "message"),
    [
        ("ep_size = 2", "target.ep_size: ep_size = 2 with tp_size = 1: .* so ep_size is 1 or tp_size"),
        ("tp_size = 2\nep_size = 4", "target.ep_size: ep_size = 4 with tp_size = 2"),
        (
            "tp_size = 2\nep_size = 2",
            r"target.ep_size: ep_size = 2 but the target \(Qwen3Config, .*\) has no expert-parallel plan",
        ),
    ],
)
def test_bad_ep_settings_name_the_key(assets, target_keys, message):
    job = write_job(assets, drafters=DRAFTER)
    job.write_text(job.read_text().replace("num_features = 3", f"num_features = 3\n{target_keys}"))
    with pytest.raises(ConfigError, match=message):
        load_job(job)


def test_tp_size_must_divide_a_moe_targets_expert_width_unless_ep_holds_experts_whole(assets, tmp_path):
    """Under plain TP transformers slices every expert's MLP: moe_intermediate_size 6 with tp_size 4 is refused
    at job load, naming the key; with ep_size = tp_size the experts stay whole and the width is not split."""
    target = tmp_path / "moe"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3_moe",
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "intermediate_size": 64,
                "moe_intermediate_size": 6,
                "num_experts": 8,
            }
        )
    )
    job = write_job(assets, drafters=DRAFTER)
    text = job.read_text().replace(str(assets / "target"), str(target))
    job.write_text(text.replace("num_features = 3", "num_features = 3\ntp_size = 4"))
    with pytest.raises(ConfigError, match=r"tp_size = 4 does not divide the target's moe_intermediate_size \(6,"):
        load_job(job)
    job.write_text(text.replace("num_features = 3", "num_features = 3\ntp_size = 4\nep_size = 4"))
    assert load_job(job).target.ep_size == 4


def test_ep_size_must_divide_the_experts(assets, tmp_path):
    """A MoE target with 6 experts: ep_size 4 leaves ranks with unequal shares (transformers refuses it at load);
    the job file says so first. 2 divides them."""
    cfg = Qwen3MoeConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        num_hidden_layers=2,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    cfg.save_pretrained(tmp_path / "moe6")
    for ep, ok in ((4, False), (2, True)):
        job = write_job(assets, drafters=DRAFTER, name=f"ep{ep}")
        job.write_text(
            job.read_text().replace(
                f'path = "{assets / "target"}"', f'path = "{tmp_path / "moe6"}"\ntp_size = {ep}\nep_size = {ep}'
            )
        )
        if ok:
            assert load_job(job).target.ep_size == 2
        else:
            with pytest.raises(
                ConfigError, match=r"target.ep_size: ep_size = 4 does not divide the target's 6 experts"
            ):
                load_job(job)


@pytest.mark.parametrize(
    ("arch", "message"),
    [
        (
            "qwen3_moe",
            r"target.ep_size = 2: transformers did not shard layers.0.mlp.experts.gate_up_proj by expert"
            r" \(Parameter \(4, 64, 64\)\)",
        ),
        ("qwen3", "target.ep_size = 2: .* has no expert weights"),
    ],
)
def test_ep_that_shards_no_expert_is_an_error_not_a_fallback(tmp_path, arch, message):
    """A rank whose experts are not split whole (here: loaded without a DistributedConfig) refuses to start."""
    from producer.target import load_target
    from producer.tp import TPSetupError, ep_shard

    path = build_target(arch, tmp_path / arch, num_layers=2)
    target = load_target(path, num_features=2, dtype="float32")
    cfg = TargetConfig(path=str(path), tp_size=2, ep_size=2)
    with pytest.raises(TPSetupError, match=message):
        ep_shard(target.model, cfg)


def test_tp_producer_without_its_group_variables_says_so(assets, tmp_path):
    job = write_job(assets, drafters=DRAFTER)
    job.write_text(job.read_text().replace("num_features = 3", "num_features = 3\ntp_size = 2"))
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    res = subprocess.run(
        [sys.executable, "-m", "producer", "--job", str(job)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, "PYTHONPATH": str(ROOT)},
    )
    assert res.returncode == 2
    assert "target.tp_size = 2 but $RANK is not set" in res.stderr and "Traceback" not in res.stderr
