"""The drafter's YaRN option (issue 30 §4): the job key reaches the rotary embedding and the export, and the
drafter's cos/sin are YaRN's, computed here from the formula and by transformers' Qwen3RotaryEmbedding."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from pydantic import ValidationError

from consumer.dflash2 import DFlash2Drafter, DFlash2Shape
from consumer.export.layout import trainer_export_config
from consumer.model import DFlashDrafter, DrafterArch
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer
from tests.consumer.test_drafter_common import LAYER_IDS, drafter_cfg, tiny_target


def yarn_reference(d: int, base: float, factor: float, original: int, beta_fast=32.0, beta_slow=1.0):
    """inv_freq [d/2] (float64) and the cos/sin scale of YaRN as its reference code (and SGLang's, vLLM's
    get_rope) computes them: the dims that turn more than beta_fast times over the original context keep
    their frequency, those under beta_slow turns are divided by the factor, a linear ramp over the dim index
    between (bounds floored/ceiled, clamped to [0, d-1]); cos/sin scaled by 0.1·ln(factor) + 1."""

    def dim_of(turns: float) -> float:  # the dim index whose wavelength fits `turns` times in `original`
        return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(dim_of(beta_fast)), 0), min(math.ceil(dim_of(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    inv = []
    for i in range(d // 2):
        plain = base ** (-2 * i / d)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep the frequency, 1: interpolate
        inv.append(plain * (1 - ramp) + plain / factor * ramp)
    return torch.tensor(inv, dtype=torch.float64), 0.1 * math.log(factor) + 1.0


# Qwen3-8B's head_dim and rope_theta, stretched as Qwen publishes its 128K setting (factor 4 of 32768)
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def qwen3_shaped_drafter(scaling: dict) -> DFlashDrafter:
    arch = DrafterArch(256, 2, 1, 128, 64, 1, 1, 1e-6, 1e6, rope_scaling=scaling, max_position_embeddings=131072)
    return DFlashDrafter(arch, torch.zeros(8, 256), torch.zeros(8, 256))


def test_yarn_frequencies_and_scale_are_the_formulas():
    model = qwen3_shaped_drafter(QWEN3_YARN)
    inv, scale = yarn_reference(128, 1e6, 4.0, 32768)
    torch.testing.assert_close(model.inv_freq.double(), inv, rtol=1e-6, atol=0)
    assert model.rope_scale == pytest.approx(scale, rel=1e-7) and scale == pytest.approx(1.1386294)
    # the fastest dims keep their frequency, the slowest are divided by the factor
    assert model.inv_freq[0] == 1.0 and float(model.inv_freq[-1]) == pytest.approx(1e6 ** (-126 / 128) / 4, rel=1e-6)
    pos = torch.tensor([0, 1, 7, 100, 2047])
    cos, sin = model.rope(pos)
    angle = pos.double()[:, None] * inv
    want = torch.cat([angle, angle], -1)[:, None]
    torch.testing.assert_close(cos.double(), want.cos() * scale, rtol=0, atol=3e-4)  # float32 angles
    torch.testing.assert_close(sin.double(), want.sin() * scale, rtol=0, atol=3e-4)
    arch2 = model.arch  # a DFlash2 drafter has the same rotary (consumer/dflash2.py builds on DFlashDrafter)
    dflash2 = DFlash2Drafter(
        arch2, DFlash2Shape(8, selector_rank=4, selector_top_k=2), torch.zeros(8, 256), torch.zeros(8, 256)
    )
    torch.testing.assert_close(dflash2.rope(pos), model.rope(pos), rtol=0, atol=0)
    plain = qwen3_shaped_drafter(None)  # no scaling: RoPE's own frequencies, scale 1
    torch.testing.assert_close(plain.inv_freq.double(), yarn_reference(128, 1e6, 1.0, 32768)[0], rtol=1e-6, atol=0)
    assert plain.rope_scale == 1.0


def test_yarn_cos_sin_equal_transformers_qwen3_rotary_embedding():
    model = qwen3_shaped_drafter({**QWEN3_YARN, "beta_fast": 16, "beta_slow": 2})
    config = transformers.Qwen3Config(
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters={**QWEN3_YARN, "beta_fast": 16, "beta_slow": 2, "rope_theta": 1e6},
    )
    rotary = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(config)
    pos = torch.tensor([0, 1, 100, 4095, 32767, 32768, 100_000, 131_071])
    hf_cos, hf_sin = rotary(torch.zeros(1, len(pos), 128), pos[None])
    cos, sin = model.rope(pos)
    torch.testing.assert_close(cos[:, 0], hf_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], hf_sin[0], rtol=1e-6, atol=1e-6)
    inv, _ = yarn_reference(128, 1e6, 4.0, 32768, beta_fast=16, beta_slow=2)  # the betas do move the ramp
    torch.testing.assert_close(model.inv_freq.double(), inv, rtol=1e-6, atol=0)


def test_the_job_option_reaches_the_drafter_and_the_export(tmp_path):
    """drafters.rope_scaling -> DrafterConfig -> the trained drafter's rotary -> config.json, which transformers
    (as SGLang and vLLM load a draft config) reads back as the same YaRN: the same cos/sin."""
    tiny_target(tmp_path / "target")
    parts = load_target_parts(tmp_path / "target")
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    cfg = drafter_cfg(rope_scaling=yarn, rope_theta=5e5)
    trainer = Trainer(cfg, parts, LAYER_IDS, "cpu", tokens_per_batch=256)
    assert trainer.arch.rope_scaling == yarn and trainer.arch.max_position_embeddings == 256
    inv, scale = yarn_reference(16, 5e5, 2.0, 64)
    torch.testing.assert_close(trainer.model.inv_freq.double(), inv, rtol=1e-6, atol=0)
    assert trainer.model.rope_scale == pytest.approx(scale)

    exported = trainer_export_config(trainer)
    assert exported["rope_scaling"] == yarn  # transformers 4 readers (SGLang's get_rope_config falls back to it)
    assert exported["rope_parameters"] == {**yarn, "rope_theta": 5e5}  # transformers 5: both engines read this
    assert exported["rope_theta"] == 5e5
    assert exported["max_position_embeddings"] == 128  # 64 × 2, as vLLM derives it (the target's is 256)
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(exported))
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert {k: loaded.rope_parameters[k] for k in (*yarn, "rope_theta")} == {**yarn, "rope_theta": 5e5}
    rotary = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(loaded)
    pos = torch.arange(0, 256, 5)
    hf_cos, hf_sin = rotary(torch.zeros(1, len(pos), 16), pos[None])
    cos, sin = trainer.model.rope(pos)
    torch.testing.assert_close(cos[:, 0], hf_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], hf_sin[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ({"rope_type": "yarn", "factor": 4.0}, "needs ['original_max_position_embeddings']"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "attention_factor": 1.2},
            "unsupported key(s) ['attention_factor']",
        ),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "mscale": 1.0},
            "unsupported key(s) ['mscale']",
        ),
        ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 4096}, "factor must be >= 1"),
        (
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096.5},
            "original_max_position_embeddings must be a positive integer",
        ),
        ({"rope_type": "yarn", "factor": "4", "original_max_position_embeddings": 4096}, "factor must be a number"),
        ({"rope_type": "dynamic", "factor": 2.0}, "is not one of ['linear', 'llama3', 'yarn']"),
    ],
)
def test_a_rope_scaling_the_engines_would_serve_otherwise_is_refused(scaling, message):
    with pytest.raises(ValidationError) as err:
        drafter_cfg(rope_scaling=scaling)
    assert message in str(err.value)


def test_yarn_with_its_betas_and_the_legacy_type_key_is_accepted():
    cfg = drafter_cfg(
        rope_scaling={"type": "yarn", "factor": 8, "original_max_position_embeddings": 4096, "beta_fast": 16}
    )
    assert cfg.rope_scaling["beta_fast"] == 16
