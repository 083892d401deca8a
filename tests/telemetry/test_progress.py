"""The progress line per drafter (telemetry/progress.py): its text, and real processes: launch.sh with a real
telemetry process and stand-in consumers (tests/procs/progress_consumer.py) prints it; on a terminal one line is
rewritten in place."""

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import write_job
from telemetry.progress import Drafter, clock
from tests.jobs import ROOT, finish, launch
from tests.procs.progress_consumer import LOSS, TAU, TOKENS_PER_STEP

TOTAL = 1000
LINE = re.compile(
    r"(?P<name>d\d): step (?P<step>\d+)/(?P<total>\d+) \((?P<pct>\d+)%\) loss (?P<loss>[\d.]+) τ (?P<tau>[\d.]+)"
    r" (?P<rate>[\d,]+) tok/s ETA (?P<eta>[\d:]+|-)"
)


def test_a_drafter_line_shows_step_loss_tau_rate_and_eta():
    d = Drafter("d_b16", 740)
    src = {"name": "d_b16_r0", "role": "consumer", "state": "live", "phase": None, "step": 100, "loss": 2.31416,
           "tau_est": 3.104, "tokens_per_s": 1500.0}  # fmt: skip
    d.update([src, {**src, "name": "d_b16_r1", "tokens_per_s": 1000.0}], now=0.0)
    assert d.line() == "d_b16: step 100/740 (14%) loss 2.3142 τ 3.10 2,500 tok/s ETA -"
    d.update([{**src, "step": 110, "loss": None}], now=5.0)  # 2 steps/s: 630 steps left → 315 s
    assert d.line() == "d_b16: step 110/740 (15%) loss 2.3142 τ 3.10 1,500 tok/s ETA 5:15"
    d.update([{**src, "state": "live", "phase": "compiling", "step": 110}], now=6.0)
    assert d.line().endswith("ETA 5:15 [compiling]")
    assert Drafter("x", 10).line() == "x: waiting"
    assert d.short() == "d_b16 110/740 loss 2.314 τ 3.10 1.5k tok/s ETA 5:15 [compiling]"
    assert clock(3725) == "1:02:05" and clock(59.6) == "1:00"


def progress_job(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    return write_job(
        tmp_path / "job.toml",
        {
            "job": {"name": f"progress-{os.getpid()}-{tmp_path.name[-6:]}", "run_dir": str(run_dir)},
            "target": {"path": "unused"},
            "data": {"path": "unused"},
            "drafters": [{"name": "d0", "total_steps": TOTAL}, {"name": "d1", "total_steps": TOTAL}],
            "telemetry": {"interval_s": 0.2, "window_s": 0.5, "wandb_mode": "disabled"},
        },
    )


def consumer_cmd(job: Path, name: str, steps: int, per_s: float) -> str:
    return f"{sys.executable} -m tests.procs.progress_consumer {job} {name} {steps} {per_s}"


def check_line(m: re.Match) -> None:
    step, total = int(m["step"]), int(m["total"])
    assert 1 <= step <= 60 and total == TOTAL and int(m["pct"]) == round(100 * step / total)
    assert float(m["loss"]) == LOSS and float(m["tau"]) == TAU
    assert 0 < int(m["rate"].replace(",", "")) <= 20 * TOKENS_PER_STEP * 1.2  # 20 steps/s at most


def test_launch_prints_a_progress_line_per_drafter(tmp_path, monkeypatch):
    """Not a terminal: plain lines, every DFLASH_PROGRESS_EVERY seconds, for each drafter; the ETA comes from the
    step rate (20 steps/s of 1000: under a minute left, never more than 1000/rate)."""
    monkeypatch.setenv("DFLASH_PROGRESS_EVERY", "1")
    job = progress_job(tmp_path)
    logs = tmp_path / "run" / "logs"
    procs = [("telemetry", 0, f"{sys.executable} -m telemetry --job {job}")]
    procs += [(f"consumer-{d}", 1, consumer_cmd(job, f"{d}_r0", 60, 20)) for d in ("d0", "d1")]
    plan = tmp_path / "plan.tsv"
    plan.write_text("".join(f"{n}\t{c}\t{logs / n}.log\t{cmd}\n" for n, c, cmd in procs))
    proc = launch(job, "--grace", "20", plan=plan)
    out = finish(proc, timeout=120)  # returns at EOF: the progress process (which holds the pipe) ended too
    assert proc.returncode == 0, out
    lines = [ln for ln in out.splitlines() if ln.startswith("progress: ")]
    for drafter in ("d0", "d1"):
        found = [m for ln in lines if (m := LINE.search(ln)) and m["name"] == drafter]
        assert found, f"no progress line for {drafter}:\n{out}"
        for m in found:
            check_line(m)
        assert any(eta_fits(m) for m in found), out
        assert re.search(rf"progress: {drafter}: step 60/{TOTAL} .* ETA - \[exited\]", out), out


def eta_fits(m: re.Match) -> bool:
    """The ETA is the steps left at the measured rate: at most 20 steps/s (the stand-in's pace), at least 2."""
    if m["eta"] == "-":
        return False
    minutes, seconds = m["eta"].split(":")
    left = TOTAL - int(m["step"])
    return left / 20 * 0.9 <= 60 * int(minutes) + int(seconds) <= left / 2


def test_on_a_terminal_one_line_is_rewritten_in_place(tmp_path):
    """A carriage return per update, never a cursor movement up (which would overwrite what launch.sh printed
    meanwhile); a part per drafter; the line ended when every drafter has exited, and then it exits 0."""
    job = progress_job(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    procs = [subprocess.Popen([sys.executable, "-m", "telemetry", "--job", str(job)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]  # fmt: skip
    procs += [subprocess.Popen(consumer_cmd(job, f"{d}_r0", 60, 20).split(), cwd=ROOT, env=env) for d in ("d0", "d1")]
    master, slave = pty.openpty()
    progress = subprocess.Popen([sys.executable, "-m", "telemetry.progress", str(job)], cwd=ROOT, env=env,
                                stdout=slave, stderr=subprocess.STDOUT)  # fmt: skip
    os.close(slave)
    text = b""
    try:
        deadline = time.monotonic() + 90
        while progress.poll() is None or select.select([master], [], [], 0)[0]:
            assert time.monotonic() < deadline, text.decode(errors="replace")
            if select.select([master], [], [], 0.2)[0]:
                try:
                    text += os.read(master, 65536)
                except OSError:  # the terminal's other end closed
                    break
    finally:
        for p in [progress, *procs]:
            p.kill() if p.poll() is None else None
            p.wait()
        os.close(master)
    out = text.decode()
    assert progress.returncode == 0, out  # it ended by itself: every drafter exited
    assert re.search(r"\x1b\[\d*[ABF]", out) is None, out  # never up
    updates = [u.removesuffix("\x1b[K") for u in out.split("\r")[1:]]
    assert len(updates) >= 3 and out.endswith("\x1b[K\r\n"), out  # the line ended (the pty writes \n as \r\n)
    parts = [u.split(" | ") for u in updates if u.startswith("d0 ") and " | d1 " in u]
    assert len(parts) >= 2, out
    for d0, d1 in parts:
        for part, name in ((d0, "d0"), (d1, "d1")):
            m = SHORT.fullmatch(part.strip())
            assert m and m["name"] == name, part
            assert 1 <= int(m["step"]) <= 60 and float(m["loss"]) == LOSS and float(m["tau"]) == TAU, part
    assert parts[-1][0].endswith("ETA - [exited]") and parts[-1][1].strip().endswith("ETA - [exited]"), parts[-1]


SHORT = re.compile(
    rf"(?P<name>d\d) (?P<step>\d+)/{TOTAL} loss (?P<loss>[\d.]+) τ (?P<tau>[\d.]+) [\d.]+k tok/s ETA [\d:-]+"
    r"( \[exited\])?"
)
