"""Who may talk to a job: private socket folders, CURVE on tcp, and the config that asks for it."""

import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import zmq
import zmq.auth

from bench.harness import write_job
from common.channel import ConsumerChannel, ProducerChannel
from common.config import ConfigError, is_loopback, load_job, parse_job
from common.protocol import Hello, Welcome, encode
from common.run_paths import RunPaths
from common.security import (
    InsecureEndpoint,
    check_private_dir,
    client_curve,
    ensure_curve_keys,
    private_dir,
    server_curve,
)
from tests.common.test_channel import wait_for

ROOT = Path(__file__).resolve().parents[2]


def job_doc(**transport):
    return {"target": {"path": "x"}, "data": {"path": "y"}, "drafters": [{"name": "d0"}], "transport": transport}


# ---------------------------------------------------------------------------------------------- folders
def test_private_dir_accepts_0700_and_creates_missing(tmp_path):
    made = private_dir(tmp_path / "run" / "sockets")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o701])
def test_open_socket_folder_is_refused(tmp_path, mode):
    d = tmp_path / "sockets"
    d.mkdir()
    d.chmod(mode)
    with pytest.raises(InsecureEndpoint, match=f"mode {mode:04o}.*chmod 700"):
        check_private_dir(d)


def test_symlinked_socket_folder_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "sockets").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(InsecureEndpoint, match="must be a folder, not a symlink"):
        check_private_dir(tmp_path / "sockets")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_socket_folder_of_another_user_is_refused(tmp_path):
    d = tmp_path / "sockets"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(InsecureEndpoint, match="belongs to uid 65534"):
        check_private_dir(d)


# ---------------------------------------------------------------------------------------------- config
def test_tcp_outside_loopback_turns_curve_on_by_default():
    assert not parse_job(job_doc()).transport.use_curve  # ipc
    assert not parse_job(job_doc(endpoint="tcp")).transport.use_curve  # 127.0.0.1
    assert parse_job(job_doc(endpoint="tcp", tcp_host="0.0.0.0")).transport.use_curve
    assert parse_job(job_doc(endpoint="tcp", tcp_host="10.1.2.3", curve=True)).transport.use_curve
    assert parse_job(job_doc(endpoint="tcp", curve=True)).transport.use_curve  # loopback may opt in


def test_curve_off_outside_loopback_is_a_config_error():
    with pytest.raises(ConfigError, match=r"transport: curve = false with tcp_host '0\.0\.0\.0'.*requires CURVE"):
        parse_job(job_doc(endpoint="tcp", tcp_host="0.0.0.0", curve=False))
    with pytest.raises(ConfigError, match="transport: curve = true needs endpoint = 'tcp'"):
        parse_job(job_doc(curve=True))
    assert parse_job(job_doc(endpoint="tcp", tcp_host="127.0.0.1", curve=False))  # loopback without: fine


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.0.1", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("*", False),
        ("10.0.0.5", False),
        ("myhost", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


# ---------------------------------------------------------------------------------------------- keys
def test_keys_are_private_and_created_once(tmp_path):
    paths = RunPaths(tmp_path)
    root = ensure_curve_keys(paths)
    first = server_curve(paths)
    for f in [*root.glob("*.key*"), *(root / "clients").glob("*.key*")]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    for d in (root, root / "clients"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert server_curve(paths) == first  # not regenerated
    client = client_curve(paths)
    assert client.server_public == first.public and client.public != first.public


def test_a_readable_secret_key_is_refused(tmp_path):
    paths = RunPaths(tmp_path)
    root = ensure_curve_keys(paths)
    (root / "server.key_secret").chmod(0o644)
    with pytest.raises(InsecureEndpoint, match="mode 0600"):
        server_curve(paths)


def test_consumer_without_keys_gets_a_clear_error(tmp_path):
    with pytest.raises(InsecureEndpoint, match=r"cannot load this job's CURVE keys.*python -m common.security keys"):
        client_curve(RunPaths(tmp_path))


# ---------------------------------------------------------------------------------------------- CURVE on the wire
def test_only_the_jobs_client_key_gets_in(tmp_path):
    paths = RunPaths(tmp_path)
    prod = ProducerChannel("tcp://127.0.0.1:*", 0.1, 2.0, curve=server_curve(paths))
    ctx = zmq.Context()
    strangers = []
    try:
        plain = ctx.socket(zmq.DEALER)  # no CURVE at all
        rogue = ctx.socket(zmq.DEALER)  # CURVE with its own key, which the job does not list
        pub, sec = zmq.curve_keypair()
        rogue.curve_publickey, rogue.curve_secretkey = pub, sec
        rogue.curve_serverkey = server_curve(paths).public
        for s in (plain, rogue):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(prod.endpoint)
            s.send(encode(Hello("d0", 0, 1, "", 0)))
            strangers.append(s)
        time.sleep(1.0)
        assert prod.recv(0.5) is None
        assert prod.counters.received == 0 and prod.counters.decode_errors == 0
        member = ConsumerChannel(prod.endpoint, "d0.0", 0.1, 2.0, curve=client_curve(paths))
        try:
            member.send(Hello("d0", 0, os.getpid(), "", 0))
            hello = wait_for(prod, Hello)
            assert hello.peer == b"d0.0"
            prod.send(hello.peer, Welcome(1, "cpu", 2, 64, {}, 0.1, 2.0))
            assert wait_for(member, Welcome).msg.epoch == 1
        finally:
            member.close()
        assert all(not s.poll(200) for s in strangers)  # the strangers got nothing, not even heartbeats
        assert prod.counters.received >= 1 and all(isinstance(x, zmq.Socket) for x in strangers)
    finally:
        for s in strangers:
            s.close(0)
        ctx.term()
        prod.close()


@pytest.mark.slow
def test_a_tcp_job_outside_loopback_runs_with_curve_end_to_end():
    """The producer creates the keys, binds 0.0.0.0 with CURVE; the consumer loads its keys and gets batches."""
    from consumer.stream import BatchStream, ReceivedBatch

    run_dir = Path(tempfile.mkdtemp(prefix="dfs-", dir="/tmp"))
    job_path = write_job(
        run_dir / "job.toml",
        {
            "job": {"name": f"curve-{run_dir.name[4:]}", "run_dir": str(run_dir)},
            "target": {"path": "unused"},
            "data": {"path": "unused", "max_length": 64, "tokens_per_batch": 64},
            "transport": {
                "endpoint": "tcp",
                "tcp_host": "0.0.0.0",
                "heartbeat_interval_s": 0.1,
                "heartbeat_timeout_s": 2.0,
                "attach_timeout_s": 60,
            },
            "drafters": [{"name": "d0"}],
        },
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.procs.transport_pair", "producer", str(job_path), "3", str(run_dir / "out.json")],
        cwd=ROOT,
        env=env,
    )
    try:
        job = load_job(job_path)
        stream = BatchStream(job, "d0", 0, torch.device("cpu"), lambda: 0)  # waits for the endpoint file
        try:
            stream.connect()
            got = [stream.next(timeout_s=30) for _ in range(3)]
            assert [b.seq for b in got if isinstance(b, ReceivedBatch)] == [0, 1, 2]
            stream.bye("done", 2)
        finally:
            stream.close()
        assert proc.wait(timeout=60) == 0
        assert (run_dir / "sockets" / "control.endpoint").read_text().startswith("tcp://0.0.0.0:")
        secret = run_dir / "keys" / "server.key_secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    finally:
        proc.kill()
        subprocess.run(["rm", "-rf", str(run_dir)], check=False)
