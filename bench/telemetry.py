"""What observability costs a training step: timer use, one publish, and a step loop with it on vs off.

    .venv/bin/python -m bench.telemetry [--json] [--rounds N]

The step loop is a small MLP forward/backward/optimizer step (~ms on a CPU core). "on" wraps each
phase in a ProfileStats timer, counts tokens, sets a gauge and calls maybe_publish every step
(interval 1 s, a live subscriber in another process draining the socket); "off" holds prof None.
Blocks of on and off steps alternate in one run, so drift of a shared machine hits both alike;
`overhead_pct` compares this thread's CPU time (noise from other processes stays out of it).
`overhead_est_pct` is the same figure from warm-cache unit costs: a lower bound, since after CPU
kernels have streamed through the caches each bookkeeping call costs several times its warm price.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import torch

from common.profile import ProfileStats
from common.stats import StatsPublisher

TIMERS_PER_STEP = 4  # data, forward, backward, optimizer
SUBSCRIBER = textwrap.dedent(
    """
    import sys, zmq
    sock = zmq.Context().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"stats.")
    sock.bind(sys.argv[1])
    print("ready", flush=True)
    n = 0
    while sock.poll(30_000):
        sock.recv_multipart()
        n += 1
    """
)
_NULL = contextlib.nullcontext()


def per_call_ns(fn, n: int, repeats: int = 7) -> float:
    """Median over repeats of the mean cost of one fn() call."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter_ns() - t0) / n)
    return statistics.median(samples)


def bench_profile_ns(n: int) -> dict[str, float]:
    prof = ProfileStats()
    empty = per_call_ns(lambda: None, n)

    def timer_use():
        with prof.timer("forward"):
            pass

    return {
        "profile_add_ns": per_call_ns(lambda: prof.add("forward", 1e-3), n) - empty,
        "profile_timer_ns": per_call_ns(timer_use, n) - empty,
        "profile_count_ns": per_call_ns(lambda: prof.count("tokens", 128), n) - empty,
    }


def realistic_profile() -> ProfileStats:
    """~28 timers, a few counters and gauges: the size of a consumer's snapshot."""
    prof = ProfileStats()
    for i in range(28):
        prof.add(f"phase_{i}", 1e-3)
    for key in ("tokens", "anchors", "batches", "steps"):
        prof.count(key, 100)
    for key in ("loss", "lr", "grad_norm", "tau_est", "acc_slot_1", "acc_slot_2"):
        prof.gauge(key, 0.5)
    return prof


class Workload:
    """A small MLP step: forward, backward, optimizer; timers around each phase when prof is set."""

    def __init__(self, width: int, batch: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width)
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.width, self.batch = width, batch

    def step(self, prof: ProfileStats | None, pub: StatsPublisher | None, step: int) -> None:
        def timer(key):
            return prof.timer(key) if prof else _NULL

        with timer("data"):
            x = torch.randn(self.batch, self.width)
        with timer("forward"):
            loss = self.model(x).square().mean()
        with timer("backward"):
            loss.backward()
        with timer("optimizer"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        if prof:
            prof.count("tokens", self.batch)
            prof.gauge("lr", 1e-3)
            pub.maybe_publish(step=step)


def bench_overhead(rounds: int, block: int, endpoint: str) -> dict[str, float]:
    """Each round times `block` steps of each variant: on, off, and off again (an A/A control that
    shows the noise floor), rotating their order so no variant owns a position. Overhead = total
    time on / total time off - 1 (amortised: publishes count at their real rate), on this thread's
    CPU clock (what the step itself spends; other tenants of a shared machine stay out of it) and on
    the wall clock."""
    work = Workload(width=384, batch=64)
    prof = ProfileStats()
    # "on" runs a third of the wall time: publishing every 3 s of wall time is once a second of its own
    pub = StatsPublisher(endpoint, "consumer", "bench_r0", 3.0, prof)
    for i in range(block):  # warm up allocator and caches
        work.step(None, None, i)
    variants = {"on": (prof, pub), "off": (None, None), "off_again": (None, None)}
    names = list(variants)
    cpu = dict.fromkeys(names, 0.0)
    wall = dict.fromkeys(names, 0.0)
    step = 0
    for r in range(rounds):
        for name in names[r % 3 :] + names[: r % 3]:
            p, q = variants[name]
            c0, w0 = time.thread_time(), time.perf_counter()
            for _ in range(block):
                step += 1
                work.step(p, q, step)
            cpu[name] += time.thread_time() - c0
            wall[name] += time.perf_counter() - w0
    published = pub.seq
    pub.close(final=False)
    steps = rounds * block
    return {
        "step_ms": 1e3 * wall["off"] / steps,
        "step_on_ms": 1e3 * wall["on"] / steps,
        "overhead_pct": 100.0 * (cpu["on"] / cpu["off"] - 1.0),
        "noise_pct": 100.0 * (cpu["off_again"] / cpu["off"] - 1.0),
        "overhead_wall_pct": 100.0 * (wall["on"] / wall["off"] - 1.0),
        "noise_wall_pct": 100.0 * (wall["off_again"] / wall["off"] - 1.0),
        "publishes": published,
        "steps_on": steps,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench.telemetry", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--rounds", type=int, default=150, help="rounds of (on, off, off) blocks")
    ap.add_argument("--block", type=int, default=20, help="steps per block")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        endpoint = f"ipc://{d}/in.sock"
        sub = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, endpoint], stdout=subprocess.PIPE, text=True)
        try:
            sub.stdout.readline()  # bound: the subscriber prints at once or dies
            result = bench_profile_ns(200_000)
            prof = realistic_profile()
            pub = StatsPublisher(endpoint, "consumer", "bench_pub", 0.0, prof)
            result["publish_us"] = per_call_ns(pub.publish, 500, repeats=5) / 1e3
            pub.close(final=False)
            result.update(bench_overhead(args.rounds, args.block, endpoint))
        finally:
            sub.kill()
            sub.wait()
    per_step_ns = TIMERS_PER_STEP * result["profile_timer_ns"] + 2 * result["profile_count_ns"]
    publish_share_ns = 1e3 * result["publish_us"] / max(1.0, 1e3 / result["step_ms"])  # one publish a second
    result["overhead_est_pct"] = 100.0 * (per_step_ns + publish_share_ns) / (1e6 * result["step_ms"])
    print(f"timer use           {result['profile_timer_ns']:8.0f} ns   (target <= 2000)")
    print(f"prof.add            {result['profile_add_ns']:8.0f} ns")
    print(f"publish (28 timers) {result['publish_us']:8.1f} us")
    print(f"step off / on       {result['step_ms']:.3f} ms / {result['step_on_ms']:.3f} ms")
    noise = f"A/A noise {result['noise_pct']:+.2f} %"
    print(f"overhead, CPU clock {result['overhead_pct']:+.2f} %  (target <= 1; {noise})")
    print(f"overhead, wall      {result['overhead_wall_pct']:+.2f} %  (A/A noise {result['noise_wall_pct']:+.2f} %)")
    print(f"overhead estimated  {result['overhead_est_pct']:.3f} %  (unit costs × uses per step)")
    if args.json:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
