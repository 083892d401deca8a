"""Regressions the soak found in the control channel: a stopped consumer waking up, socket files left behind."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from common.channel import ConsumerChannel, PeerLost, ProducerChannel
from common.config import parse_job
from common.protocol import Fail, Heartbeat, Hello, Welcome
from tests.common.test_channel import wait_for

# A consumer channel that prints every event it gets, until a FAIL or a lost producer.
CONSUMER = textwrap.dedent(
    """
    import os, sys, time
    from common.channel import ConsumerChannel, Received
    from common.protocol import Hello
    ch = ConsumerChannel(sys.argv[1], "d0.0", 0.1, 0.6)
    ch.send(Hello("d0", 0, os.getpid(), "", 0))
    print("ready", flush=True)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        ev = ch.recv(0.1)
        if ev is None:
            continue
        name = type(ev.msg).__name__ if isinstance(ev, Received) else "PeerLost"
        print(name, flush=True)
        if name in ("Fail", "PeerLost"):
            break
    ch.close()
    """
)


@pytest.fixture
def endpoint(tmp_path):
    d = tmp_path / "sockets"
    d.mkdir(mode=0o700)
    return f"ipc://{d}/control.sock"


def test_a_consumer_woken_after_being_fenced_is_told_so_and_does_not_lose_the_producer(endpoint):
    """Found by the soak: after SIGCONT the consumer's I/O thread saw 'no message for 5 s' (its own stop) and
    declared the live producer lost, so the consumer exited and launch.sh tore the job down. Now a stall
    restarts the peers' timeouts, and the producer hears the fenced consumer's heartbeat (an unknown peer)
    so it can tell it to re-attach."""
    prod = ProducerChannel(endpoint, 0.1, 0.6)
    proc = subprocess.Popen(
        [sys.executable, "-c", CONSUMER, endpoint],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        hello = wait_for(prod, Hello)
        prod.send(hello.peer, Welcome(1, "cpu", 2, 64, {}, 0.1, 0.6))
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGSTOP)
        assert wait_for(prod, PeerLost, timeout=5.0).peer == b"d0.0"  # fenced while stopped
        prod.forget(hello.peer)
        time.sleep(1.0)  # stopped well past the heartbeat timeout
        os.kill(proc.pid, signal.SIGCONT)
        beat = wait_for(prod, Heartbeat, timeout=5.0)
        assert beat.peer == b"d0.0"  # a heartbeat from a peer the producer no longer follows reaches it
        prod.send(beat.peer, Fail("fenced: unknown session, send HELLO again", fatal=False))
        out = proc.communicate(timeout=30)[0].split()
        assert out == ["Welcome", "Fail"]  # never "PeerLost": the producer was alive all along
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
        prod.close()


def test_heartbeats_of_known_peers_stay_in_the_io_thread(endpoint):
    prod = ProducerChannel(endpoint, 0.05, 1.0)
    cons = ConsumerChannel(endpoint, "d0.0", 0.05, 1.0)
    try:
        cons.send(Hello("d0", 0, os.getpid(), "", 0))
        hello = wait_for(prod, Hello)
        prod.send(hello.peer, Welcome(1, "cpu", 2, 64, {}, 0.05, 1.0))
        wait_for(cons, Welcome)
        time.sleep(0.5)
        assert cons.counters.heartbeats_sent >= 3
        assert prod.recv(0.2) is None  # the consumer's heartbeats were consumed by the I/O thread
    finally:
        cons.close()
        prod.close()


def test_producer_channel_removes_its_socket_file_but_not_a_newer_one(endpoint):
    path = endpoint.removeprefix("ipc://")
    prod = ProducerChannel(endpoint, 0.1, 1.0)
    assert os.path.exists(path)
    prod.close()
    assert not os.path.exists(path)  # libzmq 4.3 leaves it; the soak counted it as a leak
    prod = ProducerChannel(endpoint, 0.1, 1.0)
    os.unlink(path)
    with open(path, "w") as f:  # another process's file at the same path now
        f.write("newer")
    prod.close()
    assert os.path.exists(path)


def test_telemetry_removes_its_socket_files_at_close(tmp_path):
    from telemetry.service import TelemetryService

    job = parse_job(
        {
            "job": {"run_dir": str(tmp_path / "run")},
            "target": {"path": "x"},
            "data": {"path": "y"},
            "drafters": [{"name": "d0"}],
            "telemetry": {"wandb_mode": "disabled"},
        }
    )
    service = TelemetryService(job, logging.getLogger("test"))
    socks = sorted(p.name for p in job.run_paths.sockets.iterdir())
    assert socks == ["telemetry-in.sock", "telemetry-out.sock"]
    service.close()
    assert list(job.run_paths.sockets.iterdir()) == []
