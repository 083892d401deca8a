"""CPU time a waiting thread burns: time.process_time() over the wait's wall time, per way of waiting (issue 34
§3: the host's waits must leave the cores to the tokenizer prefetch, telemetry and the channel's I/O thread).

    python -m bench.wait_cpu [--wait-s 0.5] [--repeats 5]       one JSON line per measurement

Host (any machine): a flag another thread sets after `wait_s`, looked at
  spin       again at once (what the default CUDA event's synchronize does while its kernel runs),
  fixed_0.5  after a 0.5 ms blocking queue wait each time (the producer's former is_written poll),
  backoff    after common.backoff.Backoff's delays, 50 us doubling to 1 ms (the producer's poll now).
CUDA (where a GPU is): a host wait on an event recorded behind a `wait_s` kernel, as CopyOut.copy() waits for
its copy streams: torch.cuda.Event() (before) against torch.cuda.Event(blocking=True) (what it records now).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time
from collections.abc import Callable

from common.backoff import Backoff


def cpu_share(wait: Callable[[], None]) -> float:
    """process_time over wall time of one wait (the process's other threads sleep meanwhile)."""
    cpu, wall = time.process_time(), time.perf_counter()
    wait()
    return (time.process_time() - cpu) / (time.perf_counter() - wall)


def host_wait(mode: str, wait_s: float) -> float:
    done = threading.Event()
    inbox: queue.Queue = queue.Queue()  # stands in for the channel's inbox, served while polling
    timer = threading.Timer(wait_s, done.set)

    def spin() -> None:
        while not done.is_set():
            pass

    def fixed() -> None:
        while not done.is_set():
            try:
                inbox.get(timeout=0.0005)
            except queue.Empty:
                pass

    def backoff() -> None:
        delays = Backoff()
        while not done.is_set():
            try:
                inbox.get(timeout=delays.next())
            except queue.Empty:
                pass

    timer.start()
    try:
        return cpu_share({"spin": spin, "fixed_0.5": fixed, "backoff": backoff}[mode])
    finally:
        timer.cancel()


def cuda_wait(blocking: bool, wait_s: float) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    cycles = int(1_000_000 * wait_s / (time.perf_counter() - start))  # _sleep's cycles for wait_s
    torch.cuda._sleep(cycles)
    event = torch.cuda.current_stream().record_event(torch.cuda.Event(blocking=blocking))
    return cpu_share(event.synchronize)


def measure(wait_s: float, repeats: int) -> list[dict]:
    """The median share of each way over `repeats` waits, and each way's share over spinning's."""
    out = []
    rows = {
        m: statistics.median(host_wait(m, wait_s) for _ in range(repeats)) for m in ("spin", "fixed_0.5", "backoff")
    }
    out += [
        {"wait": "host", "mode": m, "cpu_over_wall": round(v, 4), "over_spin": round(v / rows["spin"], 4)}
        for m, v in rows.items()
    ]
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if gpu:
        ev = {b: statistics.median(cuda_wait(b, wait_s) for _ in range(repeats)) for b in (False, True)}
        out += [
            {
                "wait": "cuda_event",
                "mode": "blocking" if b else "default",
                "cpu_over_wall": round(v, 4),
                "over_default": round(v / ev[False], 4),
            }
            for b, v in ev.items()
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.wait_cpu", description=__doc__.splitlines()[0])
    ap.add_argument("--wait-s", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    for row in measure(args.wait_s, args.repeats):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
