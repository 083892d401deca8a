"""StatsPublisher over real sockets: never blocks (no subscriber, stalled subscriber), delivers final totals."""

import logging
import select
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import zmq

from common.profile import ProfileStats
from common.stats import StatsPublisher, decode_stats
from tests.conftest import requires_cuda

STALLED_SUBSCRIBER = textwrap.dedent(
    """
    import sys, time, zmq
    sock = zmq.Context().socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 4)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.SUBSCRIBE, b"stats.")
    sock.bind(sys.argv[1])
    while not sock.poll(100):  # until the publisher's first message arrives: it knows our subscription
        pass
    sock.recv_multipart()
    print("stalled", flush=True)
    time.sleep(60)  # never read again
    """
)


@pytest.fixture
def endpoint():
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        yield f"ipc://{d}/in.sock"


def make_publisher(endpoint, interval_s=0.0):
    prof = ProfileStats()
    prof.count("tokens", 1)
    return prof, StatsPublisher(endpoint, "consumer", "d0_r0", interval_s, prof, logger=logging.getLogger("quiet"))


def test_publish_without_subscriber_never_blocks(endpoint):
    prof, pub = make_publisher(endpoint)  # nothing bound at the endpoint at all
    for _ in range(10_000):
        pub.publish()
    assert pub.seq == 10_000
    assert pub.errors == 0
    assert prof.snapshot()["timers"]["stats_publish"]["count"] == 10_000
    pub.close()


def test_publish_to_stalled_subscriber_never_blocks_and_counts_drops(endpoint):
    sub = subprocess.Popen([sys.executable, "-c", STALLED_SUBSCRIBER, endpoint], stdout=subprocess.PIPE, text=True)
    try:
        prof, pub = make_publisher(endpoint)
        prof.gauge("loss", 1.0)
        deadline = time.monotonic() + 30.0
        while not _ready(sub):  # publish until the subscriber has a message, then stalls
            assert time.monotonic() < deadline, "the subscriber never received a message"
            pub.publish()
        for _ in range(10_000):
            pub.publish()
        assert pub.dropped > 0
        assert prof.snapshot()["counters"]["stats_dropped"] == pub.dropped
        pub.close(final=True, linger_ms=100)
    finally:
        sub.kill()
        sub.wait()


def _ready(proc) -> bool:
    r, _, _ = select.select([proc.stdout], [], [], 0.05)
    return bool(r) and proc.stdout.readline().strip() == "stalled"


def test_maybe_publish_respects_interval_and_final_totals_arrive(endpoint):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"stats.")
    sub.bind(endpoint)
    try:
        prof, pub = make_publisher(endpoint, interval_s=3600.0)
        sub.poll(200)  # lets the subscription reach the publisher
        assert pub.maybe_publish(step=1, extra_gauges={"slots_in_use": 2.0}) is True
        assert pub.maybe_publish(step=2) is False  # within the interval: nothing sent
        prof.count("tokens", 41)
        pub.close(final=True)
        got = []
        while sub.poll(2000):
            got.append(decode_stats(sub.recv_multipart()))
            if got[-1].final:
                break
        assert [p.seq for p in got] == [0, 1]
        first, last = got
        assert first.step == 1 and first.gauges["slots_in_use"]["last"] == 2.0
        assert last.final and last.step == 1
        assert last.counters["tokens"] == 42
        assert last.process["rss_bytes"] > 0 and last.cuda_memory == {}
    finally:
        sub.close()


def test_publisher_logs_the_profile_line(endpoint, caplog):
    prof, pub = make_publisher(endpoint)
    prof.add("forward", 0.002)
    with caplog.at_level(logging.INFO, logger="quiet"):
        pub.publish(step=7)
    pub.close(final=False)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "consumer step=7" in line and "forward 1×2.00ms" in line


def test_publisher_rejects_names_outside_the_contract(endpoint):
    with pytest.raises(ValueError, match=r"name 'd0\.r0'"):
        StatsPublisher(endpoint, "consumer", "d0.r0", 1.0, ProfileStats())


@pytest.mark.cuda
@requires_cuda
def test_cuda_allocator_figures_travel_with_the_snapshot(endpoint):
    import torch

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"stats.")
    sub.bind(endpoint)
    try:
        x = torch.empty(1 << 20, device="cuda")  # 4 MiB
        _, pub = make_publisher(endpoint)
        sub.poll(200)
        pub.publish()
        assert sub.poll(5000)
        p = decode_stats(sub.recv_multipart())
        assert p.cuda_memory["allocated_bytes"] >= x.numel() * 4
        assert p.cuda_memory["reserved_bytes"] >= p.cuda_memory["allocated_bytes"]
        assert p.gpu_uuid.startswith("GPU-") and p.cuda_device == torch.cuda.current_device()
        pub.close(final=False)
    finally:
        sub.close()
