"""FP8 hand-off (transport.features = "fp8"): per-row e4m3 quantisation and the slot it needs."""

import math

import pytest
import torch

from common.fp8 import dequantize_rows, dequantized, quantize_rows
from common.packed_batch import FP8, SCALE, required_slot_bytes, slot_feature_dtype, slot_items
from common.ring import plan_layout


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(x.shape[0], dtype=torch.float32)
    quantize_rows(x, q, s)
    return q, s


def e4m3_round(v: float) -> float:
    """Round to the nearest e4m3 value (ties to even), computed from the format's definition: 3 mantissa bits,
    normal from 2^-6, subnormal step 2^-9, largest 448."""
    a = abs(v)
    step = 2.0 ** (math.floor(math.log2(a)) - 3) if a >= 2.0**-6 else 2.0**-9
    return math.copysign(min(round(a / step) * step, 448.0), v)


def test_a_row_whose_amax_is_448_has_scale_1_and_exact_values():
    x = torch.tensor([[448.0, -224.0, 1.0, 0.5], [0.0, 0.0, 0.0, 0.0], [2.0, 1.0, -0.3, 0.0]])
    q, s = quantize(x)
    assert s.tolist() == pytest.approx([1.0, 1.0, 2 / 448], rel=1e-7)  # amax / 448; an all-zero row: 1
    y = dequantize_rows(q, s, torch.float32)
    assert y[0].tolist() == [448.0, -224.0, 1.0, 0.5]
    assert y[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    # row 3 scaled: [448, 224, -67.2, 0]; -67.2 lies between e4m3's 64 and 72 and rounds to 64
    assert y[2].tolist() == pytest.approx([2.0, 1.0, -64 * 2 / 448, 0.0], rel=1e-6)


def test_round_trip_equals_an_independent_e4m3_rounding_and_stays_within_2_to_the_minus_4():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 96, generator=g) * torch.logspace(-3, 3, 16)[:, None]
    q, s = quantize(x)
    y = dequantize_rows(q, s, torch.float32)
    for r in range(x.shape[0]):
        amax = float(x[r].abs().max())
        assert float(s[r]) == pytest.approx(amax / 448, rel=1e-7)
        want = [e4m3_round(v / float(s[r])) * float(s[r]) for v in (x[r].double() / 1.0).tolist()]
        assert y[r].tolist() == pytest.approx(want, rel=1e-6, abs=1e-30)
    err = (y - x).abs()
    bound = x.abs() * 2.0**-4 + s[:, None] * 2.0**-10  # half a step: 3 mantissa bits, or the subnormal step
    assert bool((err <= bound * (1 + 1e-6)).all())
    assert float(err.max()) > 0  # it was quantised


def test_dequantized_gives_the_target_dtype_and_drops_the_scale_column():
    x = torch.tensor([[1.0, -0.5]], dtype=torch.bfloat16)
    q, s = quantize(x)
    out = dequantized({"hidden": q, SCALE: s, "input_ids": torch.tensor([3])}, torch.bfloat16)
    assert set(out) == {"hidden", "input_ids"}
    assert out["hidden"].dtype == torch.bfloat16 and out["hidden"].tolist() == [[1.0, -0.5]]
    plain = {"hidden": x}
    assert dequantized(plain, torch.bfloat16) is plain  # features in the target dtype pass untouched


def test_the_fp8_slot_holds_the_features_in_half_the_bytes_of_bf16():
    assert slot_feature_dtype("bfloat16", "fp8") == FP8 and slot_feature_dtype("bfloat16", "target") == "bfloat16"
    # the demo's batch: 2048 tokens × 384 features (3 layers × 128)
    assert required_slot_bytes(2048, 384, "float32") == 3_188_992
    assert required_slot_bytes(2048, 384, "bfloat16") == 1_616_128
    assert required_slot_bytes(2048, 384, FP8) == 837_888  # 786,432 B of e4m3 + 8,192 B of float32 scales
    # Qwen3-8B's recipe, 16,384 tokens × 5 × 4096 features: 0.5004 of bf16's slot (the features halved, plus
    # 64 KiB of scales; the token ids, masks and bounds keep their size)
    assert required_slot_bytes(16384, 20480, "bfloat16") == 671_432_960
    assert required_slot_bytes(16384, 20480, FP8) == 335_954_176
    layout = plan_layout(slot_items(10, 2, 8, FP8))
    assert [(t.name, t.dtype, t.shape, t.offset) for t in layout][:2] == [
        ("hidden", FP8, (10, 8), 0),
        (SCALE, "float32", (10,), 256),
    ]
    assert layout[-1].offset + layout[-1].nbytes <= required_slot_bytes(10, 8, FP8, 2)
