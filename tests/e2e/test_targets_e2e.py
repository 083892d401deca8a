"""The three targets that used to fail hardest, each as a whole job through launch.sh: the Qwen3.6-27B form
(a `Qwen3_5ForConditionalGeneration` wrapper with a vision tower and Gated DeltaNet layers), gpt-oss
(attention sinks, yarn RoPE, MoE) and Qwen3-Next (hybrid linear attention, MoE). Each job packs several
chats per batch, trains two drafters to the end of the data, passes the exactly-once audit, and its final
checkpoint serves through AutoModel + spec_generate exactly as the target's greedy decoding."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

from consumer.checkpoint import load_latest
from demo.tiny import synthetic_chats, write_jsonl
from tests.consumer.test_drafter_matrix import load_target, sharpen
from tests.jobs import ROOT, finish, launch, remove_ring, write_job
from tests.target_zoo import EOS_ID, build_target

DRAFTERS = [
    {
        "name": "d0",
        "block_size": 8,
        "num_layers": 1,
        "anchors_per_seq": 8,
        "loss_chunk_rows": 64,
        "checkpoint_every": 1000,
        "log_every": 2,
    },
    {
        "name": "d1",
        "block_size": 4,
        "num_layers": 1,
        "anchors_per_seq": 8,
        "loss_chunk_rows": 64,
        "checkpoint_every": 1000,
    },
]
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", ["qwen3_5_vl", "gpt_oss", "qwen3_next", "gemma3_vl"])
def test_a_job_on_the_target_trains_every_sample_once_and_its_export_decodes_losslessly(arch, tmp_path):
    assets = tmp_path / "assets"
    sharpen(arch, build_target(arch, assets / "target"))  # wide logit gaps: "equal to greedy" tests no ties
    write_jsonl(assets / "train.jsonl", list(synthetic_chats(24, seed=5)))
    job = write_job(assets, drafters=DRAFTERS, tokens_per_batch=512, name=arch.replace("_", "-"))
    run = job.parent
    try:
        out = finish(launch(job, "--grace", "60"), 600)
        assert "exited with status" not in out, out  # every process ended by itself, with status 0
        producer_log = (run / "logs" / "producer.log").read_text()
        assert "producer done (" in producer_log, producer_log[-2000:]
    finally:
        remove_ring(job)

    check = subprocess.run(
        [sys.executable, "-m", "common.accounting_check", str(run)], cwd=ROOT, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count("; complete") == 2, check.stdout

    ckpt = load_latest(run / "checkpoints" / "d0")
    assert ckpt is not None and ckpt.step > 0
    config = json.loads((ckpt.path / "config.json").read_text())
    assert config["eos_token_id"] == EOS_ID or EOS_ID in config["eos_token_id"]
    target = load_target(arch, assets / "target")
    draft = transformers.AutoModel.from_pretrained(
        str(ckpt.path), trust_remote_code=True, local_files_only=True, dtype=torch.float32
    )
    prompt = torch.tensor([[1, 70, 80, 90, 2, 1]])
    out = draft.spec_generate(
        input_ids=prompt, max_new_tokens=10, temperature=0.0, target=target, stop_token_ids=[EOS_ID]
    )
    plain = target.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=EOS_ID, pad_token_id=0)
    assert out[0].tolist() == plain[0].tolist()
