"""Warm start (issue 20 item 5): `init_from` loads a published drafter directory, checks it against the
job's drafter with one line naming the file and the key, and trains on from step 0 with a fresh optimizer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.checkpoint_pointer import write_pointer
from consumer.checkpoint import save_checkpoint
from consumer.export.layout import export_config, write_export
from consumer.objective import attention_masks, build_draft_batch
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer
from consumer.warm_start import WarmStartError, check_config, warm_start, warm_start_unless_resuming
from tests.consumer.test_drafter_common import LAYER_IDS, drafter_cfg, packed, target_features, tiny_target
from tests.jobs import tiny_assets, write_job

B = 4
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny target, a drafter trained 3 steps (seed 1) and its float32 export."""
    path = tmp_path_factory.mktemp("target")
    target = tiny_target(path)
    parts = load_target_parts(path)
    seqs = [torch.arange(10, 40), torch.arange(60, 85)]
    ids, mask, cu = packed(seqs)
    feats = target_features(target, seqs)
    trainer = Trainer(drafter_cfg(block_size=B, num_layers=2, seed=1, dtype="float32"), parts, LAYER_IDS, "cpu")
    for i in range(3):
        trainer.train_batch(feats, ids, mask, cu, seq=i)
    export = tmp_path_factory.mktemp("export")
    write_export(export, trainer.model.state_dict(), _config(trainer, "float32"))
    return parts, trainer, export, (feats, ids, mask, cu)


def _config(trainer, dtype):
    return export_config(
        trainer.arch,
        trainer.parts,
        block_size=trainer.cfg.block_size,
        mask_token_id=trainer.mask_token_id,
        target_layer_ids=trainer.target_layer_ids,
        dtype=dtype,
    )


def fresh(parts, **overrides):
    """The job's drafter before any training (seed 2: other weights than the source's)."""
    return Trainer(drafter_cfg(block_size=B, num_layers=2, seed=2, **overrides), parts, LAYER_IDS, "cpu")


@torch.no_grad()
def logits(trainer, data):
    feats, ids, mask, cu = data
    batch = build_draft_batch(
        ids,
        mask,
        cu,
        anchors_per_seq=8,
        block_size=trainer.cfg.block_size,
        mask_token_id=trainer.mask_token_id,
        gamma=4.0,
        generator=torch.Generator().manual_seed(5),
    )
    masks = attention_masks(batch, trainer.arch.attention_layers, None, flex=False)
    return trainer.model.logits(trainer.model(feats, batch.ctx_pos, batch.block_ids, batch.block_pos, masks))


def test_warm_start_reproduces_the_exported_logits_at_step_0_and_trains_on(source, tmp_path):
    parts, src, export, data = source
    want = logits(src, data)
    job = fresh(parts)
    assert not torch.equal(logits(job, data), want)
    assert warm_start(job, export) == export
    assert torch.equal(logits(job, data), want)  # exactly: float32 export, float32 drafter
    assert job.step == 0 and not job.optimizer.state  # fresh optimizer, nothing stepped yet
    job.train_batch(*data, seq=0)
    assert job.step == 1 and torch.isfinite(logits(job, data)).all()
    # our checkpoint root (its `latest`) works too; and resuming the job's own checkpoint wins over init_from
    save_checkpoint(tmp_path / "ckpts", src)
    other = fresh(parts)
    warm_start(other, tmp_path / "ckpts")
    assert torch.equal(logits(other, data), want)
    resumed = fresh(parts, init_from=str(export))
    before = logits(resumed, data)
    (tmp_path / "own").mkdir()
    write_pointer(tmp_path / "own", "step_7")
    warm_start_unless_resuming(resumed, tmp_path / "own")
    assert torch.equal(logits(resumed, data), before)
    warm_start_unless_resuming(resumed, tmp_path / "no-checkpoint-yet")
    assert torch.equal(logits(resumed, data), want)


def test_a_zlab_style_directory_with_dflash_config_keys_and_shards_loads(source, tmp_path):
    """DFlash keys only in dflash_config (no top-level block_size, num_target_layers, layer_types), bf16
    weights in two shards with an index, no training state."""
    parts, src, _, data = source
    config = _config(src, "bfloat16")
    config["dflash_config"]["block_size"] = config.pop("block_size")
    for key in ("num_target_layers", "layer_types", "use_sliding_window", "max_window_layers", "is_causal"):
        config.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {k: v.to(torch.bfloat16) for k, v in src.model.state_dict().items()}
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
    weight_map = {k: f for f, keys in halves.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    job = fresh(parts)
    warm_start(job, tmp_path)
    rounded = fresh(parts)
    rounded.model.load_state_dict({k: v.float() for k, v in state.items()})
    assert torch.equal(logits(job, data), logits(rounded, data))


def edited(export, tmp_path, change):
    shutil.copytree(export, tmp_path / "dir")
    file = tmp_path / "dir" / "config.json"
    config = json.loads(file.read_text())
    change(config)
    file.write_text(json.dumps(config))
    return tmp_path / "dir"


@pytest.mark.parametrize(
    "change, message",
    [
        (  # an export records its trained block in both places (evaluation/block_size.py)
            lambda c: (c.update(block_size=8), c["dflash_config"].update(block_size=8)),
            r"dflash_config.block_size = 8, but drafter d0 has block_size = 4 \(drafters.block_size\)",
        ),
        (
            lambda c: c["dflash_config"].update(target_layer_ids=[0, 2, 4]),
            r"dflash_config.target_layer_ids = \[0, 2, 4\], but drafter d0 has target_layer_ids = \[1, 3, 5\]",
        ),
        (lambda c: c.update(vocab_size=1000), r"vocab_size = 1000, but drafter d0 has vocab_size = 512"),
        (
            lambda c: c.update(layer_types=["sliding_attention"] * 2, sliding_window=8),
            r"layer_types = \['sliding_attention', 'sliding_attention'\]",
        ),
        (
            lambda c: c.update(architectures=["DFlash2DraftModel"]),
            r"architectures = \['DFlash2DraftModel'\], but drafter d0 is \['DFlashDraftModel'\]",
        ),
    ],
)
def test_a_mismatched_directory_fails_naming_the_file_and_the_key(source, tmp_path, change, message):
    parts, _, export, _ = source
    path = edited(export, tmp_path, change)
    job = fresh(parts)
    before = {k: v.clone() for k, v in job.model.state_dict().items()}
    with pytest.raises(WarmStartError, match=str(path / "config.json").replace(".", r"\.") + ": " + message):
        warm_start(job, path)
    assert all(torch.equal(v, job.model.state_dict()[k]) for k, v in before.items())  # nothing copied


def test_tensors_are_checked_and_may_be_missing_keeps_the_initialisation(source, tmp_path):
    parts, _, export, _ = source
    shutil.copytree(export, tmp_path / "dir")
    weights = tmp_path / "dir" / "model.safetensors"
    state = load_file(str(weights))
    dropped = "layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != dropped}, str(weights))
    with pytest.raises(WarmStartError, match=rf"parameter\(s\) \['{dropped}'\] are missing there"):
        warm_start(fresh(parts), tmp_path / "dir")
    job = fresh(parts)
    init = job.model.state_dict()[dropped].clone()
    warm_start(job, tmp_path / "dir", may_be_missing=frozenset({dropped}))
    assert torch.equal(job.model.state_dict()[dropped], init)
    assert torch.equal(job.model.state_dict()["fc.weight"], state["fc.weight"])
    save_file({**state, "layers.0.attention_conv.base_kernel": torch.zeros(2, 2, 64)}, str(weights))
    with pytest.raises(WarmStartError, match=r"\['layers.0.attention_conv.base_kernel'\] are not parameters"):
        warm_start(fresh(parts), tmp_path / "dir")
    save_file({**state, "fc.weight": torch.zeros(64, 128)}, str(weights))
    with pytest.raises(WarmStartError, match=r"tensor fc.weight has shape \[64, 128\], .* has \[64, 192\]"):
        warm_start(fresh(parts), tmp_path / "dir")
    with pytest.raises(WarmStartError, match="is not a directory"):
        warm_start(fresh(parts), tmp_path / "nowhere")


def test_consumer_process_with_a_mismatched_init_from_exits_2_naming_the_file(tmp_path):
    """The real entry point: one line naming the file and the key, no traceback, before any producer."""
    published = tmp_path / "published"
    published.mkdir()
    (published / "config.json").write_text(json.dumps({"dflash_config": {"target_layer_ids": [0], "block_size": 16}}))
    job = write_job(tiny_assets(tmp_path / "assets"), drafters=[{"name": "d0", "init_from": str(published)}])
    done = subprocess.run(
        [sys.executable, "-m", "consumer", "--job", str(job), "--drafter", "d0", "--profile-interval", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 2, done.stderr
    assert f"{published / 'config.json'}: dflash_config.target_layer_ids = [0], but drafter d0 has" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_dflash1_directory_fits_a_drafter_that_grows_from_it(source):
    """A DFlash2 drafter (its new parts may be missing) accepts a DFlash1 directory of the same shape."""
    _, _, export, _ = source
    config = json.loads((export / "config.json").read_text())
    grown = {**config, "architectures": ["DFlash2DraftModel"]}
    check_config(config, grown, "c.json", "d0", grows_from_dflash1=True)
    with pytest.raises(WarmStartError, match=r"c.json: architectures = \['DFlashDraftModel'\], but drafter d0 is"):
        check_config(config, grown, "c.json", "d0")
    block8 = {**config, "block_size": 8, "dflash_config": {**config["dflash_config"], "block_size": 8}}
    with pytest.raises(
        WarmStartError, match=r"c.json: dflash_config.block_size = 8, but drafter d0 has block_size = 4"
    ):
        check_config(block8, grown, "c.json", "d0", grows_from_dflash1=True)
    # DSpark grows from DFlash1 at any block size (its slots mean another thing; the copied weights do not depend on it)
    check_config(block8, {**config, "architectures": ["Qwen3DSparkModel"]}, "c.json", "d0", grows_from_dflash1=True)


def test_a_dflash1_directory_warm_starts_a_dflash2_drafter_at_its_logits_and_serves_losslessly(source, tmp_path):
    """init_from of a DFlash1 export into `arch = "dflash2"`: the convolutions and the selector keep their
    identity init, so the unary logits are the DFlash1 drafter's exactly; its export reloads through
    AutoModel and spec_generate equals the target's greedy output."""
    import transformers

    from consumer.checkpoint import save_checkpoint

    parts, src, export, data = source
    job = fresh(parts, arch="dflash2", selector_rank=8, selector_top_k=4, dtype="float32")
    assert not torch.equal(logits(job, data), logits(src, data))
    warm_start(job, export)
    assert torch.equal(logits(job, data), logits(src, data))
    # a DFlash2 directory must carry every DFlash2 tensor: one without its convolutions is refused
    partial = tmp_path / "partial"
    partial.mkdir()
    state = {k: v for k, v in job.model.state_dict().items() if "_conv." not in k}
    write_export(partial, state, {**_config(job, "float32"), "architectures": ["DFlash2DraftModel"]})
    with pytest.raises(WarmStartError, match="attention_conv"):
        warm_start(fresh(parts, arch="dflash2", selector_rank=8, selector_top_k=4), partial)
    ckpt = save_checkpoint(tmp_path / "ckpts", job)
    draft = transformers.AutoModel.from_pretrained(
        str(ckpt), trust_remote_code=True, local_files_only=True, dtype=torch.float32
    )
    target = transformers.AutoModelForCausalLM.from_pretrained(str(parts.path), dtype=torch.float32)
    prompt = torch.tensor([5, 40, 90, 200])
    want = target.generate(prompt[None], max_new_tokens=24, do_sample=False, eos_token_id=3, pad_token_id=0)
    out = draft.spec_generate(
        input_ids=prompt[None], max_new_tokens=24, temperature=0.0, target=target, stop_token_ids=[3]
    )
    assert out[0].tolist() == want[0].tolist()
