"""Target tensor parallelism: one producer as a group of `target.tp_size` processes, started the torchrun way.

The launch plan exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT to every process of the group.
Every rank loads its shard of the target through transformers' own tensor parallelism
(`DistributedConfig(tp_size=N)`: the model's `base_model_tp_plan`, DTensor weights, its own all-reduces); a MoE
target with `target.ep_size = N` also shards its experts whole across the group (`base_model_ep_plan`).
Rank 0 is the producer proper: it owns the ring, the control socket, delivery, accounting and stats. Before
each target forward it broadcasts the batch's tokens (a header [command, T, B+1] and then input_ids ‖ cu_seqlens,
on a gloo group of their own); the other ranks (`follow`) run their shard of the same forward into a scratch
buffer and wait for the next one. The residual stream is replicated across the group, so only rank 0's features
go into the ring.

Waits: the followers first wait (LOAD_TIMEOUT_S) for rank 0 to have read its data; then their wait for the
next command is a gloo collective with its own timeout (`control_timeout_s`); rank 0 sends a keep-alive whenever it has sent nothing for `keepalive_s` (it is idle
waiting for consumers or slots), so a timeout means rank 0 is gone or stuck. A follower ignores SIGINT/SIGTERM/SIGHUP:
rank 0 stops the group with a STOP command when it ends, however it ended; launch.sh's grace period bounds it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from transformers.distributed import DistributedConfig

from common.config import TargetConfig
from common.host_memory import keep_freed_memory

log = logging.getLogger("producer.tp")

BATCH, KEEPALIVE, STOP = 0, 1, 2
LOAD_TIMEOUT_S = 3600.0  # loading a sharded 27B-class target can keep one rank waiting on the others this long


def distributed_config(target: TargetConfig) -> DistributedConfig | None:
    """What `load_target` gives transformers for the target's group (None: one process, no sharding).

    tp_size shards attention and dense MLPs by heads and columns (`base_model_tp_plan`). ep_size = tp_size
    instead gives each rank tp_size-th of the experts whole (`base_model_ep_plan`): every rank runs its own
    experts on the batch the group shares and an all-reduce sums them ("all_reduce": no tokens move and no
    split sizes come back to the host, unlike "all_to_all", which is for ranks holding different batches)."""
    if target.tp_size == 1:
        return None
    if target.ep_size == 1:
        return DistributedConfig(tp_size=target.tp_size)
    return DistributedConfig(tp_size=target.tp_size, ep_size=target.ep_size, ep_implementation="all_reduce")


def ep_shard(model: torch.nn.Module, target: TargetConfig) -> str:
    """The log line that shows expert parallelism took effect on this rank: the first expert weight's local
    shard against its full shape, and the share of all expert weights held here. A target.ep_size that left
    no expert whole on its rank is an error, never a silent fallback to tensor parallelism."""
    local = full = 0
    first = None
    for name, param in model.named_parameters():
        if ".experts." not in name:
            continue
        whole = isinstance(param, DTensor) and any(isinstance(p, Shard) and p.dim == 0 for p in param.placements)
        if not whole:
            raise TPSetupError(
                f"target.ep_size = {target.ep_size}: transformers did not shard {name} by expert"
                f" ({type(param).__name__} {tuple(param.shape)}); {target.path}'s expert-parallel"
                " plan does not cover it"
            )
        local += param.to_local().numel()
        full += param.numel()
        first = first or f"{name} {tuple(param.to_local().shape)} of {tuple(param.shape)}"
    if first is None:
        raise TPSetupError(
            f"target.ep_size = {target.ep_size}: {target.path} has no expert weights"
            " (no parameter under an `experts` module)"
        )
    return f"expert parallel: {first}; {100 * local / full:.1f} % of the expert weights on this rank"


class TPSetupError(RuntimeError):
    """The process was started without the variables of its tensor-parallel group, or with wrong ones."""


@dataclass(frozen=True)
class TPRank:
    rank: int
    world: int
    local_rank: int

    @classmethod
    def from_env(cls, tp_size: int) -> TPRank:
        """This process's place in its group, from torchrun's variables (common/launch_plan.py sets them)."""
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
        if missing:
            raise TPSetupError(
                f"target.tp_size = {tp_size} but ${missing[0]} is not set: a tensor-parallel"
                " producer is started by launch.sh or the systemd units with its group's variables"
            )
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
        except ValueError as err:
            raise TPSetupError(f"target.tp_size = {tp_size}: bad RANK/WORLD_SIZE/LOCAL_RANK: {err}") from None
        if world != tp_size or not 0 <= rank < world:
            raise TPSetupError(f"target.tp_size = {tp_size} but WORLD_SIZE={world}, RANK={rank}")
        return cls(rank, world, local_rank)


@dataclass(frozen=True)
class TPGroup:
    control: dist.ProcessGroup  # gloo, the batch commands, with the short timeout
    start: dist.ProcessGroup  # gloo, LOAD_TIMEOUT_S: the followers wait here while rank 0 reads its data

    def started(self) -> None:
        """Rank 0: the data is ready and the commands begin (the followers pass their start barrier)."""
        dist.barrier(group=self.start)


def init_group(device: str, control_timeout_s: float) -> TPGroup:
    """Join the group (gloo on the CPU; NCCL for the target's CUDA tensors plus gloo for the CPU ones) before
    transformers does."""
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=LOAD_TIMEOUT_S))
    return TPGroup(
        dist.new_group(backend="gloo", timeout=timedelta(seconds=control_timeout_s)),
        dist.new_group(backend="gloo", timeout=timedelta(seconds=LOAD_TIMEOUT_S)),
    )


def _send(control: dist.ProcessGroup, cmd: int, payload: torch.Tensor | None = None, cu_len: int = 0) -> None:
    n = 0 if payload is None else int(payload.numel())
    dist.broadcast(torch.tensor([cmd, n - cu_len, cu_len], dtype=torch.int64), src=0, group=control)
    if payload is not None:
        dist.broadcast(payload, src=0, group=control)


class LeaderTarget:
    """Rank 0's target: each forward first tells the followers which tokens to run; everything else is the
    wrapped TargetCapture's (feature_width, dtype, device, ...)."""

    def __init__(self, target, control: dist.ProcessGroup, keepalive_s: float):
        self.target = target
        self.control = control
        self.keepalive_s = keepalive_s
        self._last = time.monotonic()
        self._stopped = False

    def __getattr__(self, name: str):
        return getattr(self.target, name)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor | None = None):
        ids = input_ids.to("cpu", torch.int64)
        cu = cu_seqlens.to("cpu", torch.int64)
        _send(self.control, BATCH, torch.cat([ids, cu]), int(cu.numel()))
        self._last = time.monotonic()
        return self.target.forward(input_ids, cu_seqlens, out)

    __call__ = forward

    def keepalive(self) -> None:
        """Called from the producer's waits: a command at least every keepalive_s keeps the followers' wait short."""
        if not self._stopped and time.monotonic() - self._last >= self.keepalive_s:
            _send(self.control, KEEPALIVE)
            self._last = time.monotonic()

    def stop(self) -> None:
        """End the followers (idempotent); a follower already gone is not an error at this point."""
        if self._stopped:
            return
        self._stopped = True
        try:
            _send(self.control, STOP)
        except RuntimeError as err:
            log.warning("could not tell the tensor-parallel followers to stop: %s", err)


def follow(target, group: TPGroup) -> int:
    """A follower's life: wait for rank 0 to have its data, then run its forwards until STOP. Returns the
    exit status."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 decides when the group ends (module docstring)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if target.device.type == "cpu":
        keep_freed_memory()  # as rank 0's ProducerService: each forward reuses the last one's pages
    header = torch.zeros(3, dtype=torch.int64)
    forwards = 0
    try:
        dist.barrier(group=group.start)
    except RuntimeError as err:
        log.error("rank 0 of the tensor-parallel group ended before its first batch: %s", err)
        return 1
    control = group.control
    while True:
        try:
            dist.broadcast(header, src=0, group=control)
            cmd, tokens, cu_len = (int(v) for v in header.tolist())
            if cmd == STOP:
                log.info("rank 0 ended the group after %d forwards", forwards)
                return 0
            if cmd == KEEPALIVE:
                continue
            payload = torch.empty(tokens + cu_len, dtype=torch.int64)
            dist.broadcast(payload, src=0, group=control)
        except RuntimeError as err:  # gloo: the peer closed the connection, or the wait timed out
            log.error("lost rank 0 of the tensor-parallel group after %d forwards: %s", forwards, err)
            return 1
        target.forward(payload[:tokens], payload[tokens:])
        forwards += 1
