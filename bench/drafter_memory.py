"""bench.drafter's memory arithmetic: each variant's peak estimated from the shape before anything is allocated.

Why: at a real vocabulary the full-logits baseline's [Q, V] float32 logits alone are 9.3 GiB (16,384 rows ×
151,936), held three times at its peak; a run sized blindly is killed by the kernel's out-of-memory killer
and prints nothing. With an estimate the bench sizes the anchors to a budget it prints, or refuses a shape
in one line.

What is counted (float32, 4 bytes), as the step's tensors are (bench/drafter.py measures the same tensors
with the profiler and prints both, so a drift shows):
- resident, alive for the whole run: the frozen embedding and LM head (2·V·H, shared by both drafters), the
  features (T·n·H), the attention mask (Q·(C+B) booleans, C the longest sequence); DFlash2's codebooks (2·V·r)
  with their Adam moments (2× that). The drafter layers' own weights and moments are a few MiB (in the slack
  of the activation term);
- a step's working memory, on top: the drafter's activations (ACT_FLOATS_PER_ROW_LAYER · H floats per query
  row per layer, DFlash2's convolutions more, plus ACT_FLOATS_PER_ROW once, and the context rows' per token;
  measured with this bench's profiler at H = 256, rounded up), the gradient of the hidden rows (Q·H), and the
  loss's own:
  - full logits (consumer.loss.full_logits_loss): the logits, the log-softmax autograd keeps and, in the
    backward, the NLL's and the log-softmax's gradients, three [Q, V] at once (measured 3.10·Q·V·4 with the
    activations);
  - chunked (consumer.loss.chunked_lm_head_loss): one chunk of logits [min(chunk, Q), V];
  - DFlash2's selector: the codebooks' gradients (2·V·r; F.embedding's are dense) and, per chunk, the
    gathered LM-head and codebook rows [chunk, k, H + r] and their gradients (recomputed in backward, one
    chunk at a time).
    Added to the loss's, though at a large vocabulary they come after its logits are freed (measured: the
    selector adds nothing to the peak at V = 151,936; 62 MiB at V = 20,000): an upper bound.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

FLOAT = 4
# the drafter's activations and their gradients' temporaries per query row, in floats of H: per layer (measured
# 28-29 for DFlash1, 45 for DFlash2) and once (up to 22: embedding, final norm, the backward's temporaries),
# at H = 256, 1-3 layers, 1,024-4,096 rows, rounded up
ACT_FLOATS_PER_ROW_LAYER = {"dflash1": 32, "dflash2": 48}
ACT_FLOATS_PER_ROW = 24
# the context rows' (fc, norm, each layer's keys and values): per token, in floats of H, 7 + 2 per layer (measured
# up to 8.2 at 1 layer, 11.8 at 3; 2,048-8,192 tokens)
CTX_FLOATS_PER_TOKEN, CTX_FLOATS_PER_TOKEN_LAYER = 7, 2


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What sizes a drafter step's tensors (rows = anchors × block)."""

    hidden: int
    vocab: int
    layers: int
    tokens: int
    max_seqlen: int
    anchors: int
    block: int
    chunk_rows: int
    num_features: int = 3
    selector_rank: int = 256
    selector_top_k: int = 16

    @property
    def rows(self) -> int:
        return self.anchors * self.block


@dataclasses.dataclass(frozen=True)
class StepKind:
    """The memory-relevant facts of a bench variant."""

    full_logits: bool = False  # the naive baseline: [Q, V] logits
    dflash2: bool = False  # DFlash2's drafter (convolutions, codebooks)
    selector: bool = False  # DFlash2's selector loss in the step


def resident_bytes(s: StepShape, dflash2: bool) -> int:
    """Tensors alive for the whole run: frozen embedding and head, features, mask; DFlash2's codebooks + Adam."""
    frozen = 2 * s.vocab * s.hidden * FLOAT
    features = s.tokens * s.num_features * s.hidden * FLOAT
    mask = s.rows * (s.max_seqlen + s.block)
    codebooks = 3 * 2 * s.vocab * s.selector_rank * FLOAT if dflash2 else 0
    return frozen + features + mask + codebooks


def step_bytes(s: StepShape, kind: StepKind) -> int:
    """One step's working memory above the resident tensors (the profiler's peak measures the same)."""
    Q, V, H = s.rows, s.vocab, s.hidden
    per_layer = ACT_FLOATS_PER_ROW_LAYER["dflash2" if kind.dflash2 else "dflash1"]
    act = (per_layer * s.layers + ACT_FLOATS_PER_ROW) * H * Q * FLOAT
    act += (CTX_FLOATS_PER_TOKEN + CTX_FLOATS_PER_TOKEN_LAYER * s.layers) * H * s.tokens * FLOAT
    grad_h = Q * H * FLOAT
    loss = (3 * Q if kind.full_logits else min(s.chunk_rows, Q)) * V * FLOAT
    selector = 0
    if kind.selector:
        chunk = min(s.chunk_rows, Q)
        selector = (2 * V * s.selector_rank + 2 * chunk * s.selector_top_k * (H + s.selector_rank)) * FLOAT
    return act + grad_h + loss + selector


def run_bytes(s: StepShape, kinds: list[StepKind]) -> int:
    """The run's estimated peak: what stays resident plus the largest step's working memory."""
    return resident_bytes(s, any(k.dflash2 for k in kinds)) + max(step_bytes(s, k) for k in kinds)


def anchors_that_fit(s: StepShape, kinds: list[StepKind], seqs: int, budget: int) -> int:
    """The most anchors, a multiple of `seqs` up to s.anchors, whose run fits `budget` bytes; 0 if none does."""
    for per_seq in range(s.anchors // seqs, 0, -1):
        if run_bytes(dataclasses.replace(s, anchors=per_seq * seqs), kinds) <= budget:
            return per_seq * seqs
    return 0


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes (what the kernel can give without swapping), None where there is no /proc/meminfo."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
