"""Resume in every topology the job files allow (issue 32 §1), with the real processes of each job as its launch
plan starts them (telemetry aside), on the CPU (gloo): SIGKILL of the whole group, or of one process, in the
middle of the data; the same processes again; then the exactly-once audit (common/accounting_check.py) and,
where the topology trains deterministically, the final weights against an uninterrupted run of the same plan.

Bit-equal weights need every step to hold the same batches: one drafter replica fed by one producer. A group of
replicas deals batches among its live members and fan-in trains whichever producer's batch is ready first, so
there a step's batches depend on timing in the uninterrupted run as well: those cases check exactly-once, that
the resumed run continued from its checkpoint's step, and the re-dealing under a changed world size.

Already covered elsewhere, not repeated here: SIGTERM (test_pipeline_e2e, test_scaleout_e2e), a SIGKILLed
producer with two drafters through launch.sh (test_faults_launch), a SIGKILLed consumer of a fan-in job and
target.replicas 1 → 2 (test_topology_replicas), a SIGKILLed replica of a DDP group (test_scaleout_e2e),
--nnodes changed (refused: tests/consumer/test_group_cursor.py).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from bench import harness
from bench.harness import free_port, spawn
from common.accounting_check import check_run
from common.checkpoint_pointer import BEST, read_pointer
from common.config import load_job
from common.launch_plan import plan
from consumer.checkpoint import load_latest
from tests.jobs import tiny_assets, write_job

pytestmark = pytest.mark.slow

BASE = {"num_layers": 1, "loss_chunk_rows": 64, "checkpoint_every": 3, "log_every": 1}
D0 = {"name": "d0", "block_size": 8, "anchors_per_seq": 16, **BASE}
D1 = {"name": "d1", "block_size": 4, "anchors_per_seq": 8, **BASE}
TOKENS = 1024
RECORDS = 100  # of the tests' 240 chats: 16 batches (about 1.3 s of training each run here; starts dominate)
FSDP = {**D0, "replicas": 2, "distributed": "fsdp", "tokens_per_step": 3 * TOKENS, "checkpoint_every": 1}
VALIDATION = {"validation": 0.1, "eval_every": 4, "validation_max_records": 8}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tests' target and tokenizer with the first RECORDS chats: a short plan."""
    tiny, own = tiny_assets(tmp_path_factory.mktemp("assets")), tmp_path_factory.mktemp("resume-assets")
    (own / "target").symlink_to(tiny / "target")
    lines = (tiny / "train.jsonl").read_text().splitlines(keepends=True)
    (own / "train.jsonl").write_text("".join(lines[:RECORDS]))
    return own


def make_job(assets: Path, name: str, drafters: list[dict], **tables: dict) -> Path:
    overrides = {"transport": {"heartbeat_timeout_s": 3.0}, **tables}
    return write_job(assets, drafters=drafters, tokens_per_batch=TOKENS, name=name, overrides=overrides)


def out_dir(job: Path) -> Path:
    """Where the processes' output goes: `<start>-<process>.log`, a (first) and b (the resume)."""
    out = job.parent / "out"
    out.mkdir(exist_ok=True)
    return out


def start(job: Path, tag: str, only: str = "") -> dict[str, subprocess.Popen]:
    """The job's processes as launch.sh starts them (not telemetry), or those whose name starts with `only`;
    a fresh master port base for every start (a killed group's ports may linger)."""
    specs = plan(load_job(job), str(job), sys.executable, master_port=free_port())
    return {
        p.name: spawn(p.argv[1:], out_dir(job) / f"{tag}-{p.name}.log", p.env)
        for p in specs
        if p.name != "telemetry" and p.name.startswith(only)
    }


def tails(job: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-2500:]}" for p in sorted(out_dir(job).glob("*.log")))


def finish(job: Path, procs: dict[str, subprocess.Popen], timeout: float = 300) -> None:
    """Every process exits 0 within `timeout`; whatever still runs after it is killed."""
    try:
        codes = {name: p.wait(timeout=timeout) for name, p in procs.items()}
    except subprocess.TimeoutExpired:
        codes = {name: p.poll() for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    assert set(codes.values()) == {0}, f"{codes}\n{tails(job)}"


def kill(procs: dict[str, subprocess.Popen], *names: str) -> None:
    for name in names or list(procs):
        procs[name].send_signal(signal.SIGKILL)
        procs[name].wait(timeout=30)


def wait_for_step(job: Path, procs: dict[str, subprocess.Popen], drafter: str, step: int, timeout: float = 240):
    """The drafter's newest checkpoint once it is at `step` or later."""
    root = job.parent / "checkpoints" / drafter
    deadline = time.monotonic() + timeout
    while (ck := load_latest(root)) is None or ck.step < step:
        assert time.monotonic() < deadline, f"no checkpoint at step {step} within {timeout} s\n{tails(job)}"
        assert all(p.poll() is None for p in procs.values()), f"a process ended early\n{tails(job)}"
        time.sleep(0.1)
    return ck


def audit(job: Path, drafters: list[str]) -> None:
    """Exactly once: every batch of the plan trained once in each drafter's final lineage (the last, partial
    accumulation step included), nothing lost, and the audit calls the finished job complete."""
    report = check_run(job.parent)
    assert report.ok, (report.errors, {d: r.errors for d, r in report.drafters.items()})
    for name in drafters:
        d = report.drafters[name]
        assert d.duplicate_batches == d.duplicate_samples == 0, (name, d)
        assert d.missing_batches == d.lost_samples == d.undelivered_batches == 0, (name, d)
        assert d.crash_lost_batches == d.crash_lost_retrained, (name, d)
        assert d.trained_batches == planned(job) and d.complete, (name, d)


def planned(job: Path) -> int:
    line = next(li for li in (out_dir(job) / "a-producer.log").read_text().splitlines() if "batches planned" in li)
    return int(line.split()[-3])  # "...; N batches planned"


def final(job: Path, drafter: str):
    return load_latest(job.parent / "checkpoints" / drafter)


def same_weights(a, b) -> None:
    """Bit-equal weights and optimizer step of two final checkpoints."""
    assert a.step == b.step and a.state["tokens"] == b.state["tokens"]
    wa, wb = a.state["model"], b.state["model"]
    assert wa.keys() == wb.keys()
    differ = {k: float((wa[k] - wb[k]).abs().max()) for k in wa if not torch.equal(wa[k], wb[k])}
    assert not differ, f"weights differ from the uninterrupted run: {differ}"


_REFERENCES: dict[str, Path] = {}


def reference(assets: Path, kind: str, drafters: list[dict], **tables: dict) -> Path:
    """One uninterrupted run per plan, shared by the cases that compare against it."""
    if kind not in _REFERENCES:
        job = make_job(assets, f"ref-{kind}", drafters, **tables)
        finish(job, start(job, "a"))
        _REFERENCES[kind] = job
    return _REFERENCES[kind]


# ------------------------------------------------------------------------------------ deterministic topologies
CASES = {
    # name: (drafters, job tables, what is killed: "group" or a process name)
    "one_drafter": ([D0, D1], {}, "group"),
    "two_drafters_one_killed": ([D0, D1], {}, "consumer-d1-r0"),
    "tp_target": ([D0], {"target": {"tp_size": 2}}, "group"),
    "validation_best": ([D0], {"data": VALIDATION}, "group"),
}
REFERENCE_OF = {"one_drafter": "plain", "two_drafters_one_killed": "plain", "tp_target": "tp", "validation_best": "val"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_killed_job_resumes_to_the_weights_of_an_uninterrupted_run(assets, case):
    drafters, tables, killed = CASES[case]
    if case == "one_drafter":
        drafters = [D0]  # compared with the reference's d0: a drafter trains alone what it trains beside others
    ref = reference(assets, REFERENCE_OF[case], CASES[case][0], **tables)
    job = make_job(assets, case.replace("_", "")[:10], drafters, **tables)
    names = [d["name"] for d in drafters]
    procs = start(job, "a")
    at = wait_for_step(job, procs, names[-1], 6)
    if killed == "group":
        kill(procs)
        procs = start(job, "b")
    else:  # one process: the producer fences it and holds the other drafters back until it is back
        kill(procs, killed)
        procs |= start(job, "b", only=killed)
    finish(job, procs)
    resumed = final(job, names[-1])
    assert resumed.step > at.step
    log = (out_dir(job) / f"b-consumer-{names[-1]}-r0.log").read_text()
    assert "resumed from " in log, log[-2000:]
    audit(job, names)
    for name in names:
        same_weights(final(job, name), final(ref, name))
    if case == "validation_best":  # the same passes of the same weights: the same τ and the same best step
        best = read_pointer(job.parent / "checkpoints" / "d0", BEST)
        assert best is not None and best == read_pointer(ref.parent / "checkpoints" / "d0", BEST)
        held_out = check_run(job.parent).drafters["d0"].validation
        assert held_out is not None and held_out.ok and held_out.passes_exact > 0, held_out


# ------------------------------------------------------------------------------ timing-dependent topologies
def rewrite(job: Path, drafters: list[dict] | None = None, **tables: dict) -> None:
    """The same job file with `drafters` and the keys of `tables` replaced (a world size changed between runs)."""
    doc = tomllib.loads(job.read_text())
    for table, keys in tables.items():
        doc[table] = {**doc.get(table, {}), **keys}
    if drafters is not None:
        doc["drafters"] = drafters
    harness.write_job(job, doc)


ONE_STEPPED = {**D0, "tokens_per_step": 3 * TOKENS}  # FSDP's step size, one replica
REGROUP = {
    # name: (first run's drafters, job tables, killed, the second run's drafters and tables (None: unchanged))
    "fsdp_accumulation_one_replica_killed": ([FSDP], {}, "consumer-d0-r1", None),
    "fanin_group_killed_resumed_under_one_producer": (
        [D0],
        {"target": {"replicas": 2}},
        "group",
        ([D0], {"target": {"replicas": 1}}),
    ),
    "fsdp_two_replicas_resumed_as_one": ([FSDP], {}, "group", ([ONE_STEPPED], {})),
    "one_replica_resumed_as_fsdp_two": ([ONE_STEPPED], {}, "group", ([FSDP], {})),
    "tp1_group_killed_resumed_under_tp2": ([D0], {}, "group", ([D0], {"target": {"tp_size": 2}})),
}


@pytest.mark.parametrize("case", list(REGROUP))
def test_a_killed_group_resumes_exactly_once_also_under_another_world_size(assets, case):
    """A drafter's replicas (FSDP, gradient accumulation over ~3 batches), the target's replicas or its TP size: a
    SIGKILL, the resume (under another world size where the case says so: the checkpoint is unsharded and its
    cursor per producer, not per TP rank, so it re-shards and re-deals), every batch trained once, and the resumed
    run went on from its checkpoint's step."""
    drafters, tables, killed, second = REGROUP[case]
    job = make_job(assets, case.replace("_", "")[:10], drafters, **tables)
    procs = start(job, "a")
    at = wait_for_step(job, procs, "d0", 1)
    if killed == "group":
        kill(procs)
    else:  # one replica: the other fails its group (exit 5); the producer fences the dead one, then both restart
        kill(procs, killed)
        assert procs["consumer-d0-r0"].wait(timeout=120) == 5, tails(job)
        deadline = time.monotonic() + 60
        while "fenced d0.r1" not in (out_dir(job) / "a-producer.log").read_text():
            assert time.monotonic() < deadline and procs["producer"].poll() is None, tails(job)
            time.sleep(0.1)
    if second is not None:
        rewrite(job, second[0], **second[1])
    procs = {n: p for n, p in procs.items() if p.poll() is None} | start(
        job, "b", only="" if killed == "group" else "consumer"
    )
    finish(job, procs)
    audit(job, ["d0"])  # a step is 3 batches: the last, partial one is trained too
    log = (out_dir(job) / "b-consumer-d0-r0.log").read_text()
    assert f"resumed from {job.parent / 'checkpoints' / 'd0'}" in log, log[-2000:]
    assert final(job, "d0").step > at.step
    if case.startswith("fanin"):
        assert "this run has 1: its trained seqs are re-dealt" in log, log[-2000:]
    if case.startswith("tp1"):  # the resumed forwards ran on a TP group of 2: its follower rank forwarded too
        follower = (out_dir(job) / "b-producer-tp1.log").read_text()
        assert "rank 0 ended the group after " in follower, follower[-2000:]
