"""Drafter-step throughput with 1 and 2 replicas of one drafter, fed by one producer, on the CPU.

    .venv/bin/python -m bench.scaleout [--epochs N] [--quick] [--json]

Each variant runs the real processes (one producer, R consumers forming a gloo group over loopback, every
process with one torch thread) on the same data, and measures the group's trained tokens per second from
the consumers' step traces, over the steady part of the run (the first and last steps are left out).
`replica_scaling_2` = tokens/s with 2 replicas ÷ with 1.

How the producer is kept off the critical path on 2 cores: the target captures a single layer (layer 0 of
a 2-layer tiny Qwen3, so its forward runs one decoder layer), while the drafter does many times that work
per batch (2 layers over anchors × block rows, which outnumber the batch's tokens several times). With
one replica the consumer is the bottleneck; with two, the two consumers share the two cores with a producer
that needs a few percent of one. The figures printed beside the ratio (producer busy %, all-reduce wait %)
say whether that held on the machine the bench ran on: other load on the cores shows up as wait.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench import harness

DRAFTER = {
    "name": "d0",
    "block_size": 16,
    "num_layers": 2,
    "anchors_per_seq": 96,
    "loss_chunk_rows": 4096,
    "checkpoint_every": 100000,
    "log_every": 50,
    "total_steps": 100000,
}


def build_assets(root: Path, records: int) -> Path:
    from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer, write_jsonl

    chats = list(synthetic_chats(records, seed=5))
    tok = train_tokenizer(corpus_texts(chats), 400, root / "tokenizer")
    build_tiny_target(root / "target", tok, hidden_size=64, num_layers=2, seed=0)
    write_jsonl(root / "train.jsonl", chats)
    return root


def write_job(assets: Path, run_dir: Path, replicas: int, epochs: int) -> Path:
    return harness.write_job(
        run_dir / "job.toml",
        {
            "job": {"name": f"scaleout-{run_dir.name}", "run_dir": str(run_dir), "seed": 1},
            "target": {"path": str(assets / "target"), "dtype": "float32", "layer_ids": [0]},
            "data": {"path": str(assets / "train.jsonl"), "max_length": 256, "tokens_per_batch": 512, "epochs": epochs},
            "transport": {"slots": 8, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10.0},
            "telemetry": {"interval_s": 1.0, "wandb_mode": "disabled"},
            "drafters": [{**DRAFTER, "replicas": replicas}],
        },
    )


def run_variant(assets: Path, replicas: int, epochs: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="dfs-", dir="/tmp"))
    try:
        job = write_job(assets, run_dir, replicas, epochs)
        env = {"MKL_NUM_THREADS": "1"}
        port = harness.free_port()
        procs = [harness.spawn(["-m", "producer", "--job", job], run_dir / "producer.out", env)]
        for r in range(replicas):
            group = (
                {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(replicas), "RANK": str(r)}
                if replicas > 1
                else {}
            )
            procs.append(
                harness.spawn(
                    [
                        "-m",
                        "consumer",
                        "--job",
                        job,
                        "--drafter",
                        "d0",
                        "--replica",
                        r,
                        "--trace",
                        run_dir / f"trace{r}.jsonl",
                    ],
                    run_dir / f"consumer{r}.out",
                    {**env, **group},
                )
            )
        try:
            codes = [p.wait(timeout=600) for p in procs]
        finally:
            for p in procs:
                p.kill()
        if any(codes):
            logs = "".join((run_dir / f).read_text()[-1500:] for f in sorted(os.listdir(run_dir)) if f.endswith(".out"))
            raise RuntimeError(f"{replicas} replica(s): exit codes {codes}\n{logs}")
        traces = [
            [json.loads(li) for li in (run_dir / f"trace{r}.jsonl").read_text().splitlines()] for r in range(replicas)
        ]
        return measure(traces) | profile_shares(run_dir, replicas)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def measure(traces: list[list[dict]]) -> dict:
    """Group tokens/s between the end of step k0 and the end of step k1 (the steady middle of the run)."""
    steps = len(traces[0])
    k0, k1 = max(2, steps // 10), steps - 1 - max(1, steps // 20)
    t0, t1 = traces[0][k0]["time"], traces[0][k1]["time"]
    tokens = sum(row["tokens"] for tr in traces for row in tr[k0 + 1 : k1 + 1])
    return {
        "tokens_per_s": tokens / (t1 - t0),
        "steps": steps,
        "window_s": t1 - t0,
        "tokens_per_step": tokens / (k1 - k0),
    }


def profile_shares(run_dir: Path, replicas: int) -> dict:
    """Busy/wait shares over the steady run from the profile lines each process logged (telemetry is not
    started). Each line covers one interval (`prof 5.0s | forward 12×3.40ms (max 5.60) 7.8% | ...`); the
    first (start-up) and the last (the drain) are left out when there are three or more, and a timer's
    share is its summed time over the summed wall time of the lines kept."""

    def steady_pct(path: Path, timer: str) -> float | None:
        lines = [li for li in path.read_text().splitlines() if "prof " in li and " | " in li]
        if len(lines) >= 3:
            lines = lines[1:-1]
        wall = busy = 0.0
        for li in lines:
            fields = li.split("prof ", 1)[1].split(" | ")
            seconds = float(fields[0].rstrip("s"))
            wall += seconds
            for field in fields[1:]:
                if field.startswith(f"{timer} "):
                    busy += seconds * float(field.split()[-1].rstrip("%")) / 100
        return round(100 * busy / wall, 2) if wall else None

    forward = steady_pct(run_dir / "producer.out", "forward")
    waits = [steady_pct(run_dir / f"consumer{r}.out", "allreduce_wait") for r in range(replicas)]
    return {
        "producer_forward_pct": forward,
        "allreduce_wait_pct": max((w for w in waits if w is not None), default=0.0),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.scaleout", description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=240, help="synthetic chats in the data set")
    ap.add_argument("--epochs", type=int, default=2, help="passes over the data per variant")
    ap.add_argument("--quick", action="store_true", help="one epoch per variant (a shorter, noisier window)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.quick:
        args.epochs = 1
    with tempfile.TemporaryDirectory(prefix="dfs-assets-") as tmp:
        assets = build_assets(Path(tmp), args.records)
        results = {}
        for replicas in (1, 2):
            start = time.perf_counter()
            results[replicas] = run_variant(assets, replicas, args.epochs)
            results[replicas]["wall_s"] = time.perf_counter() - start
    one, two = results[1], results[2]
    scaling = two["tokens_per_s"] / one["tokens_per_s"]
    print(
        f"{'replicas':>8} {'tokens/s':>10} {'steps':>6} {'tok/step':>9} {'window s':>9} {'prod fwd %':>10}"
        f" {'ar wait %':>9} {'wall s':>7}"
    )
    for r, v in results.items():
        print(
            f"{r:>8} {v['tokens_per_s']:>10.0f} {v['steps']:>6} {v['tokens_per_step']:>9.0f} {v['window_s']:>9.1f}"
            f" {v['producer_forward_pct'] or 0:>10.1f} {v['allreduce_wait_pct']:>9.1f} {v['wall_s']:>7.1f}"
        )
    print(f"replica_scaling_2 = {scaling:.2f} (target >= 1.7 when the producer is not the bottleneck)")
    if args.json:
        print(
            json.dumps(
                {
                    "replica_scaling_2": round(scaling, 3),
                    "tokens_per_s_1": round(one["tokens_per_s"], 1),
                    "tokens_per_s_2": round(two["tokens_per_s"], 1),
                    "producer_forward_pct_2": two["producer_forward_pct"],
                    "allreduce_wait_pct_2": two["allreduce_wait_pct"],
                    "cpus": os.cpu_count(),
                    "load_avg_1m": round(os.getloadavg()[0], 2),
                }
            )
        )


if __name__ == "__main__":
    main()
