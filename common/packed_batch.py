"""The packed batch: the one description of what a batch carries from the producer to the consumers.

Sequences lie end to end, no padding: `hidden` [T, n·H] in the target dtype, `input_ids` [T] int64,
`loss_mask` [T] uint8, `cu_seqlens` [B+1] int32 (sequence bounds). The producer packs it (the features are
written into the slot by the target forward), the ring lays it out (`slot_items`, `required_slot_bytes`),
the consumer copies it out (`FIELDS`: which tensors, which stay on the host) and the benchmarks build it:
a new field is added here, in `FIELDS` and `PackedBatch`, and every one of them follows.

Torch-free at import (the job-file checks size slots without loading torch); tensors only in annotations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import Tensor

SLOT_ALIGN = 256  # every tensor in a slot starts on this boundary
FEATURES = "features"  # a field's dtype placeholder: the target's feature dtype
# Optional layout entry: int64 [1], the seq a slot holds. The producer sets it to -1 before rewriting a slot
# and to the batch's seq after; a consumer reads it after copying, so a slot reused under it is detected.
SEQ_TAG = "seq_tag"
# transport.features = "fp8": `hidden` travels as FP8 e4m3 and this float32 [T] column beside it holds each
# row's scale (amax / 448); the consumer dequantises right after its copy-out (common/fp8.py)
FP8 = "float8_e4m3fn"
SCALE = "hidden_scale"
ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1, FP8: 1}


@dataclass(frozen=True)
class Field:
    """One tensor of a packed batch: rows per token (`tokens`) or per sequence bound (`bounds`, B+1)."""

    name: str
    dtype: str  # or FEATURES
    rows: Literal["tokens", "bounds"]
    wide: bool = False  # [rows, feature_width]
    on_host: bool = False  # the consumer keeps it in host memory: its values size the step on the host

    def shape(self, tokens: int, sequences: int, feature_width: int) -> tuple[int, ...]:
        rows = tokens if self.rows == "tokens" else sequences + 1
        return (rows, feature_width) if self.wide else (rows,)

    def dtype_of(self, feature_dtype: str) -> str:
        return feature_dtype if self.dtype == FEATURES else self.dtype


FIELDS: tuple[Field, ...] = (  # slot order: the features first and largest
    Field("hidden", FEATURES, "tokens", wide=True),
    Field("input_ids", "int64", "tokens"),
    Field("loss_mask", "uint8", "tokens", on_host=True),  # with cu_seqlens it sizes the step (its anchors)
    Field("cu_seqlens", "int32", "bounds", on_host=True),
)
NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
HOST_FIELDS: frozenset[str] = frozenset(f.name for f in FIELDS if f.on_host)


def slot_feature_dtype(target_dtype: str, features: str) -> str:
    """The dtype `hidden` has in a slot: the target's, or FP8 under transport.features = "fp8"."""
    return FP8 if features == "fp8" else target_dtype


def slot_items(tokens: int, sequences: int, feature_width: int, feature_dtype: str) -> list[tuple[str, str, tuple]]:
    """(name, dtype, shape) of every tensor a slot holds for this batch (FP8 features: their scale column
    after them), the seq tag last (it fits the slot's sample-id allowance, see `required_slot_bytes`);
    `common.ring.plan_layout` places them."""
    items = [(f.name, f.dtype_of(feature_dtype), f.shape(tokens, sequences, feature_width)) for f in FIELDS]
    if feature_dtype == FP8:
        items.insert(1, (SCALE, "float32", (tokens,)))
    return [*items, (SEQ_TAG, "int64", (1,))]


def aligned(n: int) -> int:
    return int(math.ceil(n / SLOT_ALIGN) * SLOT_ALIGN)


def required_slot_bytes(tokens: int, feature_width: int, dtype: str, max_sequences: int | None = None) -> int:
    """Bytes the largest batch of `tokens` needs in a slot: every field aligned, plus an allowance of one
    int64 per sequence (sample ids), which also holds the seq tag. At most one sequence per token."""
    seqs = tokens if max_sequences is None else max_sequences
    total = 0
    for f in FIELDS:
        n = ITEM_BYTES[f.dtype_of(dtype)]
        for d in f.shape(tokens, seqs, feature_width):
            n *= d
        total += aligned(n)
    if dtype == FP8:
        total += aligned(tokens * ITEM_BYTES["float32"])  # the per-row scales
    return total + aligned(seqs * 8)


@dataclass
class PackedBatch:
    """One batch of the plan. The producer's has `hidden` None (the forward writes the features straight
    into the slot); the consumer's holds all four tensors."""

    seq: int
    epoch: int  # pass over the data
    sample_ids: Sequence[int]
    input_ids: Tensor  # [T] int64
    loss_mask: Tensor  # [T] uint8, on the host
    cu_seqlens: Tensor  # [B+1] int32, on the host
    hidden: Tensor | None = None  # [T, n·H] target dtype (the consumer's: dequantised when it came as FP8)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    def tensors(self) -> dict[str, Tensor]:
        """The fields present, by name, in slot order."""
        return {name: t for name in NAMES if (t := getattr(self, name)) is not None}


__all__ = [
    "FIELDS",
    "FP8",
    "HOST_FIELDS",
    "NAMES",
    "SCALE",
    "SEQ_TAG",
    "SLOT_ALIGN",
    "Field",
    "PackedBatch",
    "required_slot_bytes",
    "slot_feature_dtype",
    "slot_items",
]
