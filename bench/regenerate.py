"""Regeneration through an OpenAI-compatible server: records/s with 8 requests in flight vs 1.

    .venv/bin/python -m bench.regenerate [--json] [--records N] [--max-new-tokens N] [--quick]

Target: a random Qwen3 (hidden 256, 8 layers, vocab 16,384, fp32) behind `transformers serve` on the CPU
(transformers' own OpenAI-compatible server, started here, offline). Prompts: synthetic single- and
multi-turn chats. Each run is `python -m producer regenerate --server ... --concurrency C` in its own
process on a fresh output file, the server already warm; what is timed is the command's own clock, from
its model lookup to its last record written (every request and write; not the interpreter's start-up), as
its final progress line reports it. `server_concurrency_speedup` = records/s at concurrency 8 ÷ records/s
at concurrency 1: what the client's concurrency buys from the server. `transformers serve` without
`--continuous-batching` runs one `generate` at a time on a single inference thread, so requests in flight
only queue there and the speedup stays near 1 by construction; `server_concurrency_speedup_cb` is the same
ratio with `--continuous-batching` (requests in flight decode together, as vLLM and SGLang do), which is
where the concurrency pays. `--quick` skips the continuous-batching server.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import harness
from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer, write_jsonl


class TransformersServe:
    """`transformers serve MODEL_DIR` on a free loopback port, offline (HF_HUB_OFFLINE=1), as a context manager.

    The model directory is the positional FORCE_MODEL argument, so it is loaded at start and served
    under its path as the model id; `--port` is fixed at start, so a free port is picked first.
    """

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        threads: int | None = None,
        start_timeout_s: float = 180.0,
        continuous_batching: bool = False,
    ):
        self.model_dir, self.log_path, self.start_timeout_s = Path(model_dir), Path(log_path), start_timeout_s
        self.threads = threads
        self.continuous_batching = continuous_batching
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> TransformersServe:
        self.port = harness.free_port()
        cli = Path(sys.executable).with_name("transformers")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        cmd = [str(cli), "serve", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
               "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]  # fmt: skip
        if self.continuous_batching:
            cmd.append("--continuous-batching")
        self.log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"transformers serve not healthy within {self.start_timeout_s:.0f} s: {self.tail()}")

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        if getattr(self, "log", None):
            self.log.close()

    def __enter__(self) -> TransformersServe:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_regenerate(url: str, prompts: Path, out: Path, concurrency: int, max_new_tokens: int) -> float:
    """Records/s of one `producer regenerate --server` command over every prompt, by its own clock."""
    cmd = [sys.executable, "-m", "producer", "regenerate", "--server", url, "--prompts", str(prompts),
           "--out", str(out), "--concurrency", str(concurrency), "--max-new-tokens", str(max_new_tokens),
           "--progress-interval", "1000"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"regenerate exited {proc.returncode}: {proc.stderr[-2000:]}")
    progress = [line for line in proc.stdout.splitlines() if " records/s" in line][-1]
    return float(progress.split(" records/s")[0].rsplit(" ", 1)[1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--records", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="8 records, 8 new tokens")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the server is stopped on the way out
    if args.quick:
        args.records, args.max_new_tokens = 8, 8
    with tempfile.TemporaryDirectory(prefix="bench-regenerate-") as tmp:
        root = Path(tmp)
        tok = train_tokenizer(corpus_texts(synthetic_chats(200)), 2000, root / "tok")
        model_dir = build_tiny_target(
            root / "model", tok, hidden_size=256, num_layers=8, heads=4, kv_heads=2, head_dim=64,
            intermediate_size=768, vocab_size=16384,
        )  # fmt: skip
        prompts = write_jsonl(root / "prompts.jsonl", synthetic_chats(args.records, seed=4, max_turns=2))
        warm = write_jsonl(root / "warm-prompts.jsonl", synthetic_chats(2, seed=5))
        rates = {}
        for cb in (False,) if args.quick else (False, True):
            tag = "cb" if cb else "plain"
            with TransformersServe(model_dir, root / f"serve-{tag}.log", continuous_batching=cb) as server:
                run_regenerate(server.url, warm, root / f"warm-{tag}.jsonl", 2, args.max_new_tokens)  # first calls
                rates[tag] = {}
                for c in (1, 8):
                    out = root / f"{tag}-c{c}.jsonl"
                    rates[tag][c] = run_regenerate(server.url, prompts, out, c, args.max_new_tokens)
                    written = len(out.read_text().splitlines())
                    if written != args.records:
                        raise RuntimeError(f"{tag} concurrency {c}: {written} records, expected {args.records}")
    result = {
        "server": "transformers serve, cpu fp32",
        "target": "qwen3 h256 L8 vocab16384",
        "records": args.records,
        "max_new_tokens": args.max_new_tokens,
        "cpu_cores": os.cpu_count(),
        "records_per_s_c1": round(rates["plain"][1], 3),
        "records_per_s_c8": round(rates["plain"][8], 3),
        "server_concurrency_speedup": round(rates["plain"][8] / rates["plain"][1], 3),
    }
    if "cb" in rates:
        result |= {
            "records_per_s_c1_cb": round(rates["cb"][1], 3),
            "records_per_s_c8_cb": round(rates["cb"][8], 3),
            "server_concurrency_speedup_cb": round(rates["cb"][8] / rates["cb"][1], 3),
        }
    for tag, rate in rates.items():
        name = "continuous batching" if tag == "cb" else "one generate at a time"
        print(
            f"regenerate via transformers serve ({name}): {rate[1]:.3f} records/s at concurrency 1,"
            f" {rate[8]:.3f} at 8: speedup {rate[8] / rate[1]:.2f}x"
        )
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
