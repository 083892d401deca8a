"""FSDP2 for one drafter's trainer: sharding, the step's passes in lockstep, and the full state for checkpoints.

`shard` puts `fully_shard` on each decoder layer and the root, so a replica holds 1/world of the weights,
gradients and optimizer state (Adam's moments, Muon's momentum). The step keeps its meaning: reduce-scatter
SUMS the gradients (divide factor 1; the step divides by the group's normaliser as without sharding),
clipping sees the global norm, a checkpoint holds full tensors in the unsharded format. What changes: FSDP's
forward is collective, so a replica cannot run a batch when it arrives. The trainer `defer`s it, and at the
step `run_passes` runs the step's batches in lockstep with the group, a replica with fewer batches running
zero-weight stand-ins.

Every call here that talks to the group is collective (every replica calls it, in the same order), and a
failed one raises GroupError naming what it was (consumer/distributed.py: `collective`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from consumer.checkpoint_state import cpu_copy
from consumer.distributed import collective
from consumer.optim import map_torch_states

Batch = tuple[Tensor, Tensor, Tensor, Tensor]  # hidden, input_ids, loss_mask, cu_seqlens


class FsdpLockstep:
    """One sharded trainer's side of the group: the batches of its open step, and the collectives around them."""

    def __init__(self, mesh, who: str, stand_in: Batch):
        """`who` names the drafter in errors; `stand_in` is the zero-weight batch a replica without one runs."""
        self.mesh = mesh
        self.who = who
        self.stand_in = stand_in
        self.device = stand_in[0].device
        self.generator = torch.Generator(device=self.device)  # the stand-ins' anchors: not the trainer's
        self.deferred: list[Batch] = []

    @classmethod
    def shard(
        cls, model: torch.nn.Module, mesh, who: str, *, width: int, block_size: int, device: torch.device
    ) -> FsdpLockstep:
        """FSDP2 over `mesh` on `model` (its `fsdp_units()` and the root), with identical weights on every replica
        (the group broadcasts them first). `width` is a batch's hidden width (fused target layers × H)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        for unit in model.fsdp_units():  # decoder layers (DFlash2: and its candidate selector)
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # a sum, as the unsharded group's all-reduce,
                module.set_force_sum_reduction_for_comms(True)  # as a plain SUM (gloo has no PREMUL_SUM)
        T = 2 * block_size
        stand_in = (
            torch.zeros(T, width, device=device),
            torch.zeros(T, dtype=torch.int64, device=device),
            torch.ones(T, dtype=torch.uint8),
            torch.tensor([0, T], dtype=torch.int32),
        )
        return cls(mesh, who, stand_in)

    def _collective(self, what: str, fn: Callable[[], object]):
        return collective(f"drafter {self.who}", what, fn)

    def defer(self, batch: Batch) -> None:
        """Keep a batch for the step: a copy (the caller's tensors are views it reuses, consumer/stream.py)."""
        self.deferred.append(tuple(t.clone() for t in batch))

    def run_passes(self, model, forward_backward: Callable[..., None]) -> None:
        """Forward + backward of this replica's deferred batches, in lockstep with the group: every replica
        runs as many passes as the one with the most batches, the missing ones stand-ins of zero weight
        (their own generator: the anchor RNG stays what it is without sharding). Gradients are
        reduce-scattered once, after the last pass. `forward_backward(*batch, stand_in=None | generator)`."""
        count = torch.tensor([len(self.deferred)], dtype=torch.int64)
        self._collective(
            "the batch-count all-reduce",
            lambda: dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.mesh.get_group()),
        )
        passes = int(count)
        for i in range(passes):
            model.set_requires_gradient_sync(i == passes - 1)
            if i < len(self.deferred):
                self._collective("an FSDP forward/backward", lambda i=i: forward_backward(*self.deferred[i]))
            else:
                self._collective(
                    "an FSDP forward/backward",
                    lambda: forward_backward(*self.stand_in, stand_in=self.generator.manual_seed(0)),
                )
        self.deferred.clear()

    def gather_full_state(self, model, optimizer, rng: Tensor, keep: bool) -> tuple[dict, dict, Tensor] | None:
        """Collective: the full weights and optimizer state (AdamW's moments; with Muon also its momentum
        buffers), gathered tensor by tensor to the CPU in the unsharded format, and every replica's anchor RNG
        state `rng` stacked ([world, n]: each drew for its own batches, a bit-exact resume needs them all).
        Only the replica with `keep` (the writer) holds the result."""
        from torch.distributed.tensor import DTensor

        def full(t):
            t = t.full_tensor() if isinstance(t, DTensor) else t  # collective: every replica takes part
            return cpu_copy(t) if keep else None

        def full_torch_state(_, sd: dict) -> dict:
            return {**sd, "state": {i: {k: full(v) for k, v in st.items()} for i, st in sd["state"].items()}}

        def gather():
            weights = {k: full(v) for k, v in model.state_dict().items()}
            optim = map_torch_states(optimizer, optimizer.state_dict(), full_torch_state)
            rngs = [torch.empty_like(rng) for _ in range(self.mesh.size())]
            dist.all_gather(rngs, rng, group=self.mesh.get_group())
            return weights, cpu_copy(optim), torch.stack(rngs)

        gathered = self._collective("the checkpoint gather", gather)
        return gathered if keep else None

    def load_full_state(self, model, optimizer, weights: dict, optim: dict) -> None:
        """Cut this replica's shards out of full tensors (every replica holds the same full state): the weights,
        and each torch optimizer's per-parameter tensors of its parameter's shape (Adam's moments, Muon's
        momentum; scalars such as Adam's step stay whole)."""
        from torch.distributed.tensor import distribute_tensor

        def shard_like(full: Tensor, p) -> Tensor:
            return distribute_tensor(full.to(self.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None)

        names = dict(model.named_parameters())
        if set(names) != set(weights):
            raise ValueError(
                f"drafter {self.who}: checkpoint weights {sorted(set(weights) ^ set(names))[:4]}"
                " do not match this drafter's"
            )
        with torch.no_grad():
            for name, p in names.items():
                p.copy_(shard_like(weights[name], p))

        def sharded_torch_state(torch_optimizer, sd: dict) -> dict:
            params = [p for group in torch_optimizer.param_groups for p in group["params"]]
            state = {
                i: {
                    k: shard_like(v, params[i]) if torch.is_tensor(v) and v.shape == params[i].shape and v.ndim else v
                    for k, v in st.items()
                }
                for i, st in sd["state"].items()
            }
            return {**sd, "state": state}

        optimizer.load_state_dict(map_torch_states(optimizer, optim, sharded_torch_state))

    def own_rng(self, state: dict) -> Tensor | None:
        """This replica's anchor RNG from a state gathered under the same world size (None: another size)."""
        rngs = state.get("rng_replicas", ())
        if len(rngs) != self.mesh.size():
            return None
        return rngs[self.mesh.get_local_rank()].clone()  # a copy: set_state on a row view of the stacked
        # tensor crashed the process
