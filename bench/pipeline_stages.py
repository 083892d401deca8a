"""bench.pipeline's in-process variants: the stages alone and the serial loop, in one long-lived process.

    python -m bench.pipeline_stages --assets DIR --chats N --warmup W --cores P,C balanced=JOB heavy_target=JOB

Builds the benchmark's assets once (tokenizer, random Qwen3 target, chat data), reads the batches of each
job's plan exactly as the producer does (producer.build.build_dataset), loads the target and the
drafter trainers exactly as the producer and consumer entry points do, warms every variant up on the
first W batches, then answers on stdout: one JSON line when ready, one per {"rep": K} line on stdin
({"quit": true} ends it). Everything else it prints goes to stderr, so the protocol lines stay clean.

Per repetition, each variant runs over batches W.. of the plan, in an order rotated by K:
  producer_alone        target forward into a reused slot-sized buffer, on core P
  consumer_alone        Trainer.train_batch on features captured at start-up (fed from memory), on core C
  serial                forward into the buffer, then train_batch on it, batch after batch, on core P
                        with one thread (what one core does alone)
  serial_2_threads      the same loop with the pipeline's resources: cores P and C, two torch threads
  serial_1_thread_2_cores   the same loop on cores P and C with one thread (the OS picks the idler core;
                        on small shapes or a loaded VM one thread beats two: bench.pipeline takes the faster)
  heavy_producer_alone, heavy_consumer_alone   the same for the heavy_target setting
A {"co_run": VARIANT, "start_at": T, "seconds": S, "hold_s": H} line runs one variant round and round from
monotonic time T, while a partner process (started with --assets-built) runs another on the other core:
bench.pipeline's co-run, the two stages at the same time with no communication between them.
Wall time (perf_counter) gives tokens_per_s; process CPU time gives cpu_tokens_per_s, the rate with a
core to itself, to tell the stage's cost from the other tenants' load.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from bench.pipeline import TARGET_SHAPE
from common.config import JobConfig, load_job
from common.host_memory import keep_freed_memory
from consumer.build import new_trainer as build_trainer
from consumer.build import target_layer_ids  # noqa: F401 (the rule bench shares with production; tested here)
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer
from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer, write_jsonl
from producer.build import build_dataset, load_job_target
from producer.prefetch import PackedBatch, pack_batch
from producer.target import TargetCapture


def build_assets(root: Path, chats: int) -> None:
    """Tokenizer (trained on a fixed corpus), target and `chats` records of data, as the job files expect."""
    tok = train_tokenizer(corpus_texts(synthetic_chats(600, seed=0)), 2000, root / "tokenizer")
    shape = TARGET_SHAPE
    build_tiny_target(
        root / "target",
        tok,
        hidden_size=shape["hidden_size"],
        num_layers=shape["num_layers"],
        heads=shape["heads"],
        kv_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        intermediate_size=shape["intermediate_size"],
        vocab_size=shape["vocab_size"],
    )
    write_jsonl(root / "chats.jsonl", synthetic_chats(chats, seed=1))


def new_trainer(job: JobConfig, drafter: str) -> Trainer:
    """As the consumer builds it (consumer/build.py), on the drafter's first device (the CPU when it names none)."""
    torch.manual_seed(job.job.seed)
    cfg = job.drafter(drafter)
    device = torch.device(cfg.devices[0] if cfg.devices else "cpu")
    trainer = build_trainer(job, cfg, load_target_parts(job.target.path), device)
    trainer.warmup()
    return trainer


def on_device(batch: PackedBatch, device: torch.device) -> PackedBatch:
    """The batch as a consumer holds it after copy-out: tokens on its device, cu_seqlens and loss_mask on the host."""
    if device.type == "cpu":
        return batch
    moved = {k: getattr(batch, k).to(device) for k in ("input_ids",)}
    return dataclasses.replace(batch, **moved)


@dataclass
class JobStages:
    """One job's batches, its target (with a slot-sized output buffer) and two trainers; CPU or CUDA, as
    the job's target.device and the drafter's devices say (bench.gpu_check runs it on a GPU)."""

    batches: list[PackedBatch]
    drafter_batches: list[PackedBatch]  # the same, on the drafter's device
    target: TargetCapture
    buffer: torch.Tensor  # [tokens_per_batch, n·H]: stands in for the ring slot
    features: list[torch.Tensor]  # captured once, for the consumer fed from memory
    alone: Trainer
    serial: Trainer | None  # the serial loop's own trainer; None where no serial variant runs (bench.gpu_check)

    @classmethod
    def load(cls, job: JobConfig, serial: bool = True) -> JobStages:
        dataset, plan = build_dataset(job, node_rank=0, nnodes=1)
        reader = dataset.reader()
        batches = [pack_batch(reader, planned) for planned in plan.batches_from(0)]
        reader.close()
        target = load_job_target(job, job.target.device)
        buffer = torch.empty(job.data.tokens_per_batch, target.feature_width, dtype=target.dtype, device=target.device)
        first = job.drafters[0].name
        alone = new_trainer(job, first)
        # cloned outside inference mode: the trainer's autograd cannot save inference tensors
        features = [target(b.input_ids, b.cu_seqlens).to(alone.device).clone() for b in batches]
        drafter_batches = [on_device(b, alone.device) for b in batches]
        return cls(
            batches, drafter_batches, target, buffer, features, alone, new_trainer(job, first) if serial else None
        )

    def forward(self, k: int) -> torch.Tensor:
        b = self.batches[k]
        return self.target(b.input_ids, b.cu_seqlens, out=self.buffer[: b.num_tokens])

    def train(self, trainer: Trainer, k: int, hidden: torch.Tensor) -> None:
        b = self.drafter_batches[k]
        trainer.train_batch(hidden, b.input_ids, b.loss_mask, b.cu_seqlens, b.seq)

    def variants(self) -> dict[str, tuple[Callable[[int], object], str]]:
        """name → (run batch k, where: 'P' target-side core, 'C' drafter-side core, 'PC1'/'PC2' both
        cores with one/two torch threads)."""
        alone = {
            "producer_alone": (self.forward, "P"),
            "consumer_alone": (lambda k: self.train(self.alone, k, self.features[k]), "C"),
        }
        if self.serial is None:
            return alone
        serial = lambda k: self.train(self.serial, k, self.forward(k).to(self.serial.device))  # noqa: E731
        return {
            **alone,
            "serial": (serial, "P"),
            "serial_2_threads": (serial, "PC2"),
            "serial_1_thread_2_cores": (serial, "PC1"),
        }


def time_variant(run: Callable[[int], object], ks: range, cores: set[int], threads: int = 0) -> dict[str, float]:
    """Run batches `ks` on `cores` with `threads` torch threads (default one per core); wall and process CPU
    seconds (on a GPU the queued work is waited for before the clocks are read, once, not per batch)."""
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads or len(cores))
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        for k in ks:
            run(k)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
    finally:
        torch.set_num_threads(1)


def co_run(
    run: Callable[[int], object],
    ks: range,
    tokens: list[int],
    cores: set[int],
    threads: int,
    start_at: float,
    seconds: float,
    hold_s: float,
) -> dict[str, float]:
    """Batches `ks` round and round from monotonic time `start_at` (the partner process starts its own loop at
    the same instant on the other core): the rate over the batches that end within `seconds`, then more
    batches, untimed, until `seconds + hold_s`, so the partner's last timed batch still runs against load."""
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    try:
        time.sleep(max(0.0, start_at - time.monotonic()))
        wall, cpu, done, cpu_done, tok = time.monotonic(), time.process_time(), 0.0, 0.0, 0
        for k in itertools.cycle(ks):
            run(k)
            now = time.monotonic()
            if now - wall <= seconds:
                done, cpu_done, tok = now - wall, time.process_time() - cpu, tok + tokens[k]
            elif now - wall > seconds + hold_s:
                break
        if tok == 0:
            raise SystemExit(f"bench.pipeline_stages: no batch finished within the co-run's {seconds:.1f} s")
        return {"tokens_per_s": tok / done, "cpu_tokens_per_s": tok / cpu_done}
    finally:
        torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--assets", type=Path, required=True)
    p.add_argument("--chats", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--cores", required=True, help="P,C: the target-side and drafter-side cpu ids")
    p.add_argument("--assets-built", action="store_true", help="the assets exist (a co-run partner's start)")
    p.add_argument("jobs", nargs="+", help="NAME=JOB.toml for 'balanced' and 'heavy_target' (a partner: 'balanced')")
    args = p.parse_args(argv)
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything a library prints goes to stderr
    sys.stdout = sys.stderr
    torch.set_num_threads(1)
    keep_freed_memory()  # as the producer and consumer processes do on the CPU
    transformers.logging.set_verbosity_error()
    core_p, core_c = (int(c) for c in args.cores.split(","))
    both = {core_p, core_c}
    where = {"P": ({core_p}, 1), "C": ({core_c}, 1), "PC1": (both, 1), "PC2": (both, len(both))}
    jobs = {name: load_job(path) for name, path in (j.split("=", 1) for j in args.jobs)}
    if not args.assets_built:
        build_assets(args.assets, args.chats)
    settings = {name: JobStages.load(job) for name, job in jobs.items()}
    variants = {}
    for name, s in settings.items():
        prefix = "" if name == "balanced" else "heavy_"
        variants.update({prefix + v: run for v, run in s.variants().items() if not (prefix and v.startswith("serial"))})
    n = len(settings["balanced"].batches)
    if any(len(s.batches) != n for s in settings.values()):
        raise SystemExit("bench.pipeline_stages: the two settings' plans differ; they must read the same data")
    if n <= args.warmup:
        raise SystemExit(f"bench.pipeline_stages: the plan has {n} batches, no more than --warmup {args.warmup}")
    for run, place in variants.values():
        time_variant(run, range(args.warmup), *where[place])
    timed = range(args.warmup, n)
    tokens = sum(settings["balanced"].batches[k].num_tokens for k in timed)
    answer(protocol, {"ready": True, "batches": n, "timed_tokens": tokens})
    names = list(variants)
    token_counts = [b.num_tokens for b in settings["balanced"].batches]
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        if "co_run" in request:
            run, place = variants[request["co_run"]]
            answer(
                protocol,
                co_run(
                    run, timed, token_counts, *where[place], request["start_at"], request["seconds"], request["hold_s"]
                ),
            )
            continue
        rep = int(request["rep"])
        times = {}
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            run, place = variants[name]
            times[name] = time_variant(run, timed, *where[place])
        answer(
            protocol,
            {
                "tokens_per_s": {k: tokens / t["wall_s"] for k, t in times.items()},
                "cpu_tokens_per_s": {k: tokens / t["cpu_s"] for k, t in times.items()},
            },
        )


def answer(protocol, obj: dict) -> None:
    protocol.write(json.dumps(obj) + "\n")
    protocol.flush()


if __name__ == "__main__":
    main()
