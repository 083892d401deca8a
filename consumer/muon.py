"""Muon's step with Newton–Schulz split over the drafter's replicas (consumer/optim.py builds it).

Why our own step: torch.optim.Muon orthogonalises every matrix on every replica, and at the production shapes
that work is a large share of a replica's step (docs/recipes.md, "Optimizer"). Here each matrix has one owner
replica, which orthogonalises it and sends the result to the others ("Muon is Scalable for LLM Training",
Moonshot 2025; Dion and torchtitan distribute it alike). The arithmetic is torch's own
(torch/optim/_muon.py; tests/consumer/test_muon_split.py pins it against torch.optim.Muon):

    buf ← lerp(buf, g, 1 − μ);  U ← lerp(g, buf, μ) (nesterov);  O ← NS5(U) in bf16, torch's coefficients;
    p ← p·(1 − lr·λ);  p ← p − adjust(lr, shape)·O

The optimizer is a torch.optim.Muon (same param groups, same "momentum_buffer" state), so checkpoints keep
their format and load into either.

Owners: greedy longest-first on each matrix's Newton–Schulz FLOPs (`assign_owners`), computed alike on every
replica from the shapes alone; uneven matrix counts are fine. Two layouts:
- replicated weights (the replicas' all-reduce path): every replica updates every momentum buffer
  (element-wise, and the state stays whole for checkpoints); the owner orthogonalises and broadcasts O in
  bf16; every replica applies it, so the weights stay bit-identical across the group.
- FSDP2 row shards (DTensor Shard(0)): each replica's momentum and U are its rows; the owner gathers U's
  rows in bf16 (exact: NS casts to bf16 first), orthogonalises, and scatters O's rows back.
The step runs in rounds (`rounds`): round j holds each replica's j-th largest matrix, orthogonalised side
by side and then exchanged, so a replica holds one orthogonalised matrix at a time (with no group, one
matrix at a time is the whole step, as in torch's). Per step a replica orthogonalises about 1/R of the
FLOPs; it receives (R − 1)/R of the matrices in bf16 (replicated), or about 2(R − 1)/R² of them (FSDP: its
owned matrices' rows in, its own rows back). consumer/throughput_plan.py counts both.

A non-finite step (`found_inf` > 0) leaves weights and momentum as they were, without a device sync: each
matrix's new values are selected with torch.where, one matrix at a time.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from common.flop_model import newton_schulz_flops
from consumer.distributed import collective

# what U and O travel as: NS computes in bf16 from its first operation, so bf16 loses nothing (a test that
# runs NS in float32 sets both)
TRANSFER_DTYPE = torch.bfloat16


def newton_schulz(update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
    """torch's `_zeropower_via_newtonschulz` (torch/optim/_muon.py), the same operations in the same order:
    the orthogonalised `update` in bf16. A bf16 `update` is overwritten (its storage is reused)."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def assign_owners(costs: list[float], world: int) -> list[int]:
    """The replica that orthogonalises each matrix: largest cost first, to the least loaded replica (lowest
    rank on ties). Deterministic: every replica computes the same list."""
    load = [0.0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


def rounds(costs: list[float], owners: list[int]) -> list[list[int]]:
    """The step's rounds: round j holds each replica's j-th largest owned matrix (in rank order), so a replica
    holds one orthogonalised matrix at a time, and the replicas work on theirs side by side."""
    mine: dict[int, list[int]] = {}
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        mine.setdefault(owners[i], []).append(i)
    longest = max((len(v) for v in mine.values()), default=0)
    return [[mine[r][j] for r in sorted(mine) if j < len(mine[r])] for j in range(longest)]


def adjusted_lr(lr: float, how: str | None, shape: tuple[int, ...]) -> float:
    """torch's `_adjust_lr`: "original" √max(1, A/B), "match_rms_adamw" 0.2·√max(A, B)."""
    rows, cols = shape[:2]
    if how is None or how == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if how == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _Matrix:
    """One matrix of the step: its parameter, gradient, momentum and hyperparameters."""

    def __init__(self, p: Tensor, buf: Tensor, group: dict):
        self.p, self.g, self.buf, self.group = p, p.grad, buf, group
        self.shape = tuple(p.shape)  # the full shape, DTensor or not
        self.cost = newton_schulz_flops([self.shape], group["ns_steps"])


class SplitMuon(torch.optim.Muon):
    """torch.optim.Muon whose Newton–Schulz is split over a process group (`split_over`), or over the
    FSDP mesh of DTensor parameters; with neither, every matrix is orthogonalised here."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.found_inf: Tensor | None = None  # set before step(): > 0 leaves every weight and buffer unchanged
        self.process_group = None  # replicated weights: the replicas to split over (None: no split)

    def split_over(self, process_group) -> None:
        """Split the orthogonalisation of replicated weights over `process_group` (every member calls step()
        together, with the same matrices holding gradients). DTensor weights use their own mesh."""
        self.process_group = process_group

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("SplitMuon.step takes no closure")
        matrices = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                matrices.append(_Matrix(p, buf, group))
        if not matrices:
            return None
        sharded = isinstance(matrices[0].p, DTensor)
        if any(isinstance(m.p, DTensor) != sharded for m in matrices):
            raise ValueError("SplitMuon: some matrices are FSDP (DTensor) shards and some are not: shard all or none")
        pg = matrices[0].p.device_mesh.get_group() if sharded else self.process_group
        world = dist.get_world_size(pg) if pg is not None else 1
        rank = dist.get_rank(pg) if pg is not None else 0
        owners = assign_owners([m.cost for m in matrices], world)
        if sharded:
            self._step_sharded(matrices, owners, rank, world, pg)
        else:
            self._step_replicated(matrices, owners, rank, pg)
        return None

    # -------------------------------------------------------------------------------------- the two layouts
    def _step_replicated(self, matrices: list[_Matrix], owners: list[int], rank: int, pg) -> None:
        for batch in rounds([m.cost for m in matrices], owners):
            done: dict[int, Tensor] = {}
            for i in batch:  # every momentum here; this replica's matrix of the round orthogonalised
                m = matrices[i]
                update = self._momentum(m.g, m.buf, m.group, owners[i] == rank)
                if update is not None:
                    done[i] = self._orthogonalise(update, m.group)
            for i in batch:  # each owner's O to every replica, applied as it comes
                m = matrices[i]
                if owners[i] == rank:
                    out = done.pop(i).to(TRANSFER_DTYPE).contiguous()  # a tall matrix's O is a transposed view
                else:
                    out = torch.empty(m.shape, dtype=TRANSFER_DTYPE, device=m.g.device)
                if pg is not None:
                    _exchange(rank, dist.broadcast, out, group=pg, group_src=owners[i])
                self._apply(m.p, out, m)

    def _step_sharded(self, matrices: list[_Matrix], owners: list[int], rank: int, world: int, pg) -> None:
        for m in matrices:
            if tuple(m.p.placements) != (Shard(0),):
                raise ValueError(
                    f"SplitMuon: an FSDP weight of shape {m.shape} is placed {m.p.placements}, not Shard(0)"
                )
        for batch in rounds([m.cost for m in matrices], owners):
            done: dict[int, Tensor] = {}
            for i in batch:  # each matrix's rows of U to its owner, in bf16
                m = matrices[i]
                update = self._momentum(_local(m.g), _local(m.buf), m.group, True).to(TRANSFER_DTYPE)
                chunk = -(-m.shape[0] // world)  # FSDP2's row chunks (torch.chunk): ⌈rows / R⌉, the tail shorter
                send = _pad_rows(update, chunk)
                parts = [torch.empty_like(send) for _ in range(world)] if owners[i] == rank else None
                _exchange(rank, dist.gather, send, parts, group=pg, group_dst=owners[i])
                if parts is not None:
                    done[i] = torch.cat(parts)[: m.shape[0]]
            done = {i: self._orthogonalise(u, matrices[i].group) for i, u in done.items()}
            for i in batch:  # each owner's O back, row chunk by row chunk
                m = matrices[i]
                local = _local(m.p)
                chunk = -(-m.shape[0] // world)
                out = done.pop(i).to(TRANSFER_DTYPE) if owners[i] == rank else None
                parts = list(_pad_rows(out, world * chunk).split(chunk)) if out is not None else None
                rows = torch.empty((chunk, *m.shape[1:]), dtype=TRANSFER_DTYPE, device=local.device)
                _exchange(rank, dist.scatter, rows, parts, group=pg, group_src=owners[i])
                self._apply(local, rows[: local.shape[0]], m)

    # ------------------------------------------------------------------------------------ torch's arithmetic
    def _momentum(self, g: Tensor, buf: Tensor, group: dict, update: bool) -> Tensor | None:
        """buf ← lerp(buf, g, 1 − μ) (kept as it was on a skipped step); with `update`, returns what to
        orthogonalise (a new tensor: NS may overwrite it)."""
        mu = group["momentum"]
        if self.found_inf is None:
            buf.lerp_(g, 1 - mu)
            new = buf
        else:
            new = buf.lerp(g, 1 - mu)
            buf.copy_(torch.where(self.found_inf > 0, buf, new))
        if not update:
            return None
        return g.lerp(new, mu) if group["nesterov"] else new.clone()

    @staticmethod
    def _orthogonalise(update: Tensor, group: dict) -> Tensor:
        return newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])

    def _apply(self, p: Tensor, o: Tensor, m: _Matrix) -> None:
        """p ← p·(1 − lr·λ) − adjust(lr)·O on this replica's storage of `p` (unchanged on a skipped step)."""
        lr, wd = m.group["lr"], m.group["weight_decay"]
        p = _local(p)
        step = -adjusted_lr(lr, m.group["adjust_lr_fn"], m.shape)
        if self.found_inf is None:
            p.mul_(1 - lr * wd).add_(o, alpha=step)
        else:
            p.copy_(torch.where(self.found_inf > 0, p, p.mul(1 - lr * wd).add_(o, alpha=step)))


def _exchange(rank: int, fn, *args, **kwargs) -> None:
    """`fn(*args, **kwargs)`, one collective of the step; a dead or late replica becomes a GroupError."""
    collective(f"Muon on replica {rank}", "the Newton–Schulz exchange", lambda: fn(*args, **kwargs))


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    """`t` (at most `rows` rows) with zero rows appended up to `rows`, contiguous: a collective's buffer."""
    if t.shape[0] == rows:
        return t.contiguous()
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
