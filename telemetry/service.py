"""The telemetry process: ingest stats, close a window every window_s, fan the window out to the sinks.

One thread runs the sockets and the windows; NVML and W&B run in their own threads so that neither a
slow driver call nor a W&B stall delays ingestion. A malformed message is counted, never fatal.

A flooding publisher (issue 24) cannot take the CPU the training needs: telemetry handles at most
INGEST_PER_S messages a second and leaves the rest queued, in that publisher's own pipe (ZeroMQ queues per
connection, bounded by RCVHWM, and reads the connections in turn, so the real publishers still get through);
a full pipe stops the flooder's sends, never a real publisher's (they never block, common/stats.py).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

import zmq

from common.config import JobConfig
from common.security import IpcFile
from common.stats import MAX_PAYLOAD_BYTES, TOPIC_PREFIX, StatsDecodeError, decode_stats, ingest_endpoint
from telemetry.aggregate import Aggregator, metric_name, source_prefix
from telemetry.nvml import NvmlSampler
from telemetry.sinks import JsonlSink, Republisher, WandbSink

REPUBLISH_SOCKET = "telemetry-out.sock"
MAX_BATCH = 1000  # messages handled before the loop looks at the clock again
INGEST_PER_S = 2000  # messages handled per second at most; a real job's processes send a few per second each
TICK_S = 0.1  # the ingest budget is given out per tick
RCVHWM = 100  # messages queued per connection; a real publisher has a few in flight at most
GPU_SKIP = {"index", "uuid", "name", "energy_mj", "last_xid"}  # not plotted per window


def republish_endpoint(job: JobConfig) -> str:
    """Where `dflash-stats` subscribes."""
    return job.run_paths.ipc(REPUBLISH_SOCKET)


class TelemetryService:
    def __init__(
        self, job: JobConfig, log: logging.Logger, *, nvml=None, context: zmq.Context | None = None, node: int = 0
    ):
        """`node`: this machine's node rank; its W&B run is "node<rank>" in the group named after the job."""
        self.job, self.log, self.cfg = job, log, job.telemetry
        paths = job.run_paths
        paths.make()
        self.context = context or zmq.Context()
        self.ingest = self.context.socket(zmq.SUB)
        self.ingest.setsockopt(zmq.LINGER, 0)
        self.ingest.setsockopt(zmq.RCVHWM, RCVHWM)
        self.ingest.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_PAYLOAD_BYTES)  # a flooding peer is disconnected
        self.ingest.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX)
        self.ingest.bind(ingest_endpoint(job.run_paths))
        self.republisher = Republisher(self.context, republish_endpoint(job))
        self._socket_files = [IpcFile(ingest_endpoint(job.run_paths)), IpcFile(republish_endpoint(job))]
        self.jsonl = JsonlSink(paths.metrics_jsonl, log)
        self.wandb = None
        if self.cfg.wandb_mode != "disabled":
            run_key = hashlib.sha1(str(paths.root.resolve()).encode()).hexdigest()[:8]
            self.wandb = WandbSink(
                mode=self.cfg.wandb_mode,
                project=self.cfg.wandb_project,
                entity=self.cfg.wandb_entity,
                root_dir=paths.root,
                group=job.job.name,
                name=f"node{node}",
                run_id=f"{job.job.name}-{run_key}" + (f"-n{node}" if node else ""),  # nodes may share run_dir's path
                queue_size=self.cfg.wandb_queue,
                log=log,
                config=job.model_dump(mode="json"),
            )
        self.nvml = NvmlSampler(self.cfg.nvml_interval_s, log, nvml)
        self.agg = Aggregator(self.cfg.stale_after_s, log=log)
        self.decode_errors = 0
        self.processing_errors = 0
        self.windows = 0
        self._started = time.monotonic()
        self._window_started = self._started
        self._window_messages = 0
        self._budget, self._tick_end = 0, self._started
        self.throttled_ticks = 0  # ticks whose whole ingest budget was used: someone sends too much

    def run(self, stop: threading.Event) -> None:
        """Until `stop` is set; then one last window (so final totals are never lost) and a bounded close."""
        self.nvml.start()
        if self.wandb:
            self.wandb.start()
        poller = zmq.Poller()
        poller.register(self.ingest, zmq.POLLIN)
        poller.register(self.republisher.socket, zmq.POLLIN)
        next_window = self._started + self.cfg.window_s
        self.log.info(
            "telemetry up: ingest %s, republish %s",
            ingest_endpoint(self.job.run_paths),
            republish_endpoint(self.job),
        )
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now >= self._tick_end:
                    self._budget, self._tick_end = int(INGEST_PER_S * TICK_S), now + TICK_S
                    poller.modify(self.ingest, zmq.POLLIN)
                timeout_ms = max(0.0, min(next_window, self._tick_end) - now) * 1e3
                ready = dict(poller.poll(timeout_ms))
                if self.ingest in ready:
                    self._drain_ingest()
                    if self._budget <= 0:  # wait for the next tick, leaving the rest queued
                        self.throttled_ticks += 1
                        poller.modify(self.ingest, 0)
                if self.republisher.socket in ready:
                    self.republisher.on_readable()
                now = time.monotonic()
                if now >= next_window:
                    self._emit_window(now)
                    next_window = max(next_window + self.cfg.window_s, now)
            self._drain_ingest(MAX_BATCH)  # the final totals of the processes that stop with us
            self._emit_window(time.monotonic())
        finally:
            self.close()

    def close(self) -> None:
        self.nvml.stop()
        if self.wandb:
            self.wandb.close()
        self.jsonl.close()
        self.republisher.close()
        self.ingest.close()
        for f in self._socket_files:  # libzmq leaves bound ipc files behind
            f.remove()

    def handle(self, frames: list[bytes], now: float) -> None:
        """Decode and aggregate one message; every failure is counted and logged sparingly."""
        self._window_messages += 1
        try:
            payload = decode_stats(frames)
        except StatsDecodeError as err:
            self.decode_errors += 1
            if _sparse(self.decode_errors):
                self.log.warning("malformed stats message #%d ignored: %s", self.decode_errors, err)
            return
        try:
            self.agg.ingest(payload, now)
        except Exception:
            self.processing_errors += 1
            if _sparse(self.processing_errors):
                self.log.exception("stats message from %s could not be aggregated", payload.source)

    def _drain_ingest(self, limit: int | None = None) -> None:
        """Up to `limit` messages (default: what is left of this tick's budget)."""
        for _ in range(min(MAX_BATCH, self._budget if limit is None else limit)):
            try:
                frames = self.ingest.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._budget -= 1
            self.handle(frames, time.monotonic())

    def _emit_window(self, now: float) -> None:
        metrics, sources = self.agg.close_window(now)
        gpus = self.nvml.window(now)
        for gpu in gpus:
            for k, v in gpu.items():
                if k not in GPU_SKIP and isinstance(v, (int, float)):
                    metrics[metric_name("gpu", gpu["index"], k)] = float(v)
        health = self._health(now, sources)
        for k, v in health.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                metrics[metric_name("telemetry", k)] = float(v)
        producer = next((s for s in sources if s["role"] == "producer"), None)
        doc = {
            "time": time.time(),
            "uptime_s": now - self._started,
            "window_s": now - self._window_started,
            "job": self.job.job.name,
            "run_dir": str(self.job.run_paths.root.resolve()),
            "metrics": metrics,
            "sources": sources,
            "gpus": gpus,
            "ring": {
                "slots_total": self.job.transport.slots,
                "slots_in_use": producer["slots_in_use"] if producer else None,
            },
            "health": health,
        }
        self.jsonl.write(doc)
        self.republisher.publish(doc)
        if self.wandb:
            self.wandb.submit(metrics, [source_prefix(s["role"], s["name"]) for s in sources])
        self.windows += 1
        self._window_started, self._window_messages = now, 0
        self.log.info(
            "window %d: %d msgs, %d/%d sources live, pipeline %.0f tok/s, gaps %d, decode errors %d%s",
            self.windows,
            health["messages_window"],
            health["sources_live"],
            len(sources),
            metrics.get("pipeline/tokens_per_s", 0.0),
            health["gaps"],
            self.decode_errors,
            f", metrics.jsonl dropped {self.jsonl.dropped} window(s)" if self.jsonl.dropped else "",
        )

    def _health(self, now: float, sources: list[dict[str, Any]]) -> dict[str, Any]:
        span = max(now - self._window_started, 1e-9)
        live = sum(s["state"] == "live" for s in sources)
        return {
            "uptime_s": now - self._started,
            "messages": self.agg.messages,
            "messages_window": self._window_messages,
            "messages_per_s": self._window_messages / span,
            "gaps": self.agg.gaps,
            "restarts": self.agg.restarts,
            "decode_errors": self.decode_errors,
            "processing_errors": self.processing_errors,
            "sources_refused": self.agg.refused,
            "sources_evicted": self.agg.evicted,
            "sources_forgotten": self.agg.forgotten,
            "rate_limited": self.agg.rate_limited,
            "throttled_ticks": self.throttled_ticks,
            "sources_live": live,
            "sources_stale": len(sources) - live,
            "cli_subscribers": self.republisher.subscribers,
            "nvml_available": self.nvml.available,
            "nvml_error": self.nvml.error,
            "nvml_errors": self.nvml.errors,
            "wandb_mode": self.wandb.mode_used if self.wandb else "disabled",
            "wandb_queue": self.wandb.depth if self.wandb else 0,
            "wandb_dropped": self.wandb.dropped if self.wandb else 0,
            "wandb_errors": self.wandb.errors if self.wandb else 0,
            "jsonl_dropped": self.jsonl.dropped,
            "jsonl_error": self.jsonl.error,
        }


def _sparse(n: int) -> bool:
    """Log the first ten occurrences, then every thousandth."""
    return n <= 10 or n % 1000 == 0
