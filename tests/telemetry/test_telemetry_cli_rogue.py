"""dflash-stats against a rogue publisher on the job's republish socket (issue 14 item 9): malformed windows
(wrong types, missing keys, huge values, markup in names) are skipped and counted, never a traceback; live
mode prints plain lines when stdout is a pipe. Real sockets, the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from telemetry.sinks import WINDOW_TOPIC

ROOT = Path(__file__).resolve().parents[2]

MALFORMED = [
    b"\xc1 not msgpack",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"sources": "abc"}),
    msgpack.packb({"sources": [1, 2]}),
    msgpack.packb({"sources": [{"name": 5, "state": "live"}]}),
    msgpack.packb({"sources": [{"name": "x", "step": "ten"}]}),
    msgpack.packb({"sources": [{"name": "x", "step": 1.5}]}),
    msgpack.packb({"time": "yesterday"}),
    msgpack.packb({"gpus": [{"index": [1]}]}),
    msgpack.packb({"metrics": [], "job": "j"}),
    msgpack.packb({"health": {"messages": {"nested": 1}}}),
    msgpack.packb({"ring": {"slots_in_use": "many"}}),
    b"\x81\x91\x01\x01",  # a map whose key is an array (unhashable in Python)
    msgpack.packb({"sources": [{"name": "p"}] * 5000}),
]


def good_window(n: int = 0) -> bytes:
    """A window with extreme but well-typed values: the CLI must show it."""
    return msgpack.packb(
        {
            "time": time.time(),
            "uptime_s": 1e308,
            "window_s": 1.0,
            "job": "rogue[/bold]job",
            "run_dir": "x" * 10_000,
            "metrics": {"pipeline/tokens_per_s": float("inf")},
            "sources": [
                {
                    "source": "consumer.d0_r0",
                    "role": "consumer",
                    "name": "[red]d0_r0",
                    "state": "live",
                    "step": 2**63 - 1 + 0 * n,
                    "pid": 2**64 - 1,
                    "tokens_per_s": 1e300,
                    "wait_pct": float("nan"),
                    "busy_pct": -0.0,
                    "age_s": 0.5,
                    "gaps": 3.0,
                    "restarts": 0,
                    "extra": {"ignored": [1]},
                }
            ],
            "gpus": [
                {
                    "index": 0.0,
                    "uuid": "GPU-1",
                    "name": "H200",
                    "util_pct": 99,
                    "memory_used_bytes": 2.0**40,
                    "memory_total_bytes": 2**41,
                }
            ],
            "ring": {"slots_in_use": 3, "slots_total": 4},
            "health": {
                "messages": 1.5e3,
                "gaps": 0,
                "decode_errors": 2**60,
                "wandb_mode": "offline",
                "wandb_queue": 0,
                "nvml_available": False,
                "nvml_error": None,
            },
        }
    )


@pytest.fixture
def rogue():
    """An XPUB bound where telemetry's republish socket would be, in a run folder with no telemetry."""
    run = Path(tempfile.mkdtemp(prefix="dfr-", dir="/tmp"))  # ipc paths must stay short
    (run / "sockets").mkdir(mode=0o700)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc://{run}/sockets/telemetry-out.sock")
    yield run, sock
    sock.close()
    ctx.term()
    shutil.rmtree(run, ignore_errors=True)


def start_cli(run: Path, *args: str) -> subprocess.Popen:
    """The CLI as a script's background job starts it: SIGINT ignored on entry (it must still stop on one)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    return subprocess.Popen(
        [sys.executable, "-m", "telemetry.cli", str(run), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )


def wait_subscribed(sock: zmq.Socket) -> None:
    assert sock.poll(60_000), "the CLI never subscribed"
    assert sock.recv() == b"\x01" + WINDOW_TOPIC


@pytest.mark.parametrize("mode", ["--json", "--once"])
def test_malformed_windows_are_skipped_and_counted(rogue, mode):
    run, sock = rogue
    cli = start_cli(run, mode, "--timeout", "60")
    wait_subscribed(sock)
    for payload in MALFORMED:
        sock.send_multipart([WINDOW_TOPIC, payload])
    sock.send_multipart([WINDOW_TOPIC])  # one frame: the topic alone
    sock.send_multipart([WINDOW_TOPIC, good_window()])
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err
    assert "Traceback" not in err
    assert f"skipped {len(MALFORMED) + 1} malformed window(s)" in err
    if mode == "--json":
        state = json.loads(out)
        assert state["malformed_windows"] == len(MALFORMED) + 1
        proc = state["processes"][0]
        assert proc["name"] == "[red]d0_r0" and proc["step"] == 2**63 - 1 and proc["pid"] == 2**64 - 1
        assert proc["wait_pct"] is None and proc["gaps"] == 3 and proc["tokens_per_s"] == 1e300
        assert state["pipeline"]["tokens_per_s"] is None and len(state["run_dir"]) == 200
        assert state["gpus"][0]["index"] == 0 and state["gpus"][0]["memory_used_bytes"] == 2**40
    else:
        assert "[red]d0_r0" in out and "rogue[/bold]job" in out  # shown as text, not taken as markup
        assert "skipped 15 malformed window(s)" in out


def test_only_malformed_windows_is_nothing_published(rogue):
    run, sock = rogue
    cli = start_cli(run, "--json", "--timeout", "3")
    wait_subscribed(sock)
    for payload in MALFORMED[:3]:
        sock.send_multipart([WINDOW_TOPIC, payload])
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 1 and out == ""
    assert "skipped 3 malformed window(s)" in err and "nothing published" in err and "Traceback" not in err


def test_live_mode_prints_plain_lines_to_a_pipe(rogue):
    run, sock = rogue
    cli = start_cli(run, "--timeout", "30")
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(li) for li in cli.stdout], daemon=True).start()
    try:
        wait_subscribed(sock)
        got = []
        deadline = time.monotonic() + 60
        while len(got) < 3:
            assert time.monotonic() < deadline, f"only {got} within 60 s"
            sock.send_multipart([WINDOW_TOPIC, MALFORMED[len(got) % len(MALFORMED)]])
            sock.send_multipart([WINDOW_TOPIC, good_window(len(got))])
            try:
                got.append(lines.get(timeout=1.0))
            except queue.Empty:
                pass
        for line in got:
            assert "job rogue[/bold]job: [red]d0_r0=live/step 9223372036854775807/" in line
            assert "3.0/4 slots in use" in line and "malformed window(s)" in line
            assert "\x1b[" not in line  # no terminal control sequences in a pipe
    finally:
        cli.send_signal(signal.SIGINT)
        _, err = cli.communicate(timeout=30)
    assert cli.returncode == 0, err
    assert "Traceback" not in err
