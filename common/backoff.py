"""Polling waits that give the core back: the delay between two looks grows from FIRST_S to CAP_S.

A wait on something with no blocking form (a CUDA event the loop must poll while it serves messages) would
spin a core at a fixed zero delay; a fixed long delay would add latency to every short wait. Doubling from
50 µs to a 1 ms cap keeps a short wait short and a long one at a few percent of a core
(bench/wait_cpu.py measures it).
"""

from __future__ import annotations

FIRST_S = 50e-6
CAP_S = 1e-3


class Backoff:
    """Successive delays: FIRST_S, 2·FIRST_S, ... capped at CAP_S."""

    def __init__(self, first_s: float = FIRST_S, cap_s: float = CAP_S):
        self.delay_s = first_s
        self.cap_s = cap_s

    def next(self) -> float:
        delay = self.delay_s
        self.delay_s = min(self.delay_s * 2, self.cap_s)
        return delay


__all__ = ["CAP_S", "FIRST_S", "Backoff"]
