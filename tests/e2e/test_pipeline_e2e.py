"""The real producer and consumer processes on a tiny target: features, training, checkpoints, resume."""

import itertools
import json
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.harness import spawn
from common.config import dflash_layer_ids
from consumer.checkpoint import load_latest
from tests.jobs import tiny_assets, wait_all, write_job

DRAFTER = [
    {
        "name": "d0",
        "block_size": 8,
        "num_layers": 1,
        "anchors_per_seq": 16,
        "loss_chunk_rows": 64,
        "checkpoint_every": 20,
        "log_every": 5,
        "total_steps": 200,
    },
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"))


def test_features_in_the_ring_equal_the_targets_hidden_states(assets, tmp_path):
    job = write_job(assets, drafters=DRAFTER)
    out = tmp_path / "probe.pt"
    prod = spawn(["-m", "producer", "--job", job], tmp_path / "p.log")
    probe = spawn(["-m", "tests.procs.probe_consumer", job, "d0", "3", out], tmp_path / "c.log")
    assert wait_all([probe])[0] == 0, (tmp_path / "c.log").read_text()[-2000:]
    prod.send_signal(signal.SIGTERM)
    assert wait_all([prod])[0] == 0, (tmp_path / "p.log").read_text()[-2000:]
    batches = torch.load(out, weights_only=True)
    assert [b["seq"] for b in batches] == [0, 1, 2]
    model = AutoModelForCausalLM.from_pretrained(assets / "target", local_files_only=True, dtype=torch.float32)
    ids = dflash_layer_ids(6, 3)
    assert ids == [1, 2, 3]
    for b in batches:
        cu = b["cu_seqlens"].tolist()
        for s, e in itertools.pairwise(cu):
            with torch.no_grad():
                hs = model(b["input_ids"][s:e][None], output_hidden_states=True).hidden_states
            want = torch.cat([hs[i + 1][0] for i in ids], dim=-1)
            torch.testing.assert_close(b["hidden"][s:e], want, atol=1e-5, rtol=1e-5)
        assert b["loss_mask"].sum() > 0 and b["loss_mask"].sum() < len(b["loss_mask"])


def test_consumer_trains_checkpoints_and_resumes_after_sigterm_without_repeating_a_batch(assets, tmp_path):
    job = write_job(assets, drafters=DRAFTER, name="resume")
    run = job.parent
    prod = spawn(["-m", "producer", "--job", job], tmp_path / "p.log")
    cons = spawn(["-m", "consumer", "--job", job, "--drafter", "d0"], tmp_path / "c1.log")
    ckpts = run / "checkpoints" / "d0"
    deadline = time.monotonic() + 180
    while load_latest(ckpts) is None or load_latest(ckpts).step < 20:
        assert time.monotonic() < deadline and cons.poll() is None, (tmp_path / "c1.log").read_text()[-2000:]
        time.sleep(0.2)
    cons.send_signal(signal.SIGTERM)  # checkpoint at a step boundary, BYE, exit 0
    assert wait_all([cons])[0] == 0
    stopped = load_latest(ckpts)
    assert stopped.state["last_seq"] == stopped.step - 1  # one batch per step, in order, none skipped
    cons2 = spawn(["-m", "consumer", "--job", job, "--drafter", "d0"], tmp_path / "c2.log")
    assert wait_all([cons2, prod]) == [0, 0], (tmp_path / "c2.log").read_text()[-2000:]
    final = load_latest(ckpts)
    planned = next(li for li in (tmp_path / "p.log").read_text().splitlines() if "batches planned" in li)
    total = int(planned.split()[-3])  # "...; N batches planned"
    assert final.state["last_seq"] == total - 1 and final.step == total  # every batch trained exactly once
    assert f"resumed from {stopped.path}" in (tmp_path / "c2.log").read_text()
    config = json.loads((final.path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
    assert config["dflash_config"]["target_layer_ids"] == [1, 2, 3]
