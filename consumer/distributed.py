"""The replicas of one drafter as one torch.distributed process group (its cursor: consumer/group_cursor.py).

Why a home-made step protocol around torch.distributed rather than DDP: batches arrive from the producer
at uneven times, a replica may have none for a while (end of data, a slow node), and resuming must know
exactly which seqs the *group* trained. So every replica trains at most one batch per *round*; a round
closes with one small SUM all-reduce of flags (`RoundFlags`), which tells every replica the same thing:
whether the round is complete, whether the group steps, stops or fails. Gradients are summed at the step
only (one bucketed all-reduce, `ReplicaGroup.sum_grads`), together with Σw and Σw·CE, so the step is the
exact Σw·CE / Σw over every batch of every replica, and every replica applies identical bits.

Join semantics: a round is complete when every replica holds a batch or has ended, or when at least one
holds a batch and another has waited a full poll (`starved`) without one; a replica without a batch
contributes zero gradient and zero weight. Nobody waits for a batch that may never come, and a producer
that delivered a burst to one replica (it attached first) is drained by that replica instead of
deadlocking on full slots.

Process group: gloo on CPU, `cpu:gloo,cuda:nccl` on GPU (flags and checkpoints travel on the CPU, grads on
the GPU), rendezvous through a TCPStore at MASTER_ADDR:MASTER_PORT; every collective has the group
timeout, so a dead replica gives an error (gloo: at once, "connection closed by peer"), never a hang.
Ranks: rank = node_rank × replicas + replica, world = replicas × nnodes (what the launch plan exports).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from common.profile import ProfileStats
from consumer import tensor_tree

log = logging.getLogger("consumer")

DEFAULT_TIMEOUT_S = 600.0  # a checkpoint write by rank 0 or a slow producer start must fit in it
BUCKET_BYTES = 64 << 20  # gradients are summed in flat buckets of at most this size


class GroupError(RuntimeError):
    """The replica group cannot go on: a member died or timed out, or the environment is inconsistent."""


T = TypeVar("T")


def collective(who: str, what: str, fn: Callable[[], T], timeout_s: float | None = None) -> T:
    """fn(), a torch.distributed collective; its RuntimeError (a peer closed the connection, the group timeout
    ran out) becomes a GroupError saying who failed during what."""
    try:
        return fn()
    except RuntimeError as err:
        late = f"one did not reach it within {timeout_s:.0f} s" if timeout_s else "one timed out"
        raise GroupError(
            f"{who}: the group failed during {what} (a replica died, or {late}): {str(err).splitlines()[0][:300]}"
        ) from err


# ---------------------------------------------------------------------------------------------- environment
@dataclass(frozen=True)
class GroupEnv:
    rank: int
    world_size: int
    local_rank: int  # = the replica index on its node
    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int

    @classmethod
    def resolve(
        cls, environ: Mapping[str, str], *, replica: int, replicas: int, node_rank: int, nnodes: int
    ) -> GroupEnv:
        """The group coordinates from the command line, checked against torchrun's variables when set."""
        if not 0 <= node_rank < nnodes:
            raise GroupError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
        want = {"RANK": node_rank * replicas + replica, "WORLD_SIZE": replicas * nnodes, "LOCAL_RANK": replica}
        for var, value in want.items():
            if var in environ and int(environ[var]) != value:
                raise GroupError(
                    f"{var}={environ[var]} in the environment, but replica {replica} of {replicas} on node"
                    f" {node_rank} of {nnodes} is {var.lower()} {value} (rank = node_rank × replicas + replica)"
                )
        world = want["WORLD_SIZE"]
        addr = environ.get("MASTER_ADDR", "127.0.0.1" if nnodes == 1 else "")
        port = environ.get("MASTER_PORT", "")
        if world > 1 and (not addr or not port.isdigit()):
            raise GroupError(
                f"a group of {world} replicas needs MASTER_ADDR and MASTER_PORT (the rendezvous on node 0):"
                f" got MASTER_ADDR={addr or '<unset>'} MASTER_PORT={port or '<unset>'}; launch.sh sets them"
                " (--master-addr/--master-port)"
            )
        return cls(want["RANK"], world, replica, node_rank, nnodes, addr, int(port or 0))


# ---------------------------------------------------------------------------------------------- round flags
@dataclass(frozen=True)
class RoundFlags:
    """One replica's state at the end of a round; summed over the group it describes the round."""

    has_batch: int = 0  # trained (forward + backward) a batch this round, not yet closed
    ended: int = 0  # the producer said END: contributes nothing from now on
    exhausted: int = 0  # that END said the plan is delivered: the group trains its last, partial step
    starved: int = 0  # waited a full poll without a batch
    tokens: int = 0  # tokens of its batch this round
    stop: int = 0  # asked to stop (SIGTERM/SIGINT): the group stops at this round
    producer_lost: int = 0
    rejected: int = 0
    val_batch: int = 0  # holds a validation batch: the group evaluates this round (FSDP: in lockstep)
    val_pass_ends: int = 0  # that batch is its pass's last: the group decides on `best` this round

    def to_tensor(self) -> Tensor:
        return torch.tensor(dataclasses.astuple(self), dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: Tensor) -> RoundFlags:
        return cls(*(int(v) for v in t.tolist()))

    def complete(self, world_size: int) -> bool:
        """Every replica has its batch (or has ended), or someone starved while another has a batch."""
        return self.has_batch > 0 and (self.has_batch + self.ended == world_size or self.starved > 0)


# ---------------------------------------------------------------------------------------------- the group
class ReplicaGroup:
    """Collectives of one drafter's replicas; with a world of one every method is local and free."""

    def __init__(
        self,
        env: GroupEnv,
        device: torch.device,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        prof: ProfileStats | None = None,
        bucket_bytes: int = BUCKET_BYTES,
    ):
        self.env = env
        self.device = device
        self.timeout_s = timeout_s
        self.prof = prof
        self.bucket_bytes = bucket_bytes
        self.initialised = False
        if env.world_size == 1:
            return
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(
                env.master_addr,
                env.master_port,
                env.world_size,
                is_master=env.rank == 0,
                timeout=timeout,
                wait_for_workers=False,
            )
            dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
        except (RuntimeError, OSError) as err:  # DistNetworkError, DistStoreError are RuntimeErrors
            raise GroupError(
                f"rank {env.rank} of {env.world_size} could not form the group at"
                f" {env.master_addr}:{env.master_port} within {timeout_s:.0f} s: {err}"
            ) from err
        self.initialised = True

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_writer(self) -> bool:
        """Global rank 0 alone writes checkpoints."""
        return self.env.rank == 0

    def _collective(self, what: str, fn: Callable[[], T]) -> T:
        return collective(f"rank {self.rank} of {self.world_size}", what, fn, self.timeout_s)

    def shard(self, trainer) -> None:
        """distributed = "fsdp": the trainer's weights, gradients and Adam moments sharded over the group
        (FSDP2, Trainer.shard), from rank 0's weights. A group of one has nothing to shard: said, not hidden."""
        if self.world_size == 1:
            log.warning(
                "drafter %s: distributed = 'fsdp' with a group of one replica: nothing to shard over,"
                " the drafter trains unsharded",
                trainer.cfg.name,
            )
            return
        from torch.distributed.device_mesh import init_device_mesh

        self.broadcast_params(trainer.params)
        mesh = self._collective("the FSDP mesh set-up", lambda: init_device_mesh(self.device.type, (self.world_size,)))
        trainer.shard(mesh)
        log.info("drafter %s: FSDP2 over %d replicas (%s)", trainer.cfg.name, self.world_size, self.device.type)

    def split_muon(self, optimizer) -> None:
        """Muon's Newton–Schulz of replicated weights split over the group, each matrix orthogonalised by one
        replica (consumer/muon.py); FSDP's sharded weights split over their mesh without it. AdamW: nothing."""
        split_over = getattr(optimizer, "split_over", None)  # MuonWithAdamW (consumer/optim.py imports this module)
        if self.world_size > 1 and split_over is not None:
            split_over(dist.group.WORLD)

    def sync_round(self, mine: RoundFlags) -> RoundFlags:
        """Sum every replica's flags; the wait here is where replicas wait for each other (allreduce_wait)."""
        if self.world_size == 1:
            return mine
        t = mine.to_tensor()
        start = time.perf_counter()
        self._collective("the round all-reduce", lambda: dist.all_reduce(t))
        if self.prof:
            self.prof.add("allreduce_wait", time.perf_counter() - start)
        return RoundFlags.from_tensor(t)

    def sum_grads(self, params: list[Tensor], weight: Tensor, loss: Tensor) -> None:
        """The trainer's grad_sync hook: Σ over replicas of every gradient, Σw and Σw·CE, in place.

        A replica without a batch this step has no .grad: it contributes zeros. Sharded (FSDP) gradients
        were already summed by FSDP's reduce-scatter: only Σw and Σw·CE travel then.
        """
        if self.world_size == 1:
            return
        grads = []
        for p in params:
            if isinstance(p, DTensor):
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        start = time.perf_counter()
        tensors = [*grads, weight.view(1), loss.view(1)]
        for bucket in _buckets(tensors, self.bucket_bytes):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self._collective("the gradient all-reduce", lambda flat=flat: dist.all_reduce(flat))
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        if self.prof:
            self.prof.add("allreduce_grads", time.perf_counter() - start)

    def broadcast_params(self, params: list[Tensor]) -> None:
        """Rank 0's parameters everywhere: identical starting bits whatever each process loaded. (FSDP shards
        are cut from full weights broadcast before sharding and from the broadcast checkpoint: skipped.)"""
        params = [p for p in params if not isinstance(p, DTensor)]
        if self.world_size == 1 or not params:
            return
        for bucket in _buckets([p.data for p in params], self.bucket_bytes):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self._collective("the parameter broadcast", lambda flat=flat: dist.broadcast(flat, 0))
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def broadcast_state(self, load: Callable[[], tuple[str, dict] | None]) -> tuple[str, dict] | None:
        """Rank 0 runs `load()` (its latest checkpoint: (where, trainer state) or None) and sends it to all.

        Only rank 0 reads the disk: nodes need no shared filesystem. The state travels as msgpack bytes
        (consumer/tensor_tree.py: no pickle crosses the network).
        """
        if self.world_size == 1:
            return load()
        payload, loaded = b"", None
        if self.rank == 0:
            loaded = load()
            if loaded is not None:
                payload = tensor_tree.pack({"where": loaded[0], "state": loaded[1]})
        size = torch.tensor([len(payload)], dtype=torch.int64)
        self._collective("the checkpoint broadcast", lambda: dist.broadcast(size, 0))
        if int(size) == 0:
            return None
        data = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if self.rank == 0
            else torch.empty(int(size), dtype=torch.uint8)
        )
        self._collective("the checkpoint broadcast", lambda: dist.broadcast(data, 0))
        if self.rank == 0:
            return loaded  # what it sent, bit for bit: no need to decode its own copy
        got = tensor_tree.unpack(data.numpy().tobytes())
        return got["where"], got["state"]

    def gather_trained(self, seqs: list[int]) -> dict[int, list[int]]:
        """Every replica's trained seqs, merged per node (each replica gets the same answer): the collective
        that opens every checkpoint (ConsumerService._save)."""
        node = self.env.node_rank
        if self.world_size == 1:
            return {node: list(seqs)}
        n = torch.tensor([len(seqs)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._collective("the cursor all-gather", lambda: dist.all_gather(sizes, n))
        longest = max(int(s) for s in sizes)
        mine = torch.full((longest + 1,), -1, dtype=torch.int64)
        mine[0] = node
        mine[1 : 1 + len(seqs)] = torch.tensor(seqs, dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._collective("the cursor all-gather", lambda: dist.all_gather(rows, mine))
        merged: dict[int, list[int]] = {}
        for row, size in zip(rows, sizes, strict=True):
            merged.setdefault(int(row[0]), []).extend(row[1 : 1 + int(size)].tolist())
        return merged

    def gather_rows(self, row: list[float]) -> list[list[float]]:
        """Every replica's `row` (float64, one length everywhere), in rank order: small facts each replica
        must see alike (consumer/best_checkpoint.py's decision on `best`)."""
        if self.world_size == 1:
            return [list(row)]
        mine = torch.tensor(row, dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._collective("the validation all-gather", lambda: dist.all_gather(rows, mine))
        return [r.tolist() for r in rows]

    def close(self) -> None:
        if self.initialised:
            self.initialised = False
            dist.destroy_process_group()


def _buckets(tensors: list[Tensor], bucket_bytes: int) -> list[list[Tensor]]:
    """Consecutive tensors of one dtype and device, at most `bucket_bytes` per bucket (one tensor at least)."""
    out: list[list[Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = out[-1] if out else None
        if last is None or last[0].dtype != t.dtype or last[0].device != t.device or size + nbytes > bucket_bytes:
            out.append([t])
            size = nbytes
        else:
            last.append(t)
            size += nbytes
    return out


# ---------------------------------------------------------------------------------------------- step trace
class StepTrace:
    """One JSON line per optimizer step: seqs and sample ids this replica trained in it, and a digest of
    its parameters. For tests and debugging (replicas compare digests); costs a device sync per step.
    Under FSDP the digest is of the full weights, gathered: then every replica of the group must trace."""

    def __init__(self, path: str | Path, rank: int, node_rank: int):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (lives as long as the process)
        self.rank = rank
        self.node_rank = node_rank

    def write(self, step: int, seqs: list[int], samples: list[int], tokens: int, params: list[Tensor]) -> None:
        digest = hashlib.sha256()
        for p in params:
            t = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
            digest.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        self.file.write(
            json.dumps(
                {
                    "rank": self.rank,
                    "node": self.node_rank,
                    "step": step,
                    "seqs": seqs,
                    "samples": samples,
                    "tokens": tokens,
                    "digest": digest.hexdigest()[:32],
                    "time": time.time(),
                }
            )
            + "\n"
        )

    def close(self) -> None:
        self.file.close()
