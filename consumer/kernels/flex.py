"""flex_attention compiled for a planned, bounded set of padded shapes; an eager fallback is never silent.

Why a plan: compiled with static shapes, every new (Tp, Qp, window) is a new graph. Per-batch length
buckets times sliding + full layers passed Dynamo's recompile limit (8 per code object), after which
Dynamo runs flex_attention eagerly, and eager flex materialises the whole [1, h, Qp, Tp+Qp] score matrix
(tens of GB at real shapes). So a run pads every batch to ONE shape: context rows to the job's
tokens_per_batch, block rows to its anchor budget × block size (both rounded up to the 128-row tile).
Block sparsity makes that padding nearly free: a padded query tile has no key block to visit and a
padded key tile is seen by no row, so only the padded q/k/v/out buffers cost (memory, not FLOPs); and the
anchor budget binds on most real batches, so the real rows fill most of it anyway. A run therefore
compiles one graph per layer kind (the window and the sliding in-block rule are constants of the mask
function).

A batch beyond the plan (a caller feeding more tokens than tokens_per_batch) gets its own bucket
(`flex_bucket`), counted as `flex_unplanned_shapes` and logged once. Dynamo's recompile limit is set to
the planned graphs plus `UNPLANNED_GRAPHS` while this kernel compiles; past it Dynamo raises (we set
`fail_on_recompile_limit_hit` for our calls only) instead of falling back silently, and the call runs
eager flex, counted as `flex_eager_fallbacks` and logged once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch._dynamo.config
from torch import Tensor
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch.nn.attention.flex_attention import BlockMask, flex_attention

log = logging.getLogger(__name__)

FLEX_TILE = 128  # rows per FlexAttention block (the BlockMask's BLOCK_SIZE)
UNPLANNED_GRAPHS = 4  # graphs beyond the plan Dynamo may still compile before it refuses


def flex_bucket(n: int) -> int:
    """The padded length for n rows outside the plan: the next of 128·2^k and 192·2^k (waste < 50%)."""
    size = FLEX_TILE
    while True:
        for cand in (size, size * 3 // 2):
            if cand >= n:
                return cand
        size *= 2


def _round_up(n: int, tile: int) -> int:
    return max(tile, -(-n // tile) * tile)


@dataclass(frozen=True)
class FlexPlan:
    """The one padded shape of a run's flex attention: [block_rows queries, ctx_rows + block_rows keys]."""

    ctx_rows: int  # Tp: context rows (the job's tokens_per_batch, tile-rounded)
    block_rows: int  # Qp: block rows (anchor budget × block size, tile-rounded)
    layer_kinds: int  # full / sliding: one compiled graph each

    @classmethod
    def for_run(cls, max_tokens: int, max_anchors: int, block_size: int, layer_kinds: int) -> FlexPlan:
        return cls(_round_up(max_tokens, FLEX_TILE), _round_up(max_anchors * block_size, FLEX_TILE), layer_kinds)

    @property
    def graphs(self) -> int:
        """Graphs a run compiles when every batch fits the plan."""
        return self.layer_kinds

    def padded(self, num_tokens: int, query_rows: int) -> tuple[int, int]:
        """(Tp, Qp) for a batch of T context rows and Q block rows: the plan, or a bucket when it does not fit."""
        if num_tokens <= self.ctx_rows and query_rows <= self.block_rows:
            return self.ctx_rows, self.block_rows
        return flex_bucket(num_tokens), flex_bucket(query_rows)


class CompiledFlex:
    """torch.compile(flex_attention) with static shapes for one FlexPlan, counting what leaves the plan.

    `prof` (common.profile.ProfileStats or None) gets the host counters `flex_unplanned_shapes` (calls on a
    shape outside the plan) and `flex_eager_fallbacks` (calls Dynamo refused to compile, run eagerly)."""

    def __init__(self, plan: FlexPlan, prof=None):
        self.plan = plan
        self.prof = prof
        self.recompile_limit = plan.graphs + UNPLANNED_GRAPHS
        self.unplanned_shapes = 0
        self.eager_fallbacks = 0
        self._compiled = torch.compile(flex_attention, dynamic=False)

    def _count(self, key: str) -> None:
        if self.prof:
            self.prof.count(key, 1)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask) -> Tensor:
        """q [1, h, Qp, d], k/v [1, hk, Tp+Qp, d] on the block mask's padded grid -> [1, h, Qp, d]."""
        Qp, KVp = block_mask.seq_lengths
        if (KVp - Qp, Qp) != (self.plan.ctx_rows, self.plan.block_rows):
            self.unplanned_shapes += 1
            self._count("flex_unplanned_shapes")
            if self.unplanned_shapes == 1:
                log.warning(
                    "flex attention: a batch of %d context × %d block rows (padded) is outside the plan"
                    " (%d × %d): it compiles a graph of its own; counted as flex_unplanned_shapes",
                    KVp - Qp,
                    Qp,
                    self.plan.ctx_rows,
                    self.plan.block_rows,
                )
        try:
            # the limit only while this kernel compiles: a run needs plan.graphs, the rest is headroom
            with torch._dynamo.config.patch(recompile_limit=self.recompile_limit, fail_on_recompile_limit_hit=True):
                return self._compiled(q, k, v, block_mask=block_mask, enable_gqa=True)
        except FailOnRecompileLimitHit:
            self.eager_fallbacks += 1
            self._count("flex_eager_fallbacks")
            if self.eager_fallbacks == 1:
                log.warning(
                    "flex attention: Dynamo's recompile limit (%d graphs) is reached; this and later"
                    " new shapes run eager flex, which materialises the [h, %d, %d] scores; counted as"
                    " flex_eager_fallbacks",
                    self.recompile_limit,
                    Qp,
                    KVp,
                )
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


@dataclass(frozen=True)
class FlexMask:
    """A BlockMask on a planned grid and the compiled kernel that runs it (consumer.model.attend)."""

    block_mask: BlockMask
    kernel: CompiledFlex
