"""The process list of a job, derived from the job file alone (launch.sh and systemd read it from here).

    python -m common.launch_plan JOB.toml [--node-rank R --nnodes N --master-addr HOST --master-port PORT]
                                    [--check-target]   and first: is target.path a model folder (launch.sh)
    python -m common.launch_plan JOB.toml --device-map    which process on which device (launch.sh --dry-run)
    python -m common.launch_plan JOB.toml --device-map --memory [--device-memory GIB] [--target-config DIR]
                                    and each device's planned GPU memory peak (common/memory_plan.py);
                                    exit 3 when a device is planned over its memory
                                    then each stage's time per batch, the bottleneck and samples/s
                                    [--device h100|h200] [--sample-tokens N] (common/throughput_plan.py);
                                    both from one `plan` process per role (common/role_plans.py)
    python -m common.launch_plan JOB.toml --env-files DIR   systemd: one environment file per process, units to enable

Each line: `name critical log_path command...` separated by tabs, the command's words shell-quoted.

A drafter whose replicas × nnodes > 1 trains as one torch.distributed group: each of its consumers gets
torchrun's variables, prefixed to its command as `env K=V ...` (so launch.sh and systemd need nothing new):
MASTER_ADDR, MASTER_PORT = the base port + the drafter's index in the job (one rendezvous per drafter),
WORLD_SIZE = replicas × nnodes, RANK = node_rank × replicas + replica, LOCAL_RANK = replica,
LOCAL_WORLD_SIZE = replicas, GROUP_RANK = node_rank. Every node must be given the same base port and the
address of node 0 (defaults: $MASTER_ADDR or 127.0.0.1 on one node, $MASTER_PORT or 29500).

Target replicas: one producer per replica (`producer`, `producer-p1`, ...; `--replica p`). A target with
tp_size = N > 1 makes each of them N processes (`producer-p1`, `producer-p1-tp1`, ...; producer/tp.py), a
torch.distributed group on this node: MASTER_ADDR 127.0.0.1, MASTER_PORT = base + number of drafters + p,
WORLD_SIZE = N, RANK = k, LOCAL_RANK = the CUDA index of target.devices[k] (transformers binds cuda:LOCAL_RANK),
or k on the CPU. With target.ep_size = N the same group is also the expert-parallel group (the device map
says which slice of the experts each rank holds); no other variables are needed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ConfigError, DrafterConfig, JobConfig, load_job
from common.memory_plan import GIB, ProcessMemory, nvml_device_bytes, render
from common.role_plans import RolePlans, run_role_plans
from common.target_probe import target_files_problem
from common.throughput_plan import DEVICES, sample_length, throughput_report

DEFAULT_MASTER_PORT = 29500  # torchrun's


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    argv: list[str]
    critical: bool  # its death tears the job down; telemetry's does not (it is restarted)
    log: str
    env: dict[str, str] = field(default_factory=dict)  # set for this process only

    @property
    def command(self) -> list[str]:
        """argv with the process's own environment in front (`env K=V ... argv`)."""
        return ["env", *(f"{k}={v}" for k, v in self.env.items()), *self.argv] if self.env else self.argv


def group_env(
    drafter: DrafterConfig, index: int, replica: int, node_rank: int, nnodes: int, master_addr: str, master_port: int
) -> dict[str, str]:
    """torchrun's variables for one replica of the drafter at `index` in the job; none for a group of one."""
    world = drafter.replicas * nnodes
    if world == 1:
        return {}
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port + index),
        "WORLD_SIZE": str(world),
        "RANK": str(node_rank * drafter.replicas + replica),
        "LOCAL_RANK": str(replica),
        "LOCAL_WORLD_SIZE": str(drafter.replicas),
        "GROUP_RANK": str(node_rank),
    }


def producer_name(replica: int, rank: int = 0) -> str:
    """`producer`, `producer-p1`, ... for the target replicas; `-tp<k>` for rank k of a tensor-parallel group."""
    return "producer" + (f"-p{replica}" if replica else "") + (f"-tp{rank}" if rank else "")


def tp_env(job: JobConfig, replica: int, rank: int, port: int) -> dict[str, str]:
    """torchrun's variables for rank `rank` of target replica `replica`'s tensor-parallel group (one node,
    loopback); none without TP. LOCAL_RANK is the rank's CUDA device index (transformers binds
    cuda:LOCAL_RANK), else the rank."""
    tp = job.target.tp_size
    if tp == 1:
        return {}
    dev = job.target.devices_of(replica)[rank]
    local = dev.split(":")[1] if dev.startswith("cuda:") else str(rank)
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(tp),
        "RANK": str(rank),
        "LOCAL_RANK": local,
        "LOCAL_WORLD_SIZE": str(tp),
    }


def plan(
    job: JobConfig,
    job_path: str,
    python: str,
    node_rank: int = 0,
    nnodes: int = 1,
    master_addr: str = "127.0.0.1",
    master_port: int = DEFAULT_MASTER_PORT,
) -> list[ProcessSpec]:
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
    last = master_port + len(job.drafters) + job.target.replicas - 1
    if not 0 < master_port <= last <= 65535:
        raise ConfigError(
            f"--master-port {master_port}: the drafters' and the target groups' ports {master_port}.."
            f"{last} must lie in 1..65535"
        )
    logs = job.run_paths.logs
    node = ["--node-rank", str(node_rank), "--nnodes", str(nnodes)]
    procs = [
        ProcessSpec("telemetry", [python, "-m", "telemetry", "--job", job_path], False, str(logs / "telemetry.log")),
    ]
    replicas = job.target.replicas
    for p in range(replicas):
        which = ["--replica", str(p)] if replicas > 1 else []
        for rank in range(job.target.tp_size):
            name = producer_name(p, rank)
            procs.append(
                ProcessSpec(
                    name,
                    [python, "-m", "producer", "--job", job_path, *node, *which],
                    True,
                    str(logs / f"{name}.log"),
                    tp_env(job, p, rank, master_port + len(job.drafters) + p),
                )
            )
    for i, d in enumerate(job.drafters):
        for r in range(d.replicas):
            name = f"consumer-{d.name}-r{r}"
            procs.append(
                ProcessSpec(
                    name,
                    [python, "-m", "consumer", "--job", job_path, "--drafter", d.name, "--replica", str(r), *node],
                    True,
                    str(logs / f"{name}.log"),
                    group_env(d, i, r, node_rank, nnodes, master_addr, master_port),
                )
            )
    return procs


def device_map(job: JobConfig, node_rank: int = 0, nnodes: int = 1, master_port: int = DEFAULT_MASTER_PORT) -> str:
    """Which process runs on which device, the TP groups, and which producers feed which consumers (launch.sh
    --dry-run prints it). Planned from the job file alone: devices are strings, nothing needs a GPU."""
    t = job.target
    producers = [producer_name(p) for p in range(t.replicas)]
    rows = []
    for p in range(t.replicas):
        devs = t.devices_of(p)
        for k in range(t.tp_size):
            what = f"target replica {p}" + (f", TP rank {k} of {t.tp_size}" if t.tp_size > 1 else "")
            if t.ep_size > 1:
                what += f", EP rank {k} (expert slice {k}: 1/{t.ep_size} of each MoE layer's experts)"
            if k == 0:
                what += ": ring, control socket, delivery"
                if t.tp_size > 1:
                    what += f"; TP group on port {master_port + len(job.drafters) + p}"
            rows.append((producer_name(p, k), devs[k], what))
    for d in job.drafters:
        for r in range(d.replicas):
            rows.append(
                (
                    f"consumer-{d.name}-r{r}",
                    d.device_of(r),
                    f"drafter {d.name} (block {d.block_size}) replica {r} of {d.replicas}; fed by"
                    f" {', '.join(producers)}",
                )
            )
    rows.append(("telemetry", "-", f'one per machine; W&B run "node{node_rank}" in group "{job.job.name}"'))
    width = max(len(r[0]) for r in rows)
    dwidth = max(len(r[1]) for r in rows)
    target_devs = sorted({d for p in range(t.replicas) for d in t.devices_of(p)})
    drafter_devs = sorted({d.device_of(r) for d in job.drafters for r in range(d.replicas)})
    consumers = sum(d.replicas for d in job.drafters)
    lines = [f"device map of job {job.job.name}, node {node_rank} of {nnodes}:"]
    lines += [f"  {n:<{width}}  {dev:<{dwidth}}  {what}" for n, dev, what in rows]
    ep = f" (EP {t.ep_size}: each rank holds 1/{t.ep_size} of the experts whole)" if t.ep_size > 1 else ""
    lines.append(
        f"target: {t.replicas} replica(s) × TP {t.tp_size}{ep} = {t.replicas * t.tp_size} rank(s) on"
        f" {', '.join(target_devs)}; replica p makes batches p, p + {t.replicas}, ... of the node's plan"
    )
    lines.append(
        f"drafters: {consumers} replica(s) on {', '.join(drafter_devs)}; every one is fed by all"
        f" {t.replicas} producer(s) ({t.replicas} × {consumers} control connections and ring views)"
    )
    return "\n".join(lines)


EXIT_OVER_MEMORY = 3  # --memory: a device planned over its memory (the warnings name the process and the keys)


def on_gpu(job: JobConfig) -> bool:
    t = job.target
    devices = [d for r in range(t.replicas) for d in t.devices_of(r)]
    devices += [d.device_of(r) for d in job.drafters for r in range(d.replicas)]
    return any(d.startswith("cuda") for d in devices)


def missing_target_config(job: JobConfig, target_config: str | None) -> str | None:
    """Why the plans cannot read the target's config.json, said before the two plan processes start (seconds of
    CPU each) only to say the same; None when it is there, or when the path is a hub id the roles resolve."""
    path = Path(target_config or job.target.path)
    config = path if path.name == "config.json" else path / "config.json"
    if (path.is_absolute() or path.exists() or str(path).startswith(".")) and not config.is_file():
        return (
            f"{config}: not found (the plans need the target's config; pass --target-config DIR where the model"
            " is not on this machine)"
        )
    return None


def memory_report(entries: list[ProcessMemory], device_memory_gib: float | None) -> tuple[str, list[str]]:
    """The per-device planned peak of both roles' memory entries (the `{"memory": ...}` lines of their `plan`
    commands, common/role_plans.py), summed per device, and a warning per device over its memory."""
    default = int(device_memory_gib * GIB) if device_memory_gib else None
    return render(entries, nvml_device_bytes(), default)


def plans_report(job: JobConfig, job_path: str, python: str, args: argparse.Namespace) -> tuple[str, int]:
    """The dry run's planned GPU memory and throughput of a job on GPUs: one `plan` process per role, side by
    side, rendered as the two sections; and the exit code (EXIT_OVER_MEMORY when a device is planned over)."""
    missing = missing_target_config(job, args.target_config)
    sample = sample_length(job, args.sample_tokens)
    plans = RolePlans(failure=missing) if missing else run_role_plans(python, job_path, args.target_config, sample[0])
    if plans.failure:
        return (
            f"planned GPU memory: not available: {plans.failure}\nplanned throughput: not available: {plans.failure}",
            0,
        )
    table, warnings = memory_report(plans.memory, args.device_memory)
    lines = [table, *warnings, throughput_report(job, plans.works, sample, args.device, args.device_memory)]
    if warnings:
        lines.append(
            f"{len(warnings)} device(s) planned over their memory: the job does not fit (exit {EXIT_OVER_MEMORY})"
        )
    return "\n".join(lines), EXIT_OVER_MEMORY if warnings else 0


def systemd_instance(proc: ProcessSpec) -> str | None:
    """The unit a planned process runs as under deploy/systemd (None: telemetry, which needs no variables)."""
    if proc.name == "telemetry":
        return None
    if proc.argv[2] == "producer":
        replica = proc.argv[proc.argv.index("--replica") + 1] if "--replica" in proc.argv else "0"
        return f"producer@{replica}-{proc.env.get('RANK', '0')}"
    drafter, replica = proc.argv[proc.argv.index("--drafter") + 1], proc.argv[proc.argv.index("--replica") + 1]
    return f"consumer@{drafter}-{replica}"


def write_env_files(job: JobConfig, procs: list[ProcessSpec], folder: str) -> list[str]:
    """/etc/dflash/<role>-<instance>.env for every process (its group's variables, possibly none); returns the
    units to enable. One replica at tp_size 1 keeps the plain dflash-producer.service."""
    units = ["dflash-telemetry.service"]
    plain_producer = job.target.replicas == 1 and job.target.tp_size == 1
    for proc in procs:
        instance = systemd_instance(proc)
        if instance is None:
            continue
        role, name = instance.split("@")
        if role == "producer" and plain_producer:
            units.append("dflash-producer.service")
            continue
        path = os.path.join(folder, f"{role}-{name}.env")
        with open(path, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in proc.env.items()))
        units.append(f"dflash-{instance}.service")
    return units


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m common.launch_plan", description=__doc__.splitlines()[0])
    ap.add_argument("job")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--node-rank", type=int, default=int(os.environ.get("NODE_RANK", 0)))
    ap.add_argument("--nnodes", type=int, default=int(os.environ.get("NNODES", 1)))
    ap.add_argument(
        "--master-addr",
        default=os.environ.get("MASTER_ADDR"),
        help="node 0's address, where replica groups meet (default $MASTER_ADDR; 127.0.0.1 on one node)",
    )
    ap.add_argument(
        "--master-port",
        type=int,
        default=int(os.environ.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
        help="base rendezvous port; drafter i uses base + i (default $MASTER_PORT or %(default)s)",
    )
    ap.add_argument(
        "--check-target",
        action="store_true",
        help="fail (exit 2) unless target.path is a folder with a readable config.json (launch.sh, before a start)",
    )
    ap.add_argument("--device-map", action="store_true", help="print the device map instead of the process list")
    ap.add_argument("--memory", action="store_true", help="with --device-map: each device's planned GPU memory")
    ap.add_argument(
        "--device-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="memory of a GPU NVML does not report (this machine has none), to check the plan against",
    )
    ap.add_argument(
        "--target-config",
        default=None,
        metavar="DIR",
        help="the target's model directory for the memory plan (default: target.path)",
    )
    ap.add_argument(
        "--device",
        choices=sorted(DEVICES),
        default=None,
        help="the GPU kind the throughput plan assumes (default: the one --device-memory suggests, else h100)",
    )
    ap.add_argument(
        "--sample-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the samples' mean length for the throughput plan's samples/s (default: data.max_length)",
    )
    ap.add_argument(
        "--env-files",
        metavar="DIR",
        help="write each process's systemd environment file into DIR (deploy/systemd) and print the units to enable",
    )
    args = ap.parse_args(argv)
    if args.device_memory is not None and args.device_memory <= 0:
        print(f"--device-memory {args.device_memory:g}: a GPU's memory in GiB is a positive number", file=sys.stderr)
        return 2
    try:
        job = load_job(args.job)
        if args.master_addr is None and args.nnodes > 1 and any(d.replicas * args.nnodes > 1 for d in job.drafters):
            raise ConfigError(
                "a job over several nodes needs --master-addr (or $MASTER_ADDR): the address of"
                " node 0, where every drafter's replicas meet"
            )
        if args.check_target and (problem := target_files_problem(job)):
            raise ConfigError(f"{args.job}: {problem}")
        procs = plan(
            job,
            os.path.abspath(args.job),
            args.python,
            args.node_rank,
            args.nnodes,
            args.master_addr or "127.0.0.1",
            args.master_port,
        )
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    if args.env_files:
        print(" ".join(write_env_files(job, procs, args.env_files)))
        return 0
    if args.device_map:
        print(device_map(job, args.node_rank, args.nnodes, args.master_port))
        if args.memory and on_gpu(job):
            report, code = plans_report(job, os.path.abspath(args.job), args.python, args)
            print(report)
            return code
        if args.memory:
            print("planned GPU memory: every process of this job runs on the CPU")
        return 0
    for p in procs:
        print(f"{p.name}\t{int(p.critical)}\t{p.log}\t{shlex.join(p.command)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
