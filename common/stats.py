"""Stats publishing: every process sends ProfileStats snapshots to the telemetry process.

THE CONTRACT (producer/consumer authors: follow it; telemetry derives every figure from it)

Transport: a ZeroMQ socket CONNECTED to the telemetry ingest endpoint `ingest_endpoint(job.run_paths)`
(= run_paths.ipc("telemetry-in.sock"); telemetry binds a SUB there). Two frames per message:
    frame 0  topic  b"stats.<role>.<name>"
    frame 1  msgpack map (encode_stats / decode_stats are the only (de)serialisers):
        v            int    SCHEMA_VERSION
        source       str    "<role>.<name>"
        role, name   str    [A-Za-z0-9_-]{1,64}
        pid          int    ;  host str
        seq          int    publish counter from 0; a jump means messages were lost
        wall_time    float  time.time() ; mono_time float time.monotonic() (same host: comparable)
        uptime_s     float  seconds the running totals cover (since the ProfileStats was created)
        step         int | None   the latest step passed to maybe_publish/publish
        final        bool   True on the last message of a cleanly closing process
        timers       {key: {count, sum_s, max_s, min_s, recent_max_s}}  running totals (seconds)
        gpu_timers   {key: same}   CUDA-event durations (ProfileStats.cuda_timer), when used
        counters     {key: number} running totals
        gauges       {key: {last, count, sum, max, min}}
        cuda_memory  {allocated_bytes, allocated_peak_bytes, reserved_bytes, reserved_peak_bytes,
                      active_bytes, active_peak_bytes, inactive_split_bytes, alloc_retries, ooms}
                     (empty when the process has not initialised CUDA)
        cuda_device  int | None ;  gpu_uuid str | None ("GPU-…", as NVML names it)
        process      {cpu_s: float (user+system, running total), rss_bytes: int}

Names telemetry understands (others are forwarded generically as <prefix>/<key>_ms|_pct|_per_s):
    role "producer", name "producer":
        timers   data, forward, write_slot, wait_slot, publish     (busy % = forward + write_slot)
        counters tokens, sequences, batches, loss_tokens (tokens with loss_mask=1, optional)
        gauges   slots_in_use
    role "consumer", name "<drafter>_r<replica>" (e.g. "d0_r0"):
        timers   wait_batch, copy_out, forward, backward, optimizer
        counters tokens, anchors, batches, steps
        gauges   loss, lr, grad_norm, tau_est, acc_slot_1, acc_slot_2, ...
The publisher adds: timer stats_publish, counters stats_dropped, stats_send_errors.

The publisher never blocks: XPUB with XPUB_NODROP (so a full queue raises EAGAIN, which is counted
as a drop instead of vanishing silently), NOBLOCK sends, LINGER 0, a small SNDHWM, IMMEDIATE (nothing
queues while telemetry is absent). Snapshots carry running totals, so a lost message costs
resolution, never totals.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import resource
import socket
import sys
import time
from typing import Any, Protocol

import msgpack
import psutil
import zmq

from common.profile import ProfileStats, format_profile_line, snapshot_delta
from common.run_paths import RunPaths

SCHEMA_VERSION = 1
INGEST_SOCKET = "telemetry-in.sock"  # in the run's sockets/ folder
TOPIC_PREFIX = b"stats."
MAX_PAYLOAD_BYTES = 1 << 20
MAX_KEYS = 1024  # per section
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TIMER_FIELDS = ("count", "sum_s", "max_s", "min_s", "recent_max_s")
GAUGE_FIELDS = ("last", "count", "sum", "max", "min")
# torch.cuda.memory_stats() key -> payload key
CUDA_MEMORY_KEYS = {
    "allocated_bytes.all.current": "allocated_bytes",
    "allocated_bytes.all.peak": "allocated_peak_bytes",
    "reserved_bytes.all.current": "reserved_bytes",
    "reserved_bytes.all.peak": "reserved_peak_bytes",
    "active_bytes.all.current": "active_bytes",
    "active_bytes.all.peak": "active_peak_bytes",
    "inactive_split_bytes.all.current": "inactive_split_bytes",
    "num_alloc_retries": "alloc_retries",
    "num_ooms": "ooms",
}


def ingest_endpoint(run_paths: RunPaths) -> str:
    """Where every StatsPublisher connects and the telemetry process binds."""
    return run_paths.ipc(INGEST_SOCKET)


class StatsDecodeError(ValueError):
    """A stats message that does not follow the contract; telemetry counts these and carries on."""


@dataclasses.dataclass(frozen=True, slots=True)
class StatsPayload:
    role: str
    name: str
    pid: int
    host: str
    seq: int
    wall_time: float
    mono_time: float
    uptime_s: float
    step: int | None
    final: bool
    timers: dict[str, dict[str, float]]
    gpu_timers: dict[str, dict[str, float]]
    counters: dict[str, float]
    gauges: dict[str, dict[str, float]]
    cuda_memory: dict[str, int]
    cuda_device: int | None
    gpu_uuid: str | None
    process: dict[str, float]
    v: int = SCHEMA_VERSION

    @property
    def source(self) -> str:
        return f"{self.role}.{self.name}"

    @property
    def topic(self) -> bytes:
        return TOPIC_PREFIX + self.source.encode()


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(StatsPayload))


def encode_stats(p: StatsPayload) -> list[bytes]:
    """[topic, msgpack body]."""
    body = {name: getattr(p, name) for name in _FIELD_NAMES}  # shallow: asdict's deep copy costs ~1 ms
    body["source"] = p.source
    return [p.topic, msgpack.packb(body, use_bin_type=True)]


def decode_stats(frames: list[bytes]) -> StatsPayload:
    """Validate and decode one message; anything off raises StatsDecodeError naming what was wrong."""
    if len(frames) != 2:
        raise StatsDecodeError(f"expected 2 frames (topic, payload), got {len(frames)}")
    topic, raw = bytes(frames[0]), frames[1]
    if len(raw) > MAX_PAYLOAD_BYTES:
        raise StatsDecodeError(f"payload of {len(raw)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as err:
        raise StatsDecodeError(f"payload is not valid msgpack: {err}") from None
    if not isinstance(body, dict):
        raise StatsDecodeError(f"payload is a {type(body).__name__}, expected a map")
    if body.get("v") != SCHEMA_VERSION:
        raise StatsDecodeError(f"schema version {body.get('v')!r}, expected {SCHEMA_VERSION}")
    fields = {}
    for name in _FIELD_NAMES:
        if name not in body:
            raise StatsDecodeError(f"payload lacks key {name!r}")
        fields[name] = body[name]
    for key in ("role", "name"):
        if not isinstance(fields[key], str) or not NAME_RE.match(fields[key]):
            raise StatsDecodeError(f"{key} {fields[key]!r} does not match {NAME_RE.pattern}")
    p = StatsPayload(**fields)
    if body.get("source") != p.source or topic != p.topic:
        raise StatsDecodeError(f"topic {topic!r} / source {body.get('source')!r} do not match {p.source!r}")
    _check_types(p)
    return p


def _check_types(p: StatsPayload) -> None:
    for key, types in (("pid", int), ("host", str), ("seq", int), ("step", (int, type(None)))):
        _expect(getattr(p, key), types, key)
    if not isinstance(p.final, bool):
        raise StatsDecodeError(f"final has type {type(p.final).__name__}")
    for key in ("wall_time", "mono_time", "uptime_s"):
        _expect_number(getattr(p, key), key)
    _expect(p.cuda_device, (int, type(None)), "cuda_device")
    _expect(p.gpu_uuid, (str, type(None)), "gpu_uuid")
    for section, fields in (("timers", TIMER_FIELDS), ("gpu_timers", TIMER_FIELDS), ("gauges", GAUGE_FIELDS)):
        for key, entry in _table(getattr(p, section), section).items():
            if not isinstance(entry, dict) or set(entry) != set(fields):
                raise StatsDecodeError(f"{section}[{key!r}] must be a map with keys {fields}")
            for f in fields:
                _expect_number(entry[f], f"{section}[{key!r}].{f}")
    for section in ("counters", "cuda_memory", "process"):
        for key, value in _table(getattr(p, section), section).items():
            _expect_number(value, f"{section}[{key!r}]")


def _table(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise StatsDecodeError(f"{where} must be a map, got {type(value).__name__}")
    if len(value) > MAX_KEYS:
        raise StatsDecodeError(f"{where} has {len(value)} keys, over the limit of {MAX_KEYS}")
    for key in value:
        if not isinstance(key, str) or not 0 < len(key) <= 128:
            raise StatsDecodeError(f"{where} has a bad key {key!r}")
    return value


def _expect(value: Any, types: type | tuple, where: str) -> None:
    if not isinstance(value, types) or isinstance(value, bool):
        raise StatsDecodeError(f"{where} has type {type(value).__name__}")


def _expect_number(value: Any, where: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise StatsDecodeError(f"{where} must be a number, got {type(value).__name__}")


class StatsSink(Protocol):
    """What a service loop publishes through: a `StatsPublisher`, or a test's recorder."""

    def maybe_publish(self, step: int | None = None, extra_gauges: dict[str, float] | None = None) -> bool: ...


class StatsPublisher:
    """Sends `prof` snapshots to telemetry at most every `interval_s`; one cheap clock check otherwise."""

    def __init__(
        self,
        endpoint: str,
        role: str,
        name: str,
        interval_s: float,
        prof: ProfileStats,
        *,
        logger: logging.Logger | None = None,
        sndhwm: int = 8,
        context: zmq.Context | None = None,
    ) -> None:
        for key, value in (("role", role), ("name", name)):
            if not NAME_RE.match(value):
                raise ValueError(f"stats publisher {key} {value!r} must match {NAME_RE.pattern}")
        self.role, self.name, self.interval_s, self.prof = role, name, float(interval_s), prof
        self.log = logger or logging.getLogger(f"dflash.stats.{role}.{name}")
        self.seq = 0
        self.step: int | None = None
        self.dropped = 0
        self.errors = 0
        self._pid, self._host = os.getpid(), socket.gethostname()
        self._proc = psutil.Process()
        self._next_due = time.monotonic()
        self._last_snap: dict[str, Any] | None = None
        self._last_log = (prof.started_mono, _cpu_seconds())  # (mono, cpu_s) at the previous log line
        self._gpu_uuids: dict[int, str] = {}
        self._sock = (context or zmq.Context.instance()).socket(zmq.XPUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self._sock.setsockopt(zmq.XPUB_NODROP, 1)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.connect(endpoint)

    def maybe_publish(self, step: int | None = None, extra_gauges: dict[str, float] | None = None) -> bool:
        """Publish if `interval_s` has passed since the last publish; True when it did."""
        now = time.monotonic()
        if now < self._next_due:
            return False
        self._next_due = max(self._next_due + self.interval_s, now)
        self.publish(step, extra_gauges)
        return True

    def publish(
        self, step: int | None = None, extra_gauges: dict[str, float] | None = None, final: bool = False
    ) -> None:
        """Send one snapshot now (never blocks) and log the interval's profile line."""
        t0 = time.perf_counter()
        if step is not None:
            self.step = step
        prof = self.prof
        for key, value in (extra_gauges or {}).items():
            prof.gauge(key, value)
        prof.collect_cuda()
        snap = prof.snapshot()
        now = time.monotonic()
        cuda_device, gpu_uuid, cuda_memory = self._cuda_memory()
        cpu_s = _cpu_seconds()
        payload = StatsPayload(
            role=self.role,
            name=self.name,
            pid=self._pid,
            host=self._host,
            seq=self.seq,
            wall_time=time.time(),
            mono_time=now,
            uptime_s=now - prof.started_mono,
            step=self.step,
            final=final,
            timers=snap["timers"],
            gpu_timers=snap["gpu_timers"],
            counters=snap["counters"],
            gauges=snap["gauges"],
            cuda_memory=cuda_memory,
            cuda_device=cuda_device,
            gpu_uuid=gpu_uuid,
            process={"cpu_s": cpu_s, "rss_bytes": self._proc.memory_info().rss},
        )
        self.seq += 1
        self._send(encode_stats(payload))
        self._log_line(snap, self.step, now, cpu_s)
        prof.add("stats_publish", time.perf_counter() - t0)

    def close(self, final: bool = True, linger_ms: int = 500) -> None:
        """Optionally send the final totals (bounded wait of `linger_ms` to deliver them), then close."""
        if self._sock.closed:
            return
        if final:
            self.publish(final=True)
            self._sock.setsockopt(zmq.LINGER, linger_ms)
        self._sock.close()

    def _send(self, frames: list[bytes]) -> None:
        self._drain_subscriptions()
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            self.prof.count("stats_dropped")
        except zmq.ZMQError as err:
            self.errors += 1
            self.prof.count("stats_send_errors")
            if self.errors == 1:
                self.log.warning("stats publish failed (further failures only counted): %s", err)

    def _drain_subscriptions(self) -> None:
        # XPUB queues subscription notices for the application; read them so they never pile up.
        try:
            while True:
                self._sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _cuda_memory(self) -> tuple[int | None, str | None, dict[str, int]]:
        """Allocator counters (host-side, no sync) when this process already uses CUDA."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return None, None, {}
        device = torch.cuda.current_device()
        stats = torch.cuda.memory_stats(device)
        if device not in self._gpu_uuids:
            self._gpu_uuids[device] = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
        return device, self._gpu_uuids[device], {v: int(stats.get(k, 0)) for k, v in CUDA_MEMORY_KEYS.items()}

    def _log_line(self, snap: dict[str, Any], step: int | None, now: float, cpu_s: float) -> None:
        if not self.log.isEnabledFor(logging.INFO):
            return
        last_mono, last_cpu = self._last_log
        wall = max(now - last_mono, 1e-9)
        line = format_profile_line(snapshot_delta(self._last_snap, snap), wall)
        self.log.info("%s step=%s cpu=%.0f%% | %s", self.role, step, 100.0 * (cpu_s - last_cpu) / wall, line)
        self._last_snap = snap
        self._last_log = (now, cpu_s)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def open_stats(
    run_paths: RunPaths,
    role: str,
    name: str,
    interval_s: float,
) -> tuple[ProfileStats | None, StatsPublisher | None]:
    """A process's profile and its publisher to the job's telemetry (both None when `interval_s` is 0),
    opened at start so that loading shows as a phase, not as a silent process."""
    if interval_s <= 0:
        return None, None
    prof = ProfileStats()
    return prof, StatsPublisher(ingest_endpoint(run_paths), role, name, interval_s, prof)
