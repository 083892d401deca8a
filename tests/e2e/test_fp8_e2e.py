"""transport.features = "fp8" through real processes: the producer quantises, the ring carries e4m3 and the
scale column, the consumer dequantises after its copy-out and trains."""

import itertools
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.harness import spawn
from consumer.checkpoint import load_latest
from tests.jobs import tiny_assets, wait_all, write_job

FP8 = {"transport": {"features": "fp8"}}
DRAFTER = [{"name": "d0", "block_size": 8, "num_layers": 1, "anchors_per_seq": 16, "loss_chunk_rows": 64}]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"))


def test_the_consumer_gets_the_targets_features_within_e4m3_rounding(assets, tmp_path):
    job = write_job(assets, drafters=DRAFTER, overrides=FP8, name="fp8probe")
    out = tmp_path / "probe.pt"
    prod = spawn(["-m", "producer", "--job", job], tmp_path / "p.log")
    probe = spawn(["-m", "tests.procs.probe_consumer", job, "d0", "2", out], tmp_path / "c.log")
    assert wait_all([probe])[0] == 0, (tmp_path / "c.log").read_text()[-2000:]
    prod.send_signal(signal.SIGTERM)
    assert wait_all([prod])[0] == 0, (tmp_path / "p.log").read_text()[-2000:]
    batches = torch.load(out, weights_only=True)
    assert [b["seq"] for b in batches] == [0, 1]
    model = AutoModelForCausalLM.from_pretrained(assets / "target", local_files_only=True, dtype=torch.float32)
    for b in batches:
        assert b["hidden"].dtype == torch.float32  # dequantised to the target's dtype
        for s, e in itertools.pairwise(b["cu_seqlens"].tolist()):
            with torch.no_grad():
                hs = model(b["input_ids"][s:e][None], output_hidden_states=True).hidden_states
            want = torch.cat([hs[i + 1][0] for i in (1, 2, 3)], dim=-1)
            scale = want.abs().amax(dim=1, keepdim=True) / 448
            err = (b["hidden"][s:e] - want).abs()
            assert bool((err <= want.abs() * 2.0**-4 + scale * 2.0**-10 + 1e-5).all())  # + the forward's own 1e-5
            assert float(err.max()) > 1e-4  # quantised, not carried in float32


def test_a_drafter_trains_the_whole_plan_on_fp8_features(assets, tmp_path):
    drafter = [{**DRAFTER[0], "checkpoint_every": 1000, "total_steps": 200}]
    job = write_job(assets, drafters=drafter, overrides=FP8, name="fp8train")
    prod = spawn(["-m", "producer", "--job", job], tmp_path / "p.log")
    cons = spawn(["-m", "consumer", "--job", job, "--drafter", "d0"], tmp_path / "c.log")
    assert wait_all([cons, prod]) == [0, 0], (tmp_path / "c.log").read_text()[-2000:]
    planned = next(li for li in (tmp_path / "p.log").read_text().splitlines() if "batches planned" in li)
    total = int(planned.split()[-3])  # "...; N batches planned"
    final = load_latest(job.parent / "checkpoints" / "d0")
    assert final.step == total and final.state["last_seq"] == total - 1  # every batch trained once
    losses = [
        float(li.split(" loss ")[1].split()[0])
        for li in (tmp_path / "c.log").read_text().splitlines()
        if " loss " in li
    ]
    assert losses and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0]
