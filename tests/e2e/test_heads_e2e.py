"""One job, three heads (issue 30 §1): a DFlash1, a DFlash2 and a DSpark drafter fed by one producer's target
forward, as real processes, each to the end of the data; each export has its own layout, and the DSpark one
decodes through dflash-eval's loader exactly as the target's greedy decoding."""

from __future__ import annotations

import json

import pytest
import torch

from bench.harness import spawn
from consumer.checkpoint import load_latest
from demo.tiny import synthetic_chats, write_jsonl
from tests.jobs import tiny_assets, wait_all, write_job

COMMON = {"num_layers": 1, "anchors_per_seq": 8, "loss_chunk_rows": 64, "checkpoint_every": 1000, "log_every": 2}
DRAFTERS = [
    {"name": "d1", "block_size": 8, **COMMON},
    {"name": "d2", "arch": "dflash2", "block_size": 8, "selector_rank": 8, "selector_top_k": 4, **COMMON},
    {"name": "sp", "arch": "dspark", "block_size": 7, "markov_rank": 16, **COMMON},
]
ARCHITECTURES = {"d1": ["DFlashDraftModel"], "d2": ["DFlash2DraftModel"], "sp": ["Qwen3DSparkModel"]}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The shared tiny target and tokenizer with a short train set (12 chats)."""
    shared = tiny_assets(tmp_path_factory.mktemp("assets"))
    own = tmp_path_factory.mktemp("heads")
    for name in ("target", "tokenizer"):
        (own / name).symlink_to(shared / name)
    write_jsonl(own / "train.jsonl", list(synthetic_chats(12, seed=5)))
    return own


def test_dflash1_dflash2_and_dspark_train_from_one_target_forward(assets, tmp_path):
    job = write_job(assets, drafters=DRAFTERS, tokens_per_batch=1024, name="heads")
    run = job.parent
    logs = {name: tmp_path / f"{name}.log" for name in ("producer", *ARCHITECTURES)}
    procs = [spawn(["-m", "producer", "--job", job], logs["producer"])]
    procs += [spawn(["-m", "consumer", "--job", job, "--drafter", d], logs[d]) for d in ARCHITECTURES]
    codes = wait_all(procs, timeout=240)
    out = "".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in logs.values())
    assert codes == [0] * 4, out
    planned = next(li for li in logs["producer"].read_text().splitlines() if "batches planned" in li)
    total = int(planned.split()[-3])  # "...; N batches planned"
    for name, archs in ARCHITECTURES.items():
        ckpt = load_latest(run / "checkpoints" / name)
        assert ckpt is not None and ckpt.state["last_seq"] == total - 1, name  # every batch, once, per drafter
        assert json.loads((ckpt.path / "config.json").read_text())["architectures"] == archs

    from evaluation.evaluate import load_drafter, load_target
    from evaluation.speculative import greedy_generate, speculative_generate

    ckpt = load_latest(run / "checkpoints" / "sp")
    proposer = load_drafter(ckpt.path, assets / "target")
    assert proposer.trained_block_size == 7 and proposer.block_size == 8
    runner = load_target(assets / "target", proposer.layer_ids)
    prompt = torch.tensor([1, 70, 80, 90, 2, 1])
    spec = speculative_generate(runner, proposer, prompt, 24, None)
    assert spec.tokens == greedy_generate(runner, prompt, 24, None).tokens
