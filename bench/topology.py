"""Topology: does a second target replica double a drafter's input, does a second drafter replica double its
training, and what does the orchestration cost per batch?

    .venv/bin/python -m bench.topology [--quick] [--json]

Two cores cannot show GPU scaling, so the GPU work is SIMULATED: the target forward is replaced by sleeping
`target_ms` per batch, the drafter's forward + backward + step by sleeping `drafter_ms` per batch (a GPU
computes while its CPU thread waits; a sleeping process leaves the cores to the others, as a GPU-bound one
would). The sleep is calibrated: each worker measures how long its sleeps really took, and that measured
time is what counts as the simulated step.

REAL, exactly as in a job: the processes (one per producer, one per consumer, started by this script), the
producer loop (producer/service.py, sessions.py: delivery, slot table, back-pressure, control socket with heartbeats,
writing each batch's tokens, mask and cu_seqlens into a shared-memory slot of the ring, BATCH messages),
the consumer's fan-in over every producer (consumer/fanin.py), its copy-out of every batch from the ring
and RELEASE, and the consumer's training loop (consumer/service.py: rounds, the all-reduce of round flags
over gloo between replicas, step bookkeeping). Not exercised: the target's and the drafter's arithmetic
(slept), the features' bytes (left as they are in the slot; the copy-out still copies them), checkpoints.

Figures (tokens/s counted by the consumers between their first and last batch):
- fanin_2_producers: tokens/s with 2 producers ÷ with 1, feeding ONE consumer, target the slow stage
  (target_ms = 4 × drafter_ms); target >= 1.8.
- replicas_2: tokens/s with 2 drafter replicas ÷ with 1, fed by one producer, drafter the slow stage
  (drafter_ms = 4 × target_ms); target >= 1.8.
- overhead_pct: in the 1 producer → 1 consumer run with the drafter the slow stage (the consumer never
  waits for data), the consumer's wall time per batch beyond its measured simulated step, as a share of
  that step; target <= 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench import harness
from common.config import load_job
from common.ring_file import ring_path

TOKENS = 2048  # per batch
FEATURES = 128  # n·H of the simulated target (float32): 1 MiB of features per batch


def write_job(run_dir: Path, producers: int, replicas: int) -> Path:
    return harness.write_job(
        run_dir / "job.toml",
        {
            "job": {"name": f"topo-{run_dir.name}", "run_dir": str(run_dir)},
            "target": {"path": str(run_dir / "no-target"), "dtype": "float32", "replicas": producers},
            "data": {"path": str(run_dir / "no-data.jsonl"), "max_length": TOKENS // 2, "tokens_per_batch": TOKENS},
            "transport": {"slots": 4, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5.0, "attach_timeout_s": 120},
            "telemetry": {"interval_s": 0, "wandb_mode": "disabled"},
            "drafters": [
                {
                    "name": "d0",
                    "block_size": 8,
                    "num_layers": 1,
                    "checkpoint_every": 1000000,
                    "log_every": 1000000,
                    "replicas": replicas,
                }
            ],
        },
    )


# ---------------------------------------------------------------------------------------------- workers
class SleepTarget:
    """The target's forward as a calibrated sleep; the features are left in the slot as they are."""

    def __init__(self, seconds: float):
        import torch

        self.seconds, self.dtype, self.feature_width, self.prof = seconds, torch.float32, FEATURES, None

    def forward(self, input_ids, cu_seqlens, out=None):
        time.sleep(self.seconds)
        return out


class SleepTrainer:
    """The drafter's step as a calibrated sleep, with the bookkeeping ConsumerService reads."""

    def __init__(self, cfg, seconds: float):
        self.cfg, self.seconds = cfg, seconds
        self.step, self.last_seq, self.tokens, self.params = 0, -1, 0, []
        self.times: list[float] = []  # when each batch's simulated step ended
        self.slept = 0.0

    def accumulate(self, hidden, input_ids, loss_mask, cu_seqlens, seq: int) -> None:
        start = time.perf_counter()
        time.sleep(self.seconds)
        end = time.perf_counter()
        self.slept += end - start
        self.times.append(end)
        self.tokens += int(input_ids.numel())
        self.last_seq = max(self.last_seq, seq)

    def optimizer_step(self, last_seq: int):
        self.step += 1
        self.last_seq = max(self.last_seq, last_seq)
        return None

    def state_dict(self) -> dict:
        return {}

    def gather_state(self, keep: bool) -> dict | None:
        return self.state_dict() if keep else None

    def shape(self) -> dict:
        return {}


def run_producer(job_path: str, replica: int, target_s: float, batches: int) -> int:
    import torch

    from common.packed_batch import PackedBatch
    from producer.build import build_service

    job = load_job(job_path)
    stride = job.target.replicas

    def batches_from(seq: int):
        for s in range(seq, batches, stride):
            yield PackedBatch(
                s,
                0,
                [s],
                torch.zeros(TOKENS, dtype=torch.int64),
                torch.ones(TOKENS, dtype=torch.uint8),
                torch.tensor([0, TOKENS // 2, TOKENS], dtype=torch.int32),
            )

    return build_service(job, SleepTarget(target_s), batches_from, batches, replica=replica).run()


def run_consumer(job_path: str, replica: int, drafter_s: float, out: str) -> int:
    import torch

    from consumer.build import build_service
    from consumer.distributed import GroupEnv, ReplicaGroup
    from consumer.group_cursor import GroupCursor

    job = load_job(job_path)
    cfg = job.drafters[0]
    env = GroupEnv.resolve(os.environ, replica=replica, replicas=cfg.replicas, node_rank=0, nnodes=1)
    group = ReplicaGroup(env, torch.device("cpu"))
    trainer = SleepTrainer(cfg, drafter_s)
    cursor = GroupCursor.fresh(1, job.target.replicas)
    status = build_service(job, cfg, env, group, torch.device("cpu"), trainer, cursor).run()
    Path(out).write_text(json.dumps({"times": trainer.times, "slept": trainer.slept, "tokens": trainer.tokens}))
    return status


# ---------------------------------------------------------------------------------------------- variants
def variant(producers: int, replicas: int, target_ms: float, drafter_ms: float, batches: int) -> dict:
    """One run: `producers` producer processes feeding `replicas` consumers of one drafter."""
    run_dir = Path(tempfile.mkdtemp(prefix="topo-", dir="/tmp"))
    job = write_job(run_dir, producers, replicas)
    rings = [ring_path("/dev/shm", load_job(job).ring_name(0, p)) for p in range(producers)]
    try:
        me = ["-m", "bench.topology"]
        procs = [
            harness.spawn(
                [
                    *me,
                    "--worker",
                    "producer",
                    "--job",
                    job,
                    "--replica",
                    p,
                    "--seconds",
                    target_ms / 1e3,
                    "--batches",
                    batches,
                ],
                run_dir / f"p{p}.log",
            )
            for p in range(producers)
        ]
        port = harness.free_port()
        for r in range(replicas):
            group = (
                {
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "WORLD_SIZE": str(replicas),
                    "RANK": str(r),
                    "LOCAL_RANK": str(r),
                }
                if replicas > 1
                else {}
            )
            procs.append(
                harness.spawn(
                    [
                        *me,
                        "--worker",
                        "consumer",
                        "--job",
                        job,
                        "--replica",
                        r,
                        "--seconds",
                        drafter_ms / 1e3,
                        "--out",
                        run_dir / f"c{r}.json",
                    ],
                    run_dir / f"c{r}.log",
                    group,
                )
            )
        try:
            codes = [p.wait(timeout=600) for p in procs]
        finally:
            for p in procs:
                p.kill()
        if any(codes):
            logs = {f.name: f.read_text()[-1500:] for f in sorted(run_dir.glob("*.log"))}
            raise RuntimeError(f"a worker failed ({codes}): {logs}")
        results = [json.loads((run_dir / f"c{r}.json").read_text()) for r in range(replicas)]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        for ring in rings:
            ring.unlink(missing_ok=True)
    times = sorted(t for r in results for t in r["times"])
    n = len(times)
    assert n == batches, f"{n} batches trained, {batches} planned"
    span = times[-1] - times[0]
    rate = (n - 1) * TOKENS / span
    # per consumer: wall between its first and last batch beyond the simulated steps in between
    over = [
        (r["times"][-1] - r["times"][0] - r["slept"] * (len(r["times"]) - 1) / len(r["times"]))
        / (r["slept"] * (len(r["times"]) - 1) / len(r["times"]))
        for r in results
    ]
    return {"tokens_per_s": rate, "batches": n, "overhead_pct": 100 * max(over), "span_s": span}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.topology", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer batches")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    ap.add_argument("--worker", choices=["producer", "consumer"], help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--batches", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "producer":
        return run_producer(args.job, args.replica, args.seconds, args.batches)
    if args.worker == "consumer":
        return run_consumer(args.job, args.replica, args.seconds, args.out)
    batches = 40 if args.quick else 120
    slow, fast = 40.0, 10.0  # ms per batch: the slow stage is 4× the fast one
    target_1 = variant(1, 1, slow, fast, batches)
    target_2 = variant(2, 1, slow, fast, batches)
    drafter_1 = variant(1, 1, fast, slow, batches)
    drafter_2 = variant(1, 2, fast, slow, batches)
    figures = {
        "fanin_2_producers": target_2["tokens_per_s"] / target_1["tokens_per_s"],
        "replicas_2": drafter_2["tokens_per_s"] / drafter_1["tokens_per_s"],
        "overhead_pct": drafter_1["overhead_pct"],
        "tokens_per_s": {
            "target_slow_1_producer": target_1["tokens_per_s"],
            "target_slow_2_producers": target_2["tokens_per_s"],
            "drafter_slow_1_replica": drafter_1["tokens_per_s"],
            "drafter_slow_2_replicas": drafter_2["tokens_per_s"],
        },
        "slow_ms": slow,
        "fast_ms": fast,
        "batches": batches,
        "tokens_per_batch": TOKENS,
    }
    print(
        f"fanin_2_producers {figures['fanin_2_producers']:.2f} (target {slow:.0f} ms, drafter {fast:.0f} ms per"
        f" batch; {target_1['tokens_per_s']:.0f} → {target_2['tokens_per_s']:.0f} tokens/s; target >= 1.8)"
    )
    print(
        f"replicas_2 {figures['replicas_2']:.2f} (target {fast:.0f} ms, drafter {slow:.0f} ms per batch;"
        f" {drafter_1['tokens_per_s']:.0f} → {drafter_2['tokens_per_s']:.0f} tokens/s; target >= 1.8)"
    )
    print(
        f"overhead_pct {figures['overhead_pct']:.2f} (consumer wall per batch beyond its {slow:.0f} ms simulated"
        " step; target <= 2)"
    )
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
