"""The troubleshooting table (docs/troubleshooting.md) quotes the code: each message is provoked here and matched against
the table's text (`…` = the parts that vary), or, where provoking costs a whole job, found in the source."""

from __future__ import annotations

import fcntl
import os
import re
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from common import joblock
from common.channel import _lock_ipc_endpoint
from common.config import ConfigError, load_job
from common.ring import RingError, SlotRing
from common.run_paths import RunPaths
from telemetry import cli
from telemetry.service import REPUBLISH_SOCKET
from telemetry.sinks import WINDOW_TOPIC

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [*ROOT.glob("common/*.py"), *ROOT.glob("producer/*.py"), *ROOT.glob("consumer/*.py"),
           *ROOT.glob("telemetry/*.py"), ROOT / "launch.sh"]  # fmt: skip


def table_messages() -> list[str]:
    table = (ROOT / "docs" / "troubleshooting.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| message")]
    return [m for row in rows for m in re.findall(r"`([^`]+)`", row.split(" | ")[0])]


def pattern(message: str) -> re.Pattern:
    return re.compile(".*?".join(re.escape(part) for part in message.split("…")), re.S)


def job_file(tmp_path: Path, run_dir: Path, transport: str = "") -> Path:
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text('{"hidden_size": 64}')
    path = tmp_path / "job.toml"
    path.write_text(f'[job]\nrun_dir = "{run_dir}"\n[target]\npath = "{target}"\nlayer_ids = [1, 2]\n'
                    f'[data]\npath = "{tmp_path / "train.jsonl"}"\n[transport]\n{transport}\n'
                    '[[drafters]]\nname = "d0"\n')  # fmt: skip
    return path


def config_error(path: Path) -> str:
    with pytest.raises(ConfigError) as err:
        load_job(path)
    return str(err.value)


def slot_bytes_too_small(tmp_path: Path, capsys) -> str:
    return config_error(job_file(tmp_path, tmp_path / "run", "slot_bytes = 4096"))


def run_dir_too_deep(tmp_path: Path, capsys) -> str:
    return config_error(job_file(tmp_path, tmp_path / ("r" * 120)))


def shm_too_small(tmp_path: Path, capsys) -> str:
    with pytest.raises(RingError) as err:
        SlotRing.create("cpu", 2, 1 << 50, name=f"tshoot-{tmp_path.name}")
    return str(err.value)


def job_in_use(tmp_path: Path, capsys, monkeypatch) -> str:
    """launch.sh's lock as launch.sh takes it (flock -n on the job lock, its pid line written)."""
    monkeypatch.delenv(joblock.LAUNCH_ENV, raising=False)
    lock = joblock.job_lock_path(tmp_path, 0)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a+") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write_text("pid=4242 start=2026-12-01T10:00:00+0000 launch=abcd\n")
        with pytest.raises(joblock.JobLocked) as err:
            joblock.enter(tmp_path, "producer")
    return str(err.value)


def second_producer(tmp_path: Path, capsys) -> str:
    endpoint = f"ipc://{tmp_path}/control.sock"
    first = _lock_ipc_endpoint(endpoint)
    try:
        with pytest.raises(RuntimeError) as err:
            _lock_ipc_endpoint(endpoint)
    finally:
        os.close(first)
    return str(err.value)


def cli_stderr(args: list[str], capsys, status: int) -> str:
    capsys.readouterr()
    assert cli.main(args) == status
    return capsys.readouterr().err


def no_telemetry_socket(tmp_path: Path, capsys) -> str:
    return cli_stderr([str(tmp_path)], capsys, 2)


def republisher(tmp_path: Path) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    paths = RunPaths(tmp_path)
    paths.sockets.mkdir(parents=True, exist_ok=True)
    sock.bind(paths.ipc(REPUBLISH_SOCKET))
    return ctx, sock


def nothing_published(tmp_path: Path, capsys) -> str:
    ctx, sock = republisher(tmp_path)
    try:
        return cli_stderr([str(tmp_path), "--once", "--timeout", "0.3"], capsys, 1)
    finally:
        sock.close()
        ctx.term()


def no_process_publishing(tmp_path: Path, capsys) -> str:
    ctx, sock = republisher(tmp_path)
    done = threading.Event()

    def publish():  # telemetry's window with no process in it, until the CLI has read one
        while not done.is_set():
            sock.send_multipart([WINDOW_TOPIC, msgpack.packb({"job": "t", "time": time.time(), "sources": []})])
            time.sleep(0.05)

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        return cli_stderr([str(tmp_path), "--once", "--timeout", "10"], capsys, 1)
    finally:
        done.set()
        thread.join(5)
        sock.close()
        ctx.term()


PROVOKED = {
    "transport.slot_bytes": slot_bytes_too_small,
    "/dev/shm has": shm_too_small,
    "is in use by launch.sh pid": job_in_use,
    "another producer (pid": second_producer,
    "job.run_dir: socket paths": run_dir_too_deep,
    "no telemetry socket": no_telemetry_socket,
    "nothing published on": nothing_published,
    "no process is publishing": no_process_publishing,
}
IN_SOURCE = (
    "a running launch of this job",
    "the producer was lost",
    "optimizer steps in a row",
    # provoked through real processes by their own tests (test_launch_supervision, test_telemetry_flood,
    # test_plan_identity_e2e): here only checked against the source
    "cannot write the run folder",
    "that held",
    "telemetry keeps at most",
    "changed since its last start",
    "was trained with",
)


def kind(message: str) -> str:
    keys = [k for k in (*PROVOKED, *IN_SOURCE) if k in message]
    assert len(keys) == 1, f"troubleshooting message {message!r}: no test covers it (or several do)"
    return keys[0]


def test_every_message_is_covered_and_each_test_has_its_message():
    covered = [kind(m) for m in table_messages()]
    assert sorted(covered) == sorted([*PROVOKED, *IN_SOURCE])


@pytest.mark.parametrize("key", list(PROVOKED))
def test_the_code_prints_the_tables_message(key, tmp_path, capsys, monkeypatch):
    (message,) = [m for m in table_messages() if kind(m) == key]
    provoke = PROVOKED[key]
    printed = provoke(tmp_path, capsys, monkeypatch) if key == "is in use by launch.sh pid" else \
        provoke(tmp_path, capsys)  # fmt: skip
    assert pattern(message).search(printed), f"docs/troubleshooting.md says {message!r}; the code printed {printed!r}"


@pytest.mark.parametrize("key", IN_SOURCE)
def test_a_message_too_costly_to_provoke_is_in_the_source(key):
    (message,) = [m for m in table_messages() if kind(m) == key]
    source = "\n".join(p.read_text() for p in SOURCES)
    for part in (p.strip() for p in message.split("…")):
        if len(part) > 3:
            assert part in source, f"docs/troubleshooting.md quotes {part!r} ({message!r}); no source file prints it"
