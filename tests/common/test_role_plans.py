"""The dry run's one plan process per role (common/role_plans.py): launch_plan starts exactly the two roles'
`plan` commands, side by side, and renders both sections from their lines; a role's `plan` prints what its
`memory-plan --json` and `throughput-plan` print; a failing or hung role names itself in both sections."""

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from transformers import Qwen3Config

from bench.harness import write_job
from common.memory_plan import ProcessMemory
from common.role_plans import RolePlans, parse_plan_lines, run_role_plans
from common.throughput_plan import Work
from consumer import dry_run_plan as consumer_plan
from consumer import memory_plan as consumer_memory
from consumer import throughput_plan as consumer_throughput
from producer import dry_run_plan as producer_plan
from producer import memory_plan as producer_memory
from producer import throughput_plan as producer_throughput

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy/examples/qwen3-8b-8xh200.toml"  # a GPU job: target on cuda:0, drafters on cuda:1-7
EXAMPLE_CONFIG = ROOT / "deploy/examples/configs/qwen3-8b"

PRODUCER_LINES = [
    {"memory": {"process": "producer", "device": "cuda:0", "parts": {"weights": 2**30}}},
    {"work": {"stage": "target forward", "processes": 1, "parts": {"forward": ["flops", 1e12]}}},
]
CONSUMER_LINES = [
    {"memory": {"process": "consumer-b16-r0", "device": "cuda:1", "parts": {"train_step": 2 * 2**30}}},
    {"work": {"stage": "drafter b16", "processes": 1, "parts": {"forward": ["flops", 2e12]}}},
]


def stub_python(tmp_path: Path, consumer: str = "ok") -> tuple[Path, Path]:
    """A PYTHON for launch_plan that logs each command it is given and answers each role's `plan` with canned
    lines (no torch import); `consumer` "fail" makes the consumer's exit 1 with a reason, "hang" sleep."""
    log = tmp_path / "argv.log"
    lines = {r: "\n".join(json.dumps(x) for x in v) for r, v in (("p", PRODUCER_LINES), ("c", CONSUMER_LINES))}
    consumer_case = {
        "ok": f"printf '%s\\n' '{lines['c']}'",
        "fail": "echo 'a traceback line' >&2; echo 'consumer plan: cannot plan b16' >&2; exit 1",
        "hang": "exec sleep 60",
    }[consumer]
    stub = tmp_path / "python"
    stub.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {log}\n'
        'case "$2" in\n'
        f"  producer) printf '%s\\n' '{lines['p']}' ;;\n"
        f"  consumer) {consumer_case} ;;\n"
        "esac\n"
    )
    stub.chmod(0o755)
    return stub, log


def dry_run(python: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "common.launch_plan", str(EXAMPLE), "--device-map", "--memory"]
    command += ["--python", str(python), "--target-config", str(EXAMPLE_CONFIG), "--device", "h200"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_dry_run_of_a_gpu_job_starts_one_plan_process_per_role_and_renders_both_sections(tmp_path):
    stub, log = stub_python(tmp_path)
    proc = dry_run(stub)
    assert proc.returncode == 0, proc.stderr
    tail = f"{EXAMPLE} --sample-tokens 540 --target-config {EXAMPLE_CONFIG}"  # 540: the published run's mean
    assert sorted(log.read_text().splitlines()) == [f"-m consumer plan {tail}", f"-m producer plan {tail}"]
    out = proc.stdout.splitlines()
    memory = out.index(
        "planned GPU memory per device (peak; fake-tensor run of the real code, see common/memory_plan.py):"
    )
    assert out[memory + 1 : memory + 5] == [
        "  cuda:0: 1.0 GiB",
        "      producer                    1.0 GiB  weights 1.0 GiB",
        "  cuda:1: 2.0 GiB",
        "      consumer-b16-r0             2.0 GiB  train_step 2.0 GiB",
    ]
    rows = [ln.split()[:3] for ln in out if ln.startswith(("  target forward", "  drafter b16"))]
    assert rows == [["target", "forward", "1"], ["drafter", "b16", "1"]]
    # 1 TFLOP and 2 TFLOP at 45 % of 989 TFLOP/s: the drafter is the slower stage
    assert out[-2].startswith("bottleneck: drafter b16 at 222.52 batches/s"), out[-2]


def test_a_failing_role_plan_makes_both_sections_name_it(tmp_path):
    stub, log = stub_python(tmp_path, consumer="fail")
    proc = dry_run(stub)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-2:] == [
        "planned GPU memory: not available: consumer plan: cannot plan b16",
        "planned throughput: not available: consumer plan: cannot plan b16",
    ]
    assert len(log.read_text().splitlines()) == 2


def test_a_role_plan_past_the_timeout_is_killed_and_named(tmp_path):
    stub, _ = stub_python(tmp_path, consumer="hang")
    plans = run_role_plans(str(stub), str(EXAMPLE), None, 540, timeout_s=2)
    assert plans == RolePlans(failure="consumer plan took over 2 s")


def test_plan_lines_round_trip_memory_entries_and_work():
    entry = ProcessMemory("producer", "cuda:0", {"weights": 5, "ring": 7})
    work = Work("drafter b8", 2, {"optimizer": ("flops", 3.0)}, "note", 2.0, ("optimizer",))
    plans = RolePlans()
    parse_plan_lines(f"noise\n{json.dumps({'memory': asdict(entry)})}\n{work.to_json()}\n", plans)
    assert plans == RolePlans([entry], [work])


def test_a_roles_plan_prints_its_memory_plan_and_throughput_plan_lines(tmp_path, capsys):
    """One process, the same items: `plan` is memory-plan --json's entries and throughput-plan's stages."""
    target = tmp_path / "target"
    Qwen3Config(
        num_hidden_layers=4,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ).save_pretrained(target)
    job = write_job(
        tmp_path / "job.toml",
        {
            "job": {"name": "plans", "run_dir": str(tmp_path / "run")},
            "target": {"path": str(target), "device": "cuda:0", "layer_ids": [0, 2], "num_features": 2},
            "data": {"path": str(tmp_path / "d.jsonl"), "max_length": 64, "tokens_per_batch": 256},
            "transport": {"kind": "cuda", "slots": 2},
            "drafters": [{"name": "d", "block_size": 4, "num_layers": 1, "devices": ["cuda:1"]}],
        },
    )
    args = [str(job), "--sample-tokens", "32"]
    for plan, memory, throughput in (
        (producer_plan, producer_memory, producer_throughput),
        (consumer_plan, consumer_memory, consumer_throughput),
    ):
        assert memory.main([str(job), "--json"]) == 0
        entries = [ProcessMemory.from_json(ln) for ln in capsys.readouterr().out.splitlines()]
        assert throughput.main(args) == 0
        works = [Work.from_json(ln) for ln in capsys.readouterr().out.splitlines()]
        assert entries and works
        assert plan.main(args) == 0
        both = RolePlans()
        parse_plan_lines(capsys.readouterr().out, both)
        assert both == RolePlans(entries, works)
