"""Regressions in the producer: skip mode with every consumer gone, the slot's seq tag, HELLO validation."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from bench.harness import write_job
from common.config import load_job
from common.ring import SEQ_TAG
from consumer.stream import BatchStream, ConsumerRejected, ReceivedBatch, StreamEnd
from producer.service import ProducerService, slot_layout
from tests.procs.transport_pair import FakeTarget, make_batch

ROOT = Path(__file__).resolve().parents[2]


def skip_job_doc(name: str, run_dir: Path, attach: float) -> dict:
    return {
        "job": {"name": name, "run_dir": str(run_dir)},
        "target": {"path": "unused"},
        "data": {"path": "unused", "max_length": 64, "tokens_per_batch": 64},
        "transport": {
            "slots": 3,
            "heartbeat_interval_s": 0.1,
            "heartbeat_timeout_s": 1.0,
            "attach_timeout_s": attach,
            "on_dead_group": "skip",
        },
        "drafters": [{"name": "d0"}],
    }


@pytest.fixture
def skip_job():
    made = []

    def make(attach: float) -> Path:
        run_dir = Path(tempfile.mkdtemp(prefix="dfp-", dir="/tmp"))
        made.append(run_dir)
        return write_job(run_dir / "job.toml", skip_job_doc(f"skip-{run_dir.name[4:]}", run_dir, attach))

    yield make
    for d in made:
        subprocess.run(["rm", "-rf", str(d)], check=False)


def start_producer(job_path: Path, batches: int, delay_s: float = 0.0) -> tuple[subprocess.Popen, Path]:
    """The stand-in producer (tests/procs/transport_pair.py), `delay_s` per batch made."""
    out = job_path.parent / "producer.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "tests.procs.transport_pair", "producer", str(job_path), str(batches)]
    proc = subprocess.Popen(
        [*argv, str(out), str(delay_s)],
        cwd=ROOT,
        env=env,
    )
    ready = job_path.parent / "sockets" / "control.endpoint"  # written once the producer listens
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the producer did not start"
        time.sleep(0.05)
    return proc, out


def take(stream: BatchStream, n: int | None) -> list[int]:
    """Seqs of the next `n` batches (None: until END)."""
    seqs = []
    while n is None or len(seqs) < n:
        item = stream.next(timeout_s=30)
        assert item is not None, "no batch for 30 s"
        if isinstance(item, StreamEnd):
            break
        assert isinstance(item, ReceivedBatch)
        seqs.append(item.seq)
    return seqs


def session(job, resume: int, n: int | None) -> list[int]:
    stream = BatchStream(job, "d0", 0, torch.device("cpu"), lambda: resume)
    try:
        stream.connect()
        seqs = take(stream, n)
        stream.bye("test", seqs[-1] if seqs else -1)
        assert stream.dropped_reused == 0  # every slot carried the seq its BATCH named
    finally:
        stream.close()
    return seqs


def test_skip_mode_waits_for_a_consumer_when_every_group_is_gone(skip_job):
    """Found by the soak: with on_dead_group = "skip", the producer ended the job ("data exhausted", exit 0)
    the moment every consumer was gone at once, e.g. all restarting, though most batches were never made."""
    job_path = skip_job(attach=60)
    job = load_job(job_path)
    proc, out = start_producer(job_path, 30)
    try:
        assert session(job, 0, 5) == [0, 1, 2, 3, 4]
        time.sleep(2.0)
        assert proc.poll() is None, "the producer ended the job while its only group was away"
        assert session(job, 5, None) == list(range(5, 30))  # the replacement resumes and gets the rest
        assert proc.wait(timeout=60) == 0
        assert json.loads(out.read_text())["status"] == 0
    finally:
        proc.kill()


def test_the_seq_tag_is_invalid_while_a_slot_is_rewritten_and_names_the_batch_after(skip_job):
    job = load_job(skip_job(attach=60))
    job.run_paths.make()
    seen = []

    class WatchingTarget(FakeTarget):
        def forward(self, input_ids, cu_seqlens, out):
            layout = slot_layout(input_ids.numel(), cu_seqlens.numel() - 1, self.feature_width, "float32")
            seen.append(int(service.ring.view(1, layout)[SEQ_TAG][0]))  # what a late reader of slot 1 sees
            return super().forward(input_ids, cu_seqlens, out)

    service = ProducerService(job, WatchingTarget(), lambda s: iter(()), 1, ring_name=f"tag-{job.job.name}")
    try:
        for seq in (7, 8):
            batch = make_batch(seq, 64)
            layout = service._write_slot(1, batch)
            assert int(service.ring.view(1, layout)[SEQ_TAG][0]) == seq
        assert seen == [-1, -1]  # invalidated before the forward wrote a byte, for a fresh and a reused slot
    finally:
        service.close()


def test_a_producer_that_cannot_listen_leaves_no_ring_behind(skip_job):
    job = load_job(skip_job(attach=60))
    job.run_paths.make()
    first = ProducerService(job, FakeTarget(), lambda s: iter(()), 1, ring_name=f"a-{job.job.name}")
    try:
        with pytest.raises(RuntimeError, match="another producer"):
            ProducerService(job, FakeTarget(), lambda s: iter(()), 1, ring_name=f"b-{job.job.name}")
        assert not Path(f"/dev/shm/dflash-ring-b-{job.job.name}").exists()
    finally:
        first.close()
    assert not Path(f"/dev/shm/dflash-ring-a-{job.job.name}").exists()


def test_a_hello_that_does_not_fit_the_job_is_rejected_counted_and_harms_nobody(skip_job):
    """Found from outside: a HELLO with a replica index outside the drafter's replicas (even 2**64-1) was
    accepted as a new group member and dealt batches. Unknown drafter, replica out of range, another node
    and another launch are each refused with a clear FAIL, counted, and the job goes on."""
    job_path = skip_job(attach=60)
    job = load_job(job_path)
    proc, out = start_producer(job_path, 12)
    bad = [
        (dict(drafter="nope"), "no drafter 'nope' in this job"),
        (dict(replica=1), "replica 1 is outside drafter d0's 1 replica"),
        (dict(replica=2**64 - 1), f"replica {2**64 - 1} is outside drafter d0's 1 replica"),
        (dict(node=3), "node 3: this producer serves node 0"),
        (dict(launch="someone-else"), "launch someone-else is not this producer's launch"),
    ]
    try:
        for fields, reason in bad:
            args = {"drafter": "d0", "replica": 0, "node": 0, "launch": "", **fields}
            stream = BatchStream(
                job,
                args["drafter"],
                args["replica"],
                torch.device("cpu"),
                lambda: 0,
                node=args["node"],
                launch_id=args["launch"],
            )
            try:
                with pytest.raises(ConsumerRejected, match=reason):
                    stream.connect()
            finally:
                stream.close()
        assert session(job, 0, None) == list(range(12))  # the real consumer is served every batch
        assert proc.wait(timeout=60) == 0
        assert json.loads(out.read_text())["rejected_hellos"] == len(bad)
    finally:
        proc.kill()


def test_replicas_stalled_past_the_heartbeat_after_the_last_batch_get_their_lost_batches_and_end(skip_job):
    """Seen once under load in tests/e2e/test_scaleout_e2e.py: both replicas of a drafter stalled past the
    heartbeat while their queues held batches, re-attached at seqs 79/80 while the producer's group was at its
    end (85), and waited until the producer had gone (exit 3): the producer had dealt every batch, fenced them
    and finished; the batches they never released were lost. The stall is injected (SIGSTOP for longer than
    the heartbeat timeout, the consumers slow enough that batches wait unreleased in their queues): the
    producer keeps the group open for those batches, makes them again for the same processes when they
    re-attach, then ends; every batch is taken exactly once across the replicas."""
    job_path = skip_job(attach=20)
    doc = skip_job_doc(job_path.parent.name, job_path.parent, 20)
    doc["job"]["name"] = load_job(job_path).job.name
    doc["transport"] |= {"slots": 12, "on_dead_group": "block"}
    doc["drafters"] = [{"name": "d0", "replicas": 2}]
    write_job(job_path, doc)
    run = job_path.parent
    outs = [run / f"c{r}.json" for r in range(2)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "tests.procs.transport_pair", "consumer", str(job_path), "d0"]
    consumers = [
        subprocess.Popen(
            [*argv, str(r), str(outs[r]), "0", "1.0"],  # resume at 0, 1 s per batch
            cwd=ROOT,
            env=env,
        )
        for r in range(2)
    ]
    proc, out = start_producer(job_path, 12, delay_s=0.1)  # both replicas attach before the data is dealt
    try:
        deadline = time.monotonic() + 60
        while not all(o.exists() and json.loads(o.read_text())["seqs"] for o in outs):
            assert time.monotonic() < deadline and all(c.poll() is None for c in consumers), "no batch reached both"
            time.sleep(0.05)
        time.sleep(1.5)  # the producer deals the rest (0.1 s each) while the slow consumers' queues fill
        for c in consumers:  # the stall: past the 1 s heartbeat timeout, with unreleased batches queued
            c.send_signal(signal.SIGSTOP)
        time.sleep(2.5)
        for c in consumers:
            c.send_signal(signal.SIGCONT)
        assert [c.wait(timeout=60) for c in consumers] == [0, 0]
        assert proc.wait(timeout=60) == 0
    finally:
        for p in [proc, *consumers]:
            p.send_signal(signal.SIGCONT)
            p.kill()
    got = [json.loads(o.read_text()) for o in outs]
    assert sorted(got[0]["seqs"] + got[1]["seqs"]) == list(range(12))  # none lost, none twice
    assert got[0]["bad"] == got[1]["bad"] == []
    assert got[0]["reattached"] + got[1]["reattached"] >= 2  # both woke into a fenced session and came back
    assert json.loads(out.read_text())["fenced"] >= 2
