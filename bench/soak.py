"""Fault-injection soak: a small job on the CPU under a seeded chaos thread, then an exactly-once audit.

    .venv/bin/python -m bench.soak --duration 600 --seed 1 --json

The processes are driven directly, as systemd runs them (deploy/systemd): a consumer that exits non-zero
is restarted after RESTART_S (Restart=on-failure), telemetry always; launch.sh would instead tear the job
down when a consumer dies. Faults, one at a time, each followed by a wait for recovery:
  consumer_kill      SIGKILL a random consumer; it is restarted and resumes from its checkpoint
  consumer_stop      SIGSTOP a consumer for 2× the heartbeat timeout, then SIGCONT: the producer fences it,
                     it must drop what it was sent and re-attach, never training on a slot reused meanwhile
  telemetry_kill     SIGKILL telemetry; it is restarted, training never notices
  hostile_control    malformed, oversized and stale messages to the producer's control socket
  hostile_telemetry  malformed and oversized messages to telemetry's ingest socket
  checkpoint_enospc  the drafter d1's checkpoint folder is a tmpfs; fill it so the next save fails with a
                     real ENOSPC, check the previous checkpoint still loads, free it; the consumer restarts
  producer_kill      SIGKILL the producer; it is restarted (Restart=on-failure), the consumers checkpoint,
                     exit, are restarted and resume: every group is served again, nothing lost or repeated
  second_launch      `./launch.sh JOB.toml` while the job runs: refused at once (exit 75) naming a holder's
                     pid; no process of the running job is touched and training goes on
  startup_sigterm    SIGKILL a consumer, then SIGTERM its restarted incarnation during its start-up: it ends
                     within seconds (exit 0, or killed by the signal before its handler exists), comes back
  checkpoint_corrupt SIGKILL consumer d0, then damage its newest checkpoint (truncate trainer_state.pt, or
                     NaN into model.safetensors); the restart must say so and resume from the previous one
  data_changed       SIGKILL the producer and change the data file (a record appended, or the lines
                     shuffled): its restarts must refuse the changed plan (exit 2, naming the data) and train
                     nothing; then the file is restored and the next restart resumes, nothing lost or repeated
  launch_kill        hand the job to launch.sh (every service stopped), SIGKILL launch.sh once both drafters
                     train: every process must stop by itself within LAUNCH_ORPHAN_S, the consumers checkpoint;
                     the same command again must start (not 75) and train; SIGTERM it, audit, start the services
  stats_flood        flood telemetry's stats socket for FLOOD_S (valid messages, most under new names): telemetry
                     lives, keeps at most MAX_SOURCES, training goes on; recovered when a window holds only the
                     job's own sources again, all live
Recovery time: from the fault's effect (kill, SIGCONT, the failed save's exit, the last hostile message)
to the affected process being back in service (the producer attached the consumer again; telemetry wrote a
window with every source live; the producer delivered again). A recovered consumer must also train a step:
`max_training_resumed_s` reports that, which includes waiting while a group that fell behind catches up.
At the end every process is stopped with SIGTERM and the job log is audited (common/accounting_check.py).
The last stdout line (with --json) is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from bench.soak_faults import (
    fill,
    hostile_control,
    hostile_telemetry,
    mount_tmpfs,
    stats_flood,
    unfill,
    unmount,
)
from bench.soak_procs import ROOT, JobWatch, Supervisor, build_job
from common.accounting_check import check_run
from common.checkpoint_pointer import read_pointer
from common.config import load_job
from common.ring_file import RING_FILE_PREFIX
from telemetry.aggregate import MAX_SOURCES

KINDS = (
    "consumer_kill",
    "consumer_stop",
    "telemetry_kill",
    "hostile_control",
    "hostile_telemetry",
    "checkpoint_enospc",
    "producer_kill",
    "second_launch",
    "startup_sigterm",
    "checkpoint_corrupt",
    "data_changed",
    "launch_kill",
    "stats_flood",
)
RECOVERY_TIMEOUT_S = 180.0
ENOSPC_DRAFTER = "d1"
CORRUPT_DRAFTER = "d0"  # not the tmpfs one
STARTUP_EXIT_S = 15.0  # a SIGTERM during start-up must end the process within this (it waited 60 s before)
HOSTILE_HELLOS = 4  # in bench.soak_faults.control_garbage: unknown drafter, replica 2**64-1, node 5, another launch
SECOND_LAUNCH_EXIT = 75  # launch.sh's status for "the job is already running"
PLAN_REFUSED = "changed since its last start"  # producer/fingerprint.py's refusal
LAUNCH_ORPHAN_S = 60.0  # the processes of a SIGKILLed launch.sh must all have stopped within this
FLOOD_S = 3.0


class Chaos:
    def __init__(
        self,
        sup: Supervisor,
        watch: JobWatch,
        rng: random.Random,
        kinds: tuple[str, ...],
        stop_s: float,
        log,
        pause_s: float = 2.0,
    ):
        self.sup, self.watch, self.rng, self.kinds, self.stop_s, self.log = sup, watch, rng, kinds, stop_s, log
        self.pause_s = pause_s  # the mean of the calm before each fault (every fault waits for its own precondition)
        self.faults: dict[str, int] = defaultdict(int)
        self.recoveries: dict[str, int] = defaultdict(int)
        self.recovery_s: dict[str, list[float]] = defaultdict(list)
        self.failures: list[str] = []
        self.notes: dict[str, int] = defaultdict(int)
        self.training_resumed_s: list[float] = []  # consumer faults: until the next step (other groups may lag)

    def run(self, until: float, min_each: int, stop: threading.Event) -> None:
        order: list[str] = []
        while not stop.is_set():
            done_min = all(self.faults[k] >= min_each for k in self.kinds)
            if time.monotonic() >= until and done_min:
                return
            if not order:
                order = list(self.kinds)
                self.rng.shuffle(order)
            kind = order.pop()
            stop.wait(self.rng.uniform(0.5 * self.pause_s, 1.5 * self.pause_s))
            self.faults[kind] += 1
            self.log(f"fault {sum(self.faults.values())}: {kind}")
            try:
                took = getattr(self, kind)()
            except Exception as err:  # a failed injection is a finding, not a crash of the soak
                self.failures.append(f"{kind}: {type(err).__name__}: {err}")
                self.log(f"  FAILED: {err}")
                continue
            self.recoveries[kind] += 1
            self.recovery_s[kind].append(took)
            self.log(f"  recovered in {took:.1f} s")

    # ---------------------------------------------------------------------------------- faults
    def _back(self, name: str, since: float, pid: int | None = None, not_pid: int | None = None) -> float:
        """Seconds from `since` until the producer attached `name` again; then it must train a step too."""
        attached = self.watch.wait_attached(name, after=since, pid=pid, not_pid=not_pid, timeout=RECOVERY_TIMEOUT_S)
        trained = self.watch.wait_step(name, after=attached, not_pid=not_pid, timeout=RECOVERY_TIMEOUT_S)
        self.training_resumed_s.append(trained - since)
        return attached - since

    def consumer_kill(self) -> float:
        name = self.rng.choice(self.sup.consumers)
        pid = self.sup.procs[name].pid
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        return self._back(name, t0, not_pid=pid)

    def consumer_stop(self) -> float:
        name = self.rng.choice(self.sup.consumers)
        proc = self.sup.procs[name]
        fence_line = f"fenced {name.removeprefix('consumer-')}.r0"
        fenced, reattached = self.watch.count("producer", fence_line), self.watch.count(name, "re-attaching")
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(self.stop_s + self.rng.uniform(0, 1))
        t1 = time.time()
        os.kill(proc.pid, signal.SIGCONT)
        took = self._back(name, t1, pid=proc.pid)
        if self.watch.count("producer", fence_line) <= fenced:
            raise AssertionError(f"{name} was stopped {self.stop_s:.0f} s but the producer did not fence it")
        if self.watch.count(name, "re-attaching") > reattached:
            self.notes["stopped_consumer_reattached"] += 1
        return took

    def telemetry_kill(self) -> float:
        pid = self.sup.procs["telemetry"].pid
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        return self.watch.wait_window(after=t0, sources=1 + len(self.sup.consumers), timeout=RECOVERY_TIMEOUT_S) - t0

    def hostile_control(self) -> float:
        before = self.watch.count("producer", "rejected a message")
        hellos = self.watch.count("producer", "rejected HELLO from")
        self.notes["control_messages_sent"] += hostile_control(self.watch.control_endpoint())
        t0 = time.time()
        took = max(self.watch.wait_delivery(after=t0, timeout=RECOVERY_TIMEOUT_S) - t0, 0.0)
        if not self.sup.procs["producer"].alive():
            raise AssertionError("the producer died of hostile messages")
        self.notes["control_messages_rejected"] += self.watch.count("producer", "rejected a message") - before
        refused = self.watch.count("producer", "rejected HELLO from") - hellos
        if refused < HOSTILE_HELLOS:
            raise AssertionError(f"the producer refused {refused} of {HOSTILE_HELLOS} HELLOs that do not fit the job")
        self.notes["hellos_rejected"] += refused
        return took

    def hostile_telemetry(self) -> float:
        telemetry = self.sup.procs["telemetry"]
        pid, before = telemetry.pid, self.watch.telemetry_decode_errors()
        self.notes["stats_messages_sent"] += hostile_telemetry(self.watch.ingest_endpoint())
        t0 = time.time()
        took = self.watch.wait_window(after=t0, sources=1, timeout=RECOVERY_TIMEOUT_S) - t0
        if telemetry.pid != pid or any(p == pid for _t, p, _status in telemetry.exits):
            raise AssertionError(f"telemetry (pid {pid}) died of hostile messages")
        self.notes["stats_messages_rejected"] += self.watch.telemetry_decode_errors() - before
        return max(took, 0.0)

    def checkpoint_enospc(self) -> float:
        name = f"consumer-{ENOSPC_DRAFTER}"
        folder = self.watch.ckpt_dir(ENOSPC_DRAFTER)
        before = self.watch.latest_checkpoint(ENOSPC_DRAFTER)
        proc = self.sup.procs[name]
        pid = proc.pid
        fill(folder, leave_bytes=16 * 1024)
        try:
            exited = proc.wait_exit(pid, timeout=RECOVERY_TIMEOUT_S)  # the next periodic save fails
        finally:
            unfill(folder)
        t_fail = exited
        if "No space left on device" not in self.watch.tail(name, 60):
            raise AssertionError(f"{name} exited, but its log does not name ENOSPC")
        after = self.watch.latest_checkpoint(ENOSPC_DRAFTER)
        if before is not None and (after is None or after[1] < before[1]):
            raise AssertionError(f"the checkpoint before the full disk ({before}) is gone: now {after}")
        self.notes["enospc_previous_checkpoint_intact"] += 1
        return self._back(name, t_fail, not_pid=pid)

    def producer_kill(self) -> float:
        prod = self.sup.procs["producer"]
        pid = prod.pid
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        prod.wait_exit(pid, timeout=RECOVERY_TIMEOUT_S)
        delivered = self.watch.wait_delivery(after=t0, timeout=RECOVERY_TIMEOUT_S)  # the new producer delivers
        back = [self._back(name, t0) for name in self.sup.consumers]  # every group attached again and trains
        return max(delivered - t0, *back)

    def second_launch(self) -> float:
        before = {n: p.pid for n, p in self.sup.procs.items()}
        env = {**os.environ, "PYTHON": sys.executable}
        env.pop("DFLASH_LAUNCH_ID", None)
        t0 = time.monotonic()
        out = subprocess.run(
            [str(ROOT / "launch.sh"), str(self.sup.job_path), "--grace", "5"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=RECOVERY_TIMEOUT_S,
        )
        took = time.monotonic() - t0
        said = out.stdout + out.stderr
        if out.returncode != SECOND_LAUNCH_EXIT or "launch.sh: started" in said:
            raise AssertionError(f"the second launch was not refused (status {out.returncode}): {said[-500:]}")
        if not any(f" pid {pid} " in said for pid in before.values()):
            raise AssertionError(f"the refusal names no process of the running job: {said[-500:]}")
        self.notes["second_launch_refused_max_s"] = max(
            self.notes.get("second_launch_refused_max_s", 0), round(took, 2)
        )
        harmed = [n for n, pid in before.items() if self.sup.procs[n].pid != pid or not self.sup.procs[n].alive()]
        if harmed:
            raise AssertionError(f"the second launch harmed the running job: {harmed} restarted or gone")
        t1 = time.time()
        for name in self.sup.consumers:  # and the running job trains on
            self.watch.wait_step(name, after=t1, timeout=RECOVERY_TIMEOUT_S)
        return took

    def startup_sigterm(self) -> float:
        name = self.rng.choice(self.sup.consumers)
        proc = self.sup.procs[name]
        old = proc.pid
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while proc.pid == old or not proc.alive():  # the supervisor restarts it
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} was not restarted")
            time.sleep(0.05)
        new = proc.pid
        time.sleep(self.rng.uniform(0.2, 2.0))  # somewhere in its start-up: imports, loading, waiting for WELCOME
        try:
            self.watch.wait_attached(name, after=0.0, pid=new, timeout=0.3)
            self.notes["startup_sigterm_after_attach"] += 1  # the machine was fast: it had attached already
        except TimeoutError:
            self.notes["startup_sigterm_during_start_up"] += 1
        t1 = time.time()
        os.kill(new, signal.SIGTERM)
        exited = proc.wait_exit(new, timeout=RECOVERY_TIMEOUT_S)
        status = next(st for _t, p, st in proc.exits if p == new)
        if status not in (0, -signal.SIGTERM) or exited - t1 > STARTUP_EXIT_S:
            raise AssertionError(f"{name} (pid {new}) took {exited - t1:.1f} s to end after SIGTERM, status {status}")
        self.notes["startup_sigterm_exit_max_s"] = max(
            self.notes.get("startup_sigterm_exit_max_s", 0), round(exited - t1, 2)
        )
        if status == 0:
            self.sup.start_again(name)  # a clean exit is not restarted by Restart=on-failure
        return self._back(name, t1, not_pid=new)

    def checkpoint_corrupt(self) -> float:
        name = f"consumer-{CORRUPT_DRAFTER}"
        folder = self.watch.ckpt_dir(CORRUPT_DRAFTER)
        self.watch._wait(
            lambda: time.time() if len(list(folder.glob("step_*"))) >= 2 else None,
            RECOVERY_TIMEOUT_S,
            f"two checkpoints of {CORRUPT_DRAFTER}",
        )
        proc = self.sup.procs[name]
        pid = proc.pid
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        proc.wait_exit(pid, timeout=RECOVERY_TIMEOUT_S)
        newest = folder / read_pointer(folder)
        how = corrupt_checkpoint(newest, self.rng)
        self.notes["checkpoint_corrupt_" + ("truncated" if how.startswith("truncated") else "nan")] += 1
        took = self._back(name, t0, not_pid=pid)
        if "resuming from the previous intact checkpoint" not in self.watch.tail(name, 200):
            raise AssertionError(f"{name} resumed, but its log does not say it fell back past {newest.name}")
        return took

    def data_changed(self) -> float:
        prod, data = self.sup.procs["producer"], Path(self.sup.job.data.path)
        original, refused = data.read_bytes(), self.watch.count("producer", PLAN_REFUSED)
        batches = self.watch.count_deliveries()
        pid = prod.pid
        os.kill(pid, signal.SIGKILL)  # first: the running producer re-reads records by position
        prod.wait_exit(pid, timeout=RECOVERY_TIMEOUT_S)
        seen = len(prod.exits)  # the exits from here on are the restarts'
        how = self.rng.choice(("appended", "shuffled"))
        lines = original.decode().splitlines(keepends=True)
        changed = lines + lines[:1] if how == "appended" else self.rng.sample(lines, len(lines))
        replace_file(data, "".join(changed).encode())
        try:

            def refused_and_exited() -> float | None:
                said = self.watch.count("producer", PLAN_REFUSED) > refused
                return time.time() if said and len(prod.exits) > seen else None

            self.watch._wait(
                refused_and_exited, RECOVERY_TIMEOUT_S, "the restarted producer to refuse the changed data"
            )
            exits = [st for _t, _p, st in prod.exits[seen : seen + 1]]
            if exits != [2] or self.watch.count_deliveries() != batches:
                raise AssertionError(
                    f"the changed plan ({how}) was not refused before training: exit {exits},"
                    f" {self.watch.count_deliveries() - batches} batches delivered"
                )
        finally:
            replace_file(data, original)  # the same bytes again (a new mtime): the same plan
        self.notes[f"data_changed_{how}_refused"] += 1
        t0 = time.time()
        delivered = self.watch.wait_delivery(after=t0, timeout=RECOVERY_TIMEOUT_S)
        back = [self._back(name, t0) for name in self.sup.consumers]
        return max(delivered - t0, *back)

    def launch_kill(self) -> float:
        codes = self.sup.pause()
        if any(codes.values()):
            raise AssertionError(f"the services did not stop cleanly before the hand-over: {codes}")
        env = {**os.environ, "PYTHON": sys.executable}
        env.pop("DFLASH_LAUNCH_ID", None)
        argv = [str(ROOT / "launch.sh"), str(self.sup.job_path), "--grace", "60"]
        out = self.sup.job.run_paths.logs / "soak-launch.out"
        first = second = None
        try:
            with open(out, "a") as sink:
                first = subprocess.Popen(
                    argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
                )
            t0 = time.time()
            for name in self.sup.consumers:
                self.watch.wait_step(name, after=t0, timeout=RECOVERY_TIMEOUT_S)
            group = [
                int(p)
                for p in subprocess.run(["pgrep", "-g", str(first.pid)], capture_output=True, text=True).stdout.split()
                if int(p) != first.pid
            ]
            os.kill(first.pid, signal.SIGKILL)
            first.wait(30)
            t_kill = time.time()
            while any(_running(p) for p in group):
                if time.time() - t_kill > LAUNCH_ORPHAN_S:
                    raise AssertionError(
                        f"processes of the killed launch.sh still run: {[p for p in group if _running(p)]}"
                    )
                time.sleep(0.1)
            t_gone = time.time()  # (their last steps, taken while stopping, are not the rerun's)
            self.notes["launch_kill_orphans_stopped_max_s"] = max(
                self.notes.get("launch_kill_orphans_stopped_max_s", 0), round(t_gone - t_kill, 2)
            )
            gone = f"stopped: its launch.sh (pid {first.pid}) is gone"
            said = [n for n in self.sup.job.drafters if gone in self.watch.tail(f"consumer-{n.name}-r0", 30)]
            if len(said) != len(self.sup.consumers):
                raise AssertionError(f"not every consumer stopped because launch.sh was gone: {said}")
            with open(out, "a") as sink:
                second = subprocess.Popen(
                    argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
                )
            for name in self.sup.consumers:
                self.watch.wait_step(name, after=t_gone, timeout=RECOVERY_TIMEOUT_S)
            took = time.time() - t_kill
            second.send_signal(signal.SIGTERM)
            if second.wait(RECOVERY_TIMEOUT_S) != 0:
                raise AssertionError(f"the rerun's launch.sh exited {second.returncode} on SIGTERM")
            report = check_run(self.sup.job.run_paths.root)
            if not report.ok:
                raise AssertionError(f"the audit after launch.sh SIGKILL + rerun failed: {report.errors}")
        finally:
            for p in (first, second):  # after a failure: nothing of a launch may hold the job when the services start
                if p is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(30)
            self.sup.resume()
        t_resume = time.time()
        for name in self.sup.consumers:  # the services took the job back
            self.watch.wait_step(name, after=t_resume, timeout=RECOVERY_TIMEOUT_S)
        return took

    def stats_flood(self) -> float:
        telemetry = self.sup.procs["telemetry"]
        pid, t0 = telemetry.pid, time.time()
        sent = stats_flood(self.watch.ingest_endpoint(), FLOOD_S)
        t1 = time.time()
        if telemetry.pid != pid or not telemetry.alive():
            raise AssertionError(f"telemetry (pid {pid}) died of the flood")
        for name in self.sup.consumers:  # training went on
            self.watch.wait_step(name, after=t0, timeout=RECOVERY_TIMEOUT_S)
        took = self.watch.wait_only_live(after=t1, sources=1 + len(self.sup.consumers), timeout=RECOVERY_TIMEOUT_S) - t1
        windows = self.watch.windows(after=t0)
        kept = max(len(d["sources"]) for d in windows)
        if kept > MAX_SOURCES:
            raise AssertionError(f"telemetry kept {kept} sources during the flood (at most {MAX_SOURCES})")
        self.notes["flood_messages_sent"] += sent
        self.notes["flood_max_sources"] = max(self.notes.get("flood_max_sources", 0), kept)
        self.notes["flood_longest_window_bytes"] = max(
            self.notes.get("flood_longest_window_bytes", 0), max(d["_bytes"] for d in windows)
        )
        return max(took, 0.0)


def replace_file(path: Path, data: bytes) -> None:
    """Write `path` whole and atomically (a producer starting meanwhile reads the old or the new file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def corrupt_checkpoint(path: Path, rng: random.Random) -> str:
    """Truncate trainer_state.pt, or write NaN into a weight of model.safetensors (a file of the same size)."""
    if rng.random() < 0.5:
        state = path / "trainer_state.pt"
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
        return "truncated trainer_state.pt"
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    key = sorted(weights)[0]
    weights[key] = weights[key].clone().fill_(float("nan"))
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return f"NaN in {key}"


def leaked(run_dir: Path, job_name: str) -> tuple[list[str], list[str]]:
    """Ring files of this job left in /dev/shm, socket files left in the run's sockets/ folder."""
    shm = sorted(str(p) for p in Path("/dev/shm").glob(f"{RING_FILE_PREFIX}{job_name}-*"))
    socks = sorted(str(p) for p in (run_dir / "sockets").iterdir() if stat.S_ISSOCK(p.lstat().st_mode))
    return shm, socks


def run_soak(
    duration_s: float, seed: int, kinds: tuple[str, ...], min_each: int, keep: bool, log, pause_s: float = 2.0
) -> dict:
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
    job_path = build_job(root, seed)
    job = load_job(job_path)
    run_dir = job.run_paths.root
    tmpfs = job.run_paths.checkpoints(ENOSPC_DRAFTER)
    enospc = "checkpoint_enospc" in kinds
    if enospc:
        mount_tmpfs(tmpfs, 512)
    sup = Supervisor(job, job_path, log)
    watch = JobWatch(job, sup)
    stop = threading.Event()
    chaos = Chaos(sup, watch, rng, kinds, stop_s=2 * job.transport.heartbeat_timeout_s + 0.5, log=log, pause_s=pause_s)
    started = time.monotonic()
    result: dict = {"seed": seed, "enospc_method": "tmpfs (mount -t tmpfs, real ENOSPC)" if enospc else None}
    try:
        sup.start()
        for name in sup.consumers:
            watch.wait_step(name, after=0.0, timeout=RECOVERY_TIMEOUT_S)
        log(f"job up in {time.monotonic() - started:.0f} s; chaos for {duration_s:.0f} s")
        chaos.run(time.monotonic() + duration_s, min_each, stop)
        t_calm = time.time()
        for name in sup.consumers:  # every drafter trains again before the end
            watch.wait_step(name, after=t_calm, timeout=RECOVERY_TIMEOUT_S)
        result["exit_codes"] = sup.stop_all()
    finally:
        stop.set()
        sup.kill_all()
    report = check_run(run_dir)
    if enospc:
        unmount(tmpfs)
    shm, socks = leaked(run_dir, job.job.name)
    recs = [t for v in chaos.recovery_s.values() for t in v]
    result.update(
        {
            "duration_s": round(time.monotonic() - started, 1),
            "faults": dict(chaos.faults),
            "recoveries": dict(chaos.recoveries),
            "failed_faults": chaos.failures,
            "max_recovery_s": round(max(recs, default=0.0), 2),
            "max_recovery_s_by_kind": {k: round(max(v), 2) for k, v in chaos.recovery_s.items()},
            "max_training_resumed_s": round(max(chaos.training_resumed_s, default=0.0), 2),
            "batches_trained": {d: r.trained_batches for d, r in report.drafters.items()},
            "epochs_verified": {d: r.epochs_complete for d, r in report.drafters.items()},
            "duplicates": report.duplicates,
            "lost_samples": report.lost_samples,
            "missing_batches": sum(r.missing_batches for r in report.drafters.values()),
            "lost_in_crashes_then_retrained": {
                d: [r.crash_lost_batches, r.crash_lost_retrained] for d, r in report.drafters.items()
            },
            "restarts": sup.restart_counts(),
            "stale_batches_dropped": watch.count_all("re-attaching: this process stalled"),
            "reused_slot_batches_dropped": watch.count_all("so it was reused before we read it"),
            "notes": dict(chaos.notes),
            "leaked_shm": len(shm),
            "leaked_sockets": len(socks),
            "accounting_errors": report.errors + [f"{d}: {e}" for d, r in report.drafters.items() for e in r.errors],
        }
    )
    result["ok"] = bool(
        report.ok
        and not shm
        and not socks
        and not chaos.failures
        and all(chaos.faults[k] == chaos.recoveries[k] >= min_each for k in kinds)
        and all(code == 0 for code in result.get("exit_codes", {"none": 1}).values())
    )
    if not keep and result["ok"]:
        shutil.rmtree(root, ignore_errors=True)
    else:
        result["run_dir"] = str(run_dir)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of chaos (default %(default)s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds (default: all)")
    ap.add_argument("--min-each", type=int, default=1, help="inject every kind at least this often")
    ap.add_argument(
        "--pause",
        type=float,
        default=2.0,
        help="mean seconds of calm before each fault, drawn from [0.5, 1.5] x this (default %(default)s)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the run folder (it is kept anyway on failure)")
    ap.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    args = ap.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    if "checkpoint_enospc" in kinds and os.geteuid() != 0:
        ap.error("checkpoint_enospc mounts a tmpfs and needs root; leave it out with --kinds")
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[soak {time.monotonic() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    if args.pause < 0:
        ap.error(f"--pause must be >= 0 seconds, not {args.pause}")
    result = run_soak(args.duration, args.seed, kinds, args.min_each, args.keep, log, args.pause)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
