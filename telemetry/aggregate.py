"""Running totals → windowed figures: rates, means, maxima and shares per source, per window.

Each message is differenced against the previous message of the same source (`snapshot_delta`) and
the difference is added to that source's current window; so every unit counted by a process lands
in exactly one window, and lost messages cost resolution, never totals. Rates divide by the time the
differences cover, measured on the source's own monotonic clock (not by arrival time).

Bounded against a rogue or broken publisher (issue 24): a source unheard of for FORGET_AFTER_STALE ×
stale_after_s is forgotten; at most MAX_SOURCES are kept (a newcomer evicts the longest-silent source that is
not live, else it is refused and counted); a source sending faster than RATE_PER_S (burst RATE_BURST) has the
excess dropped and counted (its totals stay right: the next message's difference covers them); a source's
window figures are cut at MAX_FIGURES. So a window's size is bounded whatever arrives.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

from common.profile import snapshot_delta
from common.stats import StatsPayload

WAIT_TIMER = {"producer": "wait_slot", "consumer": "wait_batch"}  # the "wait %" shown per role
PRODUCER_BUSY_TIMERS = ("forward", "write_slot")
MAX_SOURCES = 256  # per telemetry process (one per node): far more than a node's producers and consumers
FORGET_AFTER_STALE = 2.0  # forgotten once silent for this many stale_after_s (shown "stale" or "exited" until then)
RATE_PER_S, RATE_BURST = 20.0, 40.0  # per source; a real one sends every telemetry.interval_s (default 2 s)
MAX_FIGURES = 512  # per source and window; a real consumer has about 60
REPLICA_NAME = re.compile(r"^(?P<drafter>.+)_r(?P<replica>\d+)$")
_BAD_CHARS = re.compile(r"[^_a-zA-Z0-9]")


def metric_name(*segments: object) -> str:
    """W&B-safe name: each segment matches ^[_a-zA-Z][_a-zA-Z0-9]*$, except a bare device index
    (`gpu/0/util_pct`, the naming DESIGN.md fixes)."""
    out = []
    for seg in segments:
        s = _BAD_CHARS.sub("_", str(seg)) or "_"
        if s[0].isdigit() and not s.isdigit():
            s = "_" + s
        out.append(s)
    return "/".join(out)


def source_prefix(role: str, name: str) -> str:
    """`producer` for the (single) producer named like its role, else `<role>/<name>`."""
    return metric_name(role) if name == role else metric_name(role, name)


@dataclasses.dataclass
class _Window:
    """What one source did during the current window (sums of per-message differences)."""

    span_s: float = 0.0  # source time covered by the differences
    messages: int = 0
    timers: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # [count, sum_s, max_s]
    gpu_timers: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    counters: dict[str, float] = dataclasses.field(default_factory=dict)
    gauges: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # [count, sum, last]
    cpu_s: float = 0.0

    def add(self, delta: dict[str, Any], span_s: float, cpu_s: float) -> None:
        self.span_s += span_s
        self.messages += 1
        self.cpu_s += cpu_s
        for section, table in (("timers", self.timers), ("gpu_timers", self.gpu_timers)):
            for k, t in delta[section].items():
                acc = table.setdefault(k, [0, 0.0, 0.0])
                acc[0] += t["count"]
                acc[1] += t["sum_s"]
                acc[2] = max(acc[2], t["max_s"])
        for k, v in delta["counters"].items():
            self.counters[k] = self.counters.get(k, 0) + v
        for k, g in delta["gauges"].items():
            acc = self.gauges.setdefault(k, [0, 0.0, g["last"]])
            acc[0] += g["count"]
            acc[1] += g["mean"] * g["count"]
            acc[2] = g["last"]


@dataclasses.dataclass
class SourceState:
    last: StatsPayload
    last_seen: float  # telemetry's monotonic clock
    messages: int = 0
    gaps: int = 0  # messages lost (sequence jumps)
    restarts: int = 0
    window: _Window = dataclasses.field(default_factory=_Window)
    figures: dict[str, float] = dataclasses.field(default_factory=dict)  # of the last window with data
    tokens: float = RATE_BURST  # the rate limit's bucket: one message takes one token
    refilled: float = 0.0  # when the bucket was last topped up (telemetry's monotonic clock)
    rate_limited: int = 0


class Aggregator:
    """Keeps one SourceState per `<role>.<name>` and turns the current windows into one document."""

    def __init__(self, stale_after_s: float, max_sources: int = MAX_SOURCES, log: logging.Logger | None = None) -> None:
        self.stale_after_s, self.max_sources = stale_after_s, max_sources
        self.log = log or logging.getLogger("dflash.telemetry")
        self.sources: dict[str, SourceState] = {}
        self.messages = 0
        self.gaps = 0
        self.restarts = 0
        self.refused = 0  # messages of new sources refused at the cap
        self.evicted = 0  # sources dropped at the cap to make room
        self.forgotten = 0  # sources dropped after FORGET_AFTER_STALE × stale_after_s of silence
        self.rate_limited = 0

    def ingest(self, p: StatsPayload, now: float) -> bool:
        """Aggregate one message; False when it was refused (cap) or dropped (rate limit)."""
        st = self.sources.get(p.source)
        if st is None and not self._make_room(p.source, now):
            return False
        if st is not None:
            st.tokens, st.refilled = min(RATE_BURST, st.tokens + (now - st.refilled) * RATE_PER_S), now
            if st.tokens < 1.0 and not p.final:  # a final message always counts: it carries the last totals
                st.rate_limited += 1
                self.rate_limited += 1
                return False
            st.tokens -= 1.0
        if st is None or p.pid != st.last.pid or p.seq <= st.last.seq:
            prev, span, prev_cpu = None, p.uptime_s, 0.0  # new process: its totals count from zero
            if st is not None:
                st.restarts += 1
                self.restarts += 1
            else:
                st = self.sources[p.source] = SourceState(last=p, last_seen=now, tokens=RATE_BURST - 1, refilled=now)
        else:
            missed = p.seq - st.last.seq - 1
            st.gaps += missed
            self.gaps += missed
            prev, span = _totals(st.last), p.mono_time - st.last.mono_time
            prev_cpu = st.last.process.get("cpu_s", 0.0)
        delta = snapshot_delta(prev, _totals(p))
        st.window.add(delta, max(span, 0.0), p.process.get("cpu_s", 0.0) - prev_cpu)
        st.last, st.last_seen = p, now
        st.messages += 1
        self.messages += 1
        return True

    def _make_room(self, source: str, now: float) -> bool:
        """Room for one more source: below the cap, or by evicting the longest-silent one that is not live."""
        if len(self.sources) < self.max_sources:
            return True
        quiet = [
            (st.last_seen, name)
            for name, st in self.sources.items()
            if st.last.final or now - st.last_seen > self.stale_after_s
        ]
        if quiet:
            del self.sources[min(quiet)[1]]
            self.evicted += 1
            return True
        self.refused += 1
        if self.refused == 1 or self.refused % 10_000 == 0:
            self.log.warning(
                "telemetry keeps at most %d sources (MAX_SOURCES, telemetry/aggregate.py), all live:"
                " messages of new source %r refused (%d so far); a source is forgotten after %.0f s"
                " of silence",
                self.max_sources,
                source,
                self.refused,
                FORGET_AFTER_STALE * self.stale_after_s,
            )
        return False

    def forget_silent(self, now: float) -> int:
        """Drop the sources silent for FORGET_AFTER_STALE × stale_after_s; how many went."""
        limit = FORGET_AFTER_STALE * self.stale_after_s
        gone = [name for name, st in self.sources.items() if now - st.last_seen > limit]
        for name in gone:
            del self.sources[name]
        self.forgotten += len(gone)
        return len(gone)

    def close_window(self, now: float) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """(flat metrics, per-source summaries) for the window that ends now; starts the next one."""
        self.forget_silent(now)
        metrics: dict[str, float] = {}
        summaries = []
        drafters: dict[str, list[float]] = {}
        for source in sorted(self.sources):
            st = self.sources[source]
            p, w = st.last, st.window
            prefix = source_prefix(p.role, p.name)
            age = now - st.last_seen
            if w.span_s > 0:
                st.figures = _source_figures(p, w)
                for k, v in st.figures.items():
                    metrics[f"{prefix}/{k}"] = v
            figures = st.figures
            summary = {
                "source": source,
                "role": p.role,
                "name": p.name,
                "pid": p.pid,
                "host": p.host,
                "state": "exited" if p.final else "live" if age <= self.stale_after_s else "stale",
                "age_s": age,
                "step": p.step,
                "seq": p.seq,
                "messages": st.messages,
                "gaps": st.gaps,
                "restarts": st.restarts,
                "rate_limited": st.rate_limited,
                "gpu_uuid": p.gpu_uuid,
                "tokens_per_s": figures.get("tokens_per_s"),
                "wait_pct": figures.get(f"{WAIT_TIMER.get(p.role)}_pct"),
                "busy_pct": figures.get("busy_pct"),
                "slots_in_use": figures.get("slots_in_use"),
            }
            summaries.append(summary)
            m = REPLICA_NAME.match(p.name)
            if p.role == "consumer" and m and w.span_s > 0:
                drafters.setdefault(m["drafter"], []).append(figures.get("tokens_per_s", 0.0))
            st.window = _Window()
        producer_rates = [v for k, v in metrics.items() if k.startswith("producer") and k.endswith("/tokens_per_s")]
        if producer_rates:
            metrics["pipeline/tokens_per_s"] = sum(producer_rates)
            metrics["pipeline/producers_reporting"] = float(len(producer_rates))
            if max(producer_rates) > 0:  # target replicas: slowest ÷ fastest (1 = the producers keep pace)
                metrics["pipeline/producer_balance"] = min(producer_rates) / max(producer_rates)
        for drafter, rates in sorted(drafters.items()):
            metrics[metric_name("drafter", drafter, "tokens_per_s")] = sum(rates)
            metrics[metric_name("drafter", drafter, "replicas_reporting")] = float(len(rates))
            if max(rates) > 0:
                metrics[metric_name("drafter", drafter, "replica_balance")] = min(rates) / max(rates)
        return metrics, summaries


def _totals(p: StatsPayload) -> dict[str, Any]:
    return {"timers": p.timers, "gpu_timers": p.gpu_timers, "counters": p.counters, "gauges": p.gauges}


def _source_figures(p: StatsPayload, w: _Window) -> dict[str, float]:
    """Per-source window figures, names relative to the source prefix."""
    span = w.span_s
    out: dict[str, float] = {}
    if p.step is not None:
        out["step"] = float(p.step)
    for tag, table in (("", w.timers), ("gpu_", w.gpu_timers)):
        for k, (n, s, mx) in table.items():
            if n > 0:
                out[metric_name(f"{tag}{k}_ms")] = 1e3 * s / n
                out[metric_name(f"{tag}{k}_max_ms")] = 1e3 * mx
                out[metric_name(f"{tag}{k}_pct")] = 100.0 * s / span
    for k, v in w.counters.items():
        out[metric_name(k)] = float(v)
        out[metric_name(f"{k}_per_s")] = v / span
    for k, (n, s, last) in w.gauges.items():
        out[metric_name(k)] = s / n if n > 0 else float(last)
    for k, v in p.cuda_memory.items():
        out[metric_name(f"cuda_{k}")] = float(v)
    out["cpu_pct"] = 100.0 * w.cpu_s / span
    out["rss_bytes"] = float(p.process.get("rss_bytes", 0))
    out["messages"] = float(w.messages)
    c = w.counters
    if p.role == "producer":
        out["busy_pct"] = sum(out.get(f"{t}_pct", 0.0) for t in PRODUCER_BUSY_TIMERS)
        if c.get("batches"):
            out["tokens_per_batch"] = c.get("tokens", 0) / c["batches"]
            out["sequences_per_batch"] = c.get("sequences", 0) / c["batches"]
        if c.get("sequences"):
            out["mean_seq_len"] = c.get("tokens", 0) / c["sequences"]
        if c.get("tokens") and "loss_tokens" in c:
            out["loss_mask_frac"] = c["loss_tokens"] / c["tokens"]
    wait = WAIT_TIMER.get(p.role)
    if wait:
        out.setdefault(f"{wait}_pct", 0.0)  # the process never waited this window
    if len(out) > MAX_FIGURES:  # a broken publisher's thousands of keys: the window stays small
        out = dict(list(out.items())[:MAX_FIGURES])
    return out
