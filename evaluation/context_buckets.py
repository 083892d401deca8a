"""τ by context length: where along a response the drafter's acceptance holds and where it collapses.

A draft step's context length is the number of tokens committed when the drafter proposes: the prompt plus
every generated token, the anchor included (the anchor sits at position length - 1). Its step falls in the
bucket [low, high) of the edges (default <1K, 1K–4K, 4K–16K, ≥16K tokens); a bucket's τ is the mean
acceptance length (a+1, bonus included) over its steps, so a long response weighs by its steps there (the
overall τ is the mean over responses of each response's mean).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

DEFAULT_EDGES: tuple[int, ...] = (1024, 4096, 16384)


@dataclass
class ContextBucket:
    label: str
    low: int  # context lengths >= low
    high: int | None  # and < high; None: no upper bound
    steps: int
    accepted: int  # Σ (a+1) over the steps
    tau: float | None  # accepted / steps; None when no step fell here


def check_edges(edges: Sequence[int]) -> tuple[int, ...]:
    """The edges as a tuple, or ValueError when they are not positive and strictly increasing."""
    out = tuple(int(e) for e in edges)
    if not out or out[0] <= 0 or any(b <= a for a, b in pairwise(out)):
        raise ValueError(f"context bucket edges must be positive and strictly increasing, got {list(edges)}")
    return out


def _size(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def bucket_label(low: int, high: int | None) -> str:
    if low == 0:
        return f"<{_size(high)}" if high is not None else "all"
    return f"≥{_size(low)}" if high is None else f"{_size(low)}–{_size(high)}"


class BucketTally:
    """Steps and accepted tokens per bucket, over any number of responses."""

    def __init__(self, edges: Sequence[int] = DEFAULT_EDGES):
        self.edges = check_edges(edges)
        self.steps = [0] * (len(self.edges) + 1)
        self.accepted = [0] * (len(self.edges) + 1)

    def add(self, context_lengths: Sequence[int], accept_lengths: Sequence[int]) -> None:
        if len(context_lengths) != len(accept_lengths):
            raise ValueError(f"{len(context_lengths)} context lengths for {len(accept_lengths)} steps")
        for length, k in zip(context_lengths, accept_lengths, strict=True):
            i = sum(length >= e for e in self.edges)
            self.steps[i] += 1
            self.accepted[i] += k

    def buckets(self) -> list[ContextBucket]:
        bounds = [0, *self.edges, None]
        return [
            ContextBucket(
                bucket_label(bounds[i], bounds[i + 1]),
                bounds[i],
                bounds[i + 1],
                self.steps[i],
                self.accepted[i],
                self.accepted[i] / self.steps[i] if self.steps[i] else None,
            )
            for i in range(len(self.steps))
        ]


def format_buckets(buckets: Sequence[ContextBucket | dict]) -> str:
    """One line: each bucket's τ and its number of steps, `-` where none fell."""
    cells = []
    for b in buckets:
        b = b if isinstance(b, dict) else b.__dict__
        tau = "-" if b["tau"] is None else f"{b['tau']:.2f}"
        cells.append(f"{b['label']} {tau} ({b['steps']})")
    return " | ".join(cells)
