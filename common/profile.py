"""ProfileStats: named timers, counters and gauges kept as running totals, with host arithmetic only.

Why running totals: a publisher sends snapshots on a timer and may drop some; the telemetry process
takes differences between consecutive snapshots, so a dropped message loses resolution, never totals.

Hot-path cost is one `time.perf_counter()` pair and a few list/dict updates; nothing here ever
synchronises a GPU. Disabled profiling means the call site holds `None`:

    prof: ProfileStats | None
    if prof:
        with prof.timer("forward"): ...
    if prof:
        prof.count("tokens", n)

Threads: each key must be written by one thread (different keys from different threads are fine);
`snapshot()` may run in any thread.

GPU-side durations (optional): `with prof.cuda_timer("forward"):` records two CUDA events on the
current stream; `collect_cuda()` (called by the publisher at publish time) reads only the pairs
whose end event has completed (`event.query()`, never a wait) into `gpu_timers`.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any

# Per-key running statistics of a duration, as a list for cheap in-place updates:
# [count, sum_s, max_s, min_s, recent_max_s]; recent_max_s is the max since the previous snapshot.
_COUNT, _SUM, _MAX, _MIN, _RECENT = range(5)
_perf_counter = time.perf_counter  # one global lookup in the hot path instead of two
MAX_PENDING_CUDA = 4096  # unread CUDA event pairs kept; past this, GPU timings are skipped and counted


class ProfileStats:
    """Running totals of timers (count, sum, max, min), counters (sum) and gauges (last, count, sum, max, min)."""

    __slots__ = ("_counters", "_cuda", "_gauges", "_gpu_timers", "_timers", "started_mono")

    def __init__(self) -> None:
        self._timers: dict[str, list[float]] = {}
        self._gpu_timers: dict[str, list[float]] = {}
        self._counters: dict[str, int | float] = {}
        self._gauges: dict[str, list[float]] = {}  # [last, count, sum, max, min]
        self._cuda: _CudaEvents | None = None
        self.started_mono = time.monotonic()  # totals cover the time since this instant

    # ---- hot path -------------------------------------------------------------------------------

    def timer(self, key: str) -> _Timer:
        """Context manager adding the elapsed host time (perf_counter) to timer `key`."""
        return _Timer(self._timers, key)

    def add(self, key: str, seconds: float) -> None:
        """Add one duration (seconds) to timer `key`."""
        _accumulate(self._timers, key, seconds)

    def count(self, key: str, n: int | float = 1) -> None:
        """Add `n` to the running total of counter `key` (a Python number: tensors would sync the GPU)."""
        if not isinstance(n, (int, float)):
            raise TypeError(f"counter {key!r}: got {type(n).__name__}; pass a Python int or float")
        self._counters[key] = self._counters.get(key, 0) + n

    def gauge(self, key: str, value: float) -> None:
        """Set gauge `key` to a Python float; count/sum/max/min let telemetry average it over a window."""
        if not isinstance(value, (int, float)):
            raise TypeError(
                f"gauge {key!r}: got {type(value).__name__}; pass a Python float"
                " (read tensors with .item() on log steps only)"
            )
        value = float(value)
        g = self._gauges.get(key)
        if g is None:
            self._gauges[key] = [value, 1, value, value, value]
            return
        g[0] = value
        g[1] += 1
        g[2] += value
        if value > g[3]:
            g[3] = value
        if value < g[4]:
            g[4] = value

    def cuda_timer(self, key: str) -> _CudaTimer:
        """Context manager recording CUDA events around a region; durations land in `gpu_timers`."""
        if self._cuda is None:
            self._cuda = _CudaEvents()
        return _CudaTimer(self._cuda, key)

    # ---- publish time ---------------------------------------------------------------------------

    def collect_cuda(self) -> None:
        """Move completed CUDA event pairs into `gpu_timers`; never waits on the GPU."""
        if self._cuda is not None:
            self._cuda.collect(self._gpu_timers, self._counters)

    def snapshot(self) -> dict[str, Any]:
        """Plain-Python copy of every total; resets each timer's `recent_max_s` (max since last snapshot).

        {"timers": {key: {"count", "sum_s", "max_s", "min_s", "recent_max_s"}},
         "gpu_timers": {same}, "counters": {key: number},
         "gauges": {key: {"last", "count", "sum", "max", "min"}}}
        """
        return {
            "timers": _timer_snapshot(self._timers),
            "gpu_timers": _timer_snapshot(self._gpu_timers),
            "counters": dict(self._counters),
            "gauges": {
                k: {"last": g[0], "count": int(g[1]), "sum": g[2], "max": g[3], "min": g[4]}
                for k, g in list(self._gauges.items())
            },
        }


def timed(prof: ProfileStats | None, key: str) -> _Timer | contextlib.nullcontext:
    """`with timed(prof, key):` times into `prof` when there is one (the ProfileStats-or-None sink), else nothing."""
    return prof.timer(key) if prof else contextlib.nullcontext()


class _Timer:
    __slots__ = ("_key", "_t0", "_table")

    def __init__(self, table: dict[str, list[float]], key: str) -> None:
        self._table = table
        self._key = key

    def __enter__(self) -> _Timer:
        self._t0 = _perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        _accumulate(self._table, self._key, _perf_counter() - self._t0)


def _accumulate(table: dict[str, list[float]], key: str, seconds: float) -> None:
    t = table.get(key)
    if t is None:
        table[key] = [1, seconds, seconds, seconds, seconds]
        return
    t[_COUNT] += 1
    t[_SUM] += seconds
    if seconds > t[_MAX]:
        t[_MAX] = seconds
    if seconds < t[_MIN]:
        t[_MIN] = seconds
    if seconds > t[_RECENT]:
        t[_RECENT] = seconds


def _timer_snapshot(table: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    out = {}
    for k, t in list(table.items()):  # list(): one C-level copy, safe against concurrent inserts
        out[k] = {
            "count": int(t[_COUNT]),
            "sum_s": float(t[_SUM]),
            "max_s": float(t[_MAX]),
            "min_s": float(t[_MIN]),
            "recent_max_s": float(t[_RECENT]),
        }
        t[_RECENT] = 0.0
    return out


class _CudaEvents:
    """Pending (key, start, end) event pairs and a pool of reusable timing events."""

    def __init__(self) -> None:
        import torch  # lazy: ProfileStats must import (and run) without torch or CUDA

        self._new_event = lambda: torch.cuda.Event(enable_timing=True)
        self.pending: collections.deque = collections.deque()
        self.free: list = []

    def event(self):
        return self.free.pop() if self.free else self._new_event()

    def collect(self, gpu_timers: dict[str, list[float]], counters: dict[str, int | float]) -> None:
        pending = self.pending
        while pending:
            key, start, end = pending[0]
            if not end.query():  # stop at the first unfinished pair; later ones wait for next publish
                break
            pending.popleft()
            _accumulate(gpu_timers, key, start.elapsed_time(end) / 1000.0)
            self.free.append(start)
            self.free.append(end)


class _CudaTimer:
    __slots__ = ("_events", "_key", "_start")

    def __init__(self, events: _CudaEvents, key: str) -> None:
        self._events = events
        self._key = key
        self._start = None

    def __enter__(self) -> _CudaTimer:
        if len(self._events.pending) < MAX_PENDING_CUDA:
            self._start = self._events.event()
            self._start.record()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._start is None:
            return
        end = self._events.event()
        end.record()
        self._events.pending.append((self._key, self._start, end))


# ---- derived figures ----------------------------------------------------------------------------


def snapshot_delta(prev: dict[str, Any] | None, cur: dict[str, Any]) -> dict[str, Any]:
    """What happened between two snapshots of one ProfileStats (prev None: since start).

    Timers: count/sum differences, max = cur's recent_max_s (exact when prev is the immediately
    previous snapshot). Counters: differences. Gauges: last, and count/sum/mean over the interval.
    A key absent from prev counts from zero.
    """
    prev = prev or {}
    out: dict[str, Any] = {}
    for section in ("timers", "gpu_timers"):
        before = prev.get(section, {})
        d = {}
        for k, t in cur.get(section, {}).items():
            p = before.get(k)
            n = t["count"] - (p["count"] if p else 0)
            if n > 0:
                s = t["sum_s"] - (p["sum_s"] if p else 0.0)
                d[k] = {"count": n, "sum_s": s, "mean_s": s / n, "max_s": t["recent_max_s"]}
        out[section] = d
    before_c = prev.get("counters", {})
    out["counters"] = {k: v - before_c.get(k, 0) for k, v in cur.get("counters", {}).items()}
    before_g = prev.get("gauges", {})
    gauges = {}
    for k, g in cur.get("gauges", {}).items():
        p = before_g.get(k)
        n = g["count"] - (p["count"] if p else 0)
        s = g["sum"] - (p["sum"] if p else 0.0)
        gauges[k] = {"last": g["last"], "count": n, "mean": s / n if n > 0 else g["last"]}
    out["gauges"] = gauges
    return out


def format_profile_line(snapshot: dict[str, Any], wall_s: float, top: int = 28) -> str:
    """One log line: the `top` timers by total time as `key n×mean_ms (max max_ms) share%`, then counters/s.

    `snapshot` is a ProfileStats snapshot (totals since start; pass the process's age as wall_s) or a
    `snapshot_delta` (one interval; pass its length).
    """
    wall_s = max(wall_s, 1e-9)
    parts = [f"prof {wall_s:.1f}s"]
    for section, tag in (("timers", ""), ("gpu_timers", "gpu:")):
        rows = []
        for k, t in snapshot.get(section, {}).items():
            n = t["count"]
            if n <= 0:
                continue
            rows.append((t["sum_s"], f"{tag}{k}", n, t["sum_s"] / n, t["max_s"]))
        rows.sort(key=lambda r: r[0], reverse=True)
        for total, name, n, mean, mx in rows[:top]:
            parts.append(f"{name} {n}×{mean * 1e3:.2f}ms (max {mx * 1e3:.2f}) {100.0 * total / wall_s:.1f}%")
    counters = snapshot.get("counters", {})
    if any(counters.values()):
        parts.append(" ".join(f"{k}={v / wall_s:.4g}/s" for k, v in sorted(counters.items()) if v))
    return " | ".join(parts)
