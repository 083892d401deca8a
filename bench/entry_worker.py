"""A long-lived process for bench.pipeline: runs the producer's or consumer's entry point on request.

    python -m bench.entry_worker CORES [MODULE...]     (MODULEs are imported ahead, e.g. producer.__main__)

The process pins itself to CORES and sets one torch thread (OMP_NUM_THREADS=1, torch.set_num_threads(1))
before anything starts a thread, so every thread it ever runs inherits both. Then each stdin line
{"module": "consumer.__main__", "argv": [...], "log": PATH} runs that module's `main(argv)`, the same
function `python -m consumer` runs, with stdout and stderr sent to PATH, and answers {"rc": N} on stdout.
A run pays no interpreter or import start-up, only what `main` itself does (load the job, the target
or the drafter, attach the ring). {"quit": true} or the end of stdin ends the process.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import traceback
from pathlib import Path


@contextlib.contextmanager
def output_to(log: Path):
    """fds 1 and 2 (and so every print and logging handler) write to `log` while a run lasts."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log, "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)


def run(request: dict) -> int:
    with output_to(Path(request["log"])):
        try:
            return int(importlib.import_module(request["module"]).main(request["argv"]) or 0)
        except SystemExit as err:  # argparse and friends
            return err.code if isinstance(err.code, int) else 1
        except Exception:
            traceback.print_exc()
            return 1


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m bench.entry_worker CORES [MODULE...]   (CORES: comma-separated cpu ids)")
    try:
        cores = {int(c) for c in argv[0].split(",")}
    except ValueError:
        raise SystemExit(f"bench.entry_worker: CORES must be comma-separated cpu ids, got {argv[0]!r}") from None
    os.environ["OMP_NUM_THREADS"] = "1"
    os.sched_setaffinity(0, cores)
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # between runs, stray prints go to stderr, never into the protocol
    import torch

    torch.set_num_threads(1)
    for module in argv[1:]:
        importlib.import_module(module)
    answer(protocol, {"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        answer(protocol, {"rc": run(request)})


def answer(protocol, obj: dict) -> None:
    protocol.write(json.dumps(obj) + "\n")
    protocol.flush()


if __name__ == "__main__":
    main()
