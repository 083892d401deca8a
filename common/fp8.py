"""FP8 hand-off of the target features (transport.features = "fp8"): e4m3 values, one scale per row.

A row x is stored as q = fp8(x / s) with s = amax(|x|) / 448 (448: e4m3's largest finite value), so its
largest value lands on 448 and every value keeps e4m3's 3 mantissa bits (relative error at most 2^-4 for
normal values). A row of zeros gets s = 1. The producer quantises after the target forward, the consumer
dequantises right after its copy-out to the dtype the features would have had (the target's).
"""

from __future__ import annotations

import torch

from common.packed_batch import SCALE

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
CHUNK = 1 << 24  # values quantised at a time: bounds the float32 temporary (64 MiB) whatever the batch


def quantize_rows(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> None:
    """Quantise `x` [T, W] into `out` (float8_e4m3fn [T, W]) and `scale` (float32 [T]), in place, CHUNK values
    at a time (its temporaries: two float32 chunks)."""
    rows = max(1, CHUNK // max(1, x.shape[1]))
    for a in range(0, x.shape[0], rows):
        chunk = x[a : a + rows].to(torch.float32, copy=True)  # divided in place below: never x itself
        amax = chunk.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        scale[a : a + rows].copy_(s)
        out[a : a + rows].copy_(chunk.div_(s[:, None]).clamp_(-E4M3_MAX, E4M3_MAX))


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new `dtype` [T, W] tensor: `q` (float8_e4m3fn [T, W]) times its row's `scale` (float32 [T]), computed
    in `dtype` (one allocation: no float32 temporary of the whole batch)."""
    out = q.to(dtype)
    return out.mul_(scale.to(dtype)[:, None])


def dequantized(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A copied-out batch with its `hidden` in `dtype`: dequantised when it came as FP8 with its scale column
    (which is dropped), else as it is."""
    if SCALE not in tensors:
        return tensors
    out = dict(tensors)
    out["hidden"] = dequantize_rows(out["hidden"], out.pop(SCALE), dtype)
    return out


__all__ = ["E4M3_MAX", "dequantize_rows", "dequantized", "quantize_rows"]
