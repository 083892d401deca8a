"""Checkpoints: the exact published export format (dflash.md §3), AutoModel loading, atomic saves."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open

from common.checkpoint_pointer import write_pointer
from consumer import checkpoint
from consumer.checkpoint import load_latest, save_checkpoint
from consumer.export import layout
from consumer.export.layout import export_config, write_export
from consumer.trainer import Trainer
from tests.consumer.test_drafter_common import (
    LAYER_IDS,
    drafter_cfg,
    parts_and_batch,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-layer drafter after two steps on a tiny target, and the batch it saw."""
    parts, batch = parts_and_batch(tmp_path_factory.mktemp("target"), [30, 26])
    trainer = Trainer(drafter_cfg(num_layers=2), parts, LAYER_IDS, "cpu")
    for s in range(2):
        trainer.train_batch(*batch, seq=s)
    return trainer, batch


def test_export_keys_shapes_and_config(trained, tmp_path):
    trainer, _ = trained
    ckpt = save_checkpoint(tmp_path, trainer)
    assert ckpt == tmp_path / "step_2" and os.readlink(tmp_path / "latest") == "step_2"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "config.json",
        "dflash.py",
        "manifest.json",
        "model.safetensors",
        "trainer_state.pt",
    ]
    H, n, inter, d = 64, 3, 128, 16
    want = {"fc.weight": [H, n * H], "hidden_norm.weight": [H], "norm.weight": [H]}
    for i in range(2):
        want |= {
            f"layers.{i}.self_attn.q_proj.weight": [4 * d, H],
            f"layers.{i}.self_attn.k_proj.weight": [2 * d, H],
            f"layers.{i}.self_attn.v_proj.weight": [2 * d, H],
            f"layers.{i}.self_attn.o_proj.weight": [H, 4 * d],
            f"layers.{i}.self_attn.q_norm.weight": [d],
            f"layers.{i}.self_attn.k_norm.weight": [d],
            f"layers.{i}.mlp.gate_proj.weight": [inter, H],
            f"layers.{i}.mlp.up_proj.weight": [inter, H],
            f"layers.{i}.mlp.down_proj.weight": [H, inter],
            f"layers.{i}.input_layernorm.weight": [H],
            f"layers.{i}.post_attention_layernorm.weight": [H],
        }
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        got = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    assert got == want  # no embedding, no lm_head, no prefix
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["model_type"] == "qwen3" and cfg["block_size"] == 4 and cfg["dtype"] == "bfloat16"
    assert cfg["dflash_config"] == {
        "mask_token_id": 511,
        "mask_token": "<|MASK|>",
        "target_layer_ids": LAYER_IDS,
        "block_size": 4,  # the trained block where z-lab's and SGLang's readers look first
    }
    assert cfg["num_target_layers"] == 6 and cfg["num_hidden_layers"] == 2
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == 512 and cfg["rope_theta"] == trainer.cfg.rope_theta == 1e6  # the drafter's own
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]) == (64, 128, 4)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["max_position_embeddings"]) == (2, 16, 256)
    assert cfg["rms_norm_eps"] == trainer.parts.rms_norm_eps
    assert (ckpt / "dflash.py").read_text() == layout.EXPORT_MODULE.read_text()


def _automodel_logits(path, trainer, features, block):
    model = transformers.AutoModel.from_pretrained(
        str(path), trust_remote_code=True, local_files_only=True, dtype=torch.float32
    )
    assert type(model).__name__ == "DFlashDraftModel" and model.target_layer_ids == LAYER_IDS
    with torch.no_grad():  # the target's embedding and lm_head, passed in as SGLang/vLLM share them
        h = model(noise_embedding=trainer.parts.embed_tokens[block][None], target_hidden=features[None])
    return h[0] @ trainer.parts.lm_head.T


def test_automodel_gives_the_trainers_logits(trained, tmp_path):
    trainer, (features, ids, _, _) = trained
    cfg = export_config(
        trainer.arch,
        trainer.parts,
        block_size=4,
        mask_token_id=trainer.mask_token_id,
        target_layer_ids=LAYER_IDS,
        dtype="float32",
    )
    write_export(tmp_path, trainer.model.state_dict(), cfg)
    S = 20  # draft for the anchor at position 20 of the first sequence
    block = torch.tensor([int(ids[S])] + [trainer.mask_token_id] * 3)
    want = trainer.model.draft(features[:S], block)
    torch.testing.assert_close(_automodel_logits(tmp_path, trainer, features[:S], block), want, rtol=1e-5, atol=1e-5)


def test_published_bf16_checkpoint_loads_with_automodel(trained, tmp_path):
    trainer, (features, ids, _, _) = trained
    ckpt = save_checkpoint(tmp_path, trainer)
    block = torch.tensor([int(ids[20])] + [trainer.mask_token_id] * 3)
    want = trainer.model.draft(features[:20], block)
    got = _automodel_logits(ckpt, trainer, features[:20], block)  # weights rounded to bf16 on export
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.1)
    assert torch.equal(got[1:].argmax(-1), want[1:].argmax(-1))


def test_failed_save_leaves_the_previous_checkpoint(trained, tmp_path, monkeypatch):
    trainer, _ = trained
    first = save_checkpoint(tmp_path, trainer)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    saved_step = trainer.step
    trainer.step = saved_step + 5  # pretend training went on

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, trainer)
    monkeypatch.undo()
    trainer.step = saved_step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", first.name]  # no temp dir left behind
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert load_latest(tmp_path).path == first


def test_saving_a_step_again_replaces_it(trained, tmp_path):
    trainer, _ = trained
    save_checkpoint(tmp_path, trainer)
    again = save_checkpoint(tmp_path, trainer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", again.name]
    assert load_latest(tmp_path).step == trainer.step


def test_load_latest(trained, tmp_path):
    trainer, _ = trained
    assert load_latest(tmp_path / "fresh") is None
    save_checkpoint(tmp_path, trainer)
    ck = load_latest(tmp_path)  # torch.load(weights_only=True) inside
    assert ck.step == trainer.step and ck.state["last_seq"] == trainer.last_seq
    assert all(torch.equal(ck.state["model"][k], v) for k, v in trainer.model.state_dict().items())
    write_pointer(tmp_path, "step_99")  # names nothing: the newest intact one is used instead
    assert load_latest(tmp_path).step == trainer.step


def test_only_the_newest_checkpoints_are_kept(trained, tmp_path):
    trainer, _ = trained
    step = trainer.step
    try:
        for trainer.step in range(10, 15):
            save_checkpoint(tmp_path, trainer, keep_last=2)
    finally:
        trainer.step = step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_13", "step_14"]
    assert load_latest(tmp_path).step == 14
