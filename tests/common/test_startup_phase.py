"""A process busy loading or on its first batch stays live in telemetry and shows its phase; it logs it."""

from __future__ import annotations

import logging
import tempfile
import time

import pytest
import zmq

from common.profile import ProfileStats
from common.startup import PHASES, StartupBeat
from common.stats import StatsPublisher, decode_stats
from telemetry import cli
from telemetry.aggregate import Aggregator


@pytest.fixture
def ingest():
    """Telemetry's ingest socket (a SUB bound where publishers connect) and a publisher connected to it."""
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"stats.")
        sub.bind(f"ipc://{d}/in.sock")
        prof = ProfileStats()
        pub = StatsPublisher(f"ipc://{d}/in.sock", "consumer", "d0_r0", 0.1, prof, context=ctx,
                             logger=logging.getLogger("quiet"))  # fmt: skip
        yield sub, pub
        pub.close(final=False)
        sub.close()
        ctx.term()


def received(sub: zmq.Socket, for_s: float) -> list:
    """Every snapshot that arrives within for_s seconds."""
    out, deadline = [], time.monotonic() + for_s
    while (left := deadline - time.monotonic()) > 0:
        if sub.poll(left * 1e3):
            out.append(decode_stats(sub.recv_multipart()))
    return out


def test_a_silent_main_thread_in_a_phase_stays_live_and_shows_the_phase(ingest, caplog):
    sub, pub = ingest
    beat = StartupBeat(pub, logging.getLogger("consumer"), "d0_r0", log_every_s=0.5)
    agg = Aggregator(stale_after_s=0.5)
    with caplog.at_level(logging.INFO, logger="consumer"), beat.phase("loading", "the target"):
        during = received(sub, 1.6)  # the main thread busy elsewhere (a big load) for 3× stale_after_s
        for p in during:
            agg.ingest(p, time.monotonic())
        metrics, summaries = agg.close_window(time.monotonic())
    assert len(during) >= 5 and {p.gauges["phase"]["last"] for p in during} == {PHASES["loading"]}
    assert summaries[0]["state"] == "live" and metrics["consumer/d0_r0/phase"] == PHASES["loading"]
    state = cli.view({"time": time.time(), "sources": summaries, "metrics": metrics})
    assert cli.shown_state(state["processes"][0]) == "loading"
    assert "d0_r0=loading/step -" in cli.plain_line(state)
    logs = [r.getMessage() for r in caplog.records]
    assert logs[0] == "d0_r0: loading (the target)" and "d0_r0: still loading (1 s)" in logs
    assert logs[-1].startswith("d0_r0: loading done in 1.")
    beat.running(step=0)  # after the last phase: one snapshot with phase 0, from the main thread
    (after,) = received(sub, 0.5)
    assert after.gauges["phase"]["last"] == PHASES["running"] and after.step == 0
    again = cli.view({"time": time.time(), "sources": summaries, "metrics": {"consumer/d0_r0/phase": 0.0}})
    assert cli.shown_state(again["processes"][0]) == "live"


def test_without_stats_a_phase_only_logs(caplog):
    beat = StartupBeat(None, logging.getLogger("producer"), "producer", log_every_s=0.2)
    with caplog.at_level(logging.INFO, logger="producer"), beat.phase("compiling"):
        time.sleep(0.5)
    logs = [r.getMessage() for r in caplog.records]
    assert logs[0] == "producer: compiling" and "producer: still compiling (0 s)" in logs
    assert logs[-1].startswith("producer: compiling done in 0.")
