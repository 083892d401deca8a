"""What a checkpoint's trainer_state.pt holds, assembled in one place from the stateful parts.

As torchtitan's CheckpointManager saves {name: part.state_dict()} over a dict of Stateful parts, the loop
asks each part for its state and `checkpoint_state` puts them into one plain dict, which the saver writes
as it is (consumer/checkpoint.py). The format predates this module and is flat, so the parts share one
namespace:

    part            entries                                    made by                     read back by
    trainer         model, optimizer, scheduler, rng,          Trainer.state_dict, or      Trainer.load_state_dict
                    [rng_replicas], step, tokens, last_seq,    Trainer.gather_state under
                    nonfinite_skipped, block_size,             FSDP (collective)
                    target_layer_ids
    group cursor    group {producers, cursors, trained_above,  GroupCursor.to_state        GroupCursor.from_state
                    world_size}; last_seq (overrides the
                    trainer's: node 0's lowest untrained seq - 1)
    ledger record   ledger {id, lineages}                      TrainLedger.checkpoint      ledger_id_of, resume_lineage
    drafter shape   shape                                      export.layout.drafter_shape shape.check_shape

A checkpoint without a group cursor (a lone trainer) carries the trainer's own last_seq: its meaning for
one replica; one without a ledger entry resumes as "unaccounted" (common/accounting.py). `restore` gives
each part its entries back at resume.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.accounting import resume_lineage
from consumer.export.layout import drafter_shape
from consumer.group_cursor import GroupCursor
from consumer.shape import check_shape


def checkpoint_state(
    trainer: dict, *, shape: dict, cursor: GroupCursor | None = None, world_size: int = 1, ledger: dict | None = None
) -> dict:
    """trainer_state.pt's dict: the trainer's state (CPU tensors, as Trainer.state_dict gives them), the
    drafter's shape, and the group's cursor and ledger entry when there is a group and a ledger."""
    state = {**trainer, "shape": shape}
    if cursor is not None:
        state["group"] = {**cursor.to_state(), "world_size": world_size}
        state["last_seq"] = cursor.node_cursor(0) - 1  # every seq up to it trained, on node 0
    if ledger is not None:
        state["ledger"] = ledger
    return state


@dataclass(frozen=True)
class Restored:
    """What resuming gave back besides the trainer's own state (loaded into it)."""

    cursor: GroupCursor  # where the group's producers resume: the checkpoint's, or fresh for a new lineage
    lineages: list[str]  # the data lineages of the chain, this run's last (common/accounting.py)
    same_plan: bool  # False: a new lineage trains from the checkpoint's weights with a fresh cursor


def restore(state: dict | None, source: str, trainer, *, nnodes: int, producers: int, lineage: str) -> Restored:
    """Give each part its entries of a checkpoint state back (None: a fresh start): the shape is checked
    against the trainer's (ShapeMismatch), the trainer loads its state, the ledger's lineages decide whether
    the cursor goes on (LineageError), and the cursor is read for `nnodes` nodes of `producers` producers.
    `source` (the checkpoint's path) is named in every error."""
    if state is not None:
        check_shape(state, drafter_shape(trainer), trainer.cfg.name, source)
        trainer.load_state_dict(state, source)
    lineages, same_plan = resume_lineage(state, lineage, source)
    cursor = GroupCursor.fresh(nnodes, producers)
    if state is not None and same_plan:
        cursor = GroupCursor.from_state(state, nnodes, producers, source)
    return Restored(cursor, lineages, same_plan)


def world_change(state: dict | None, source: str, world_size: int, sharded: bool) -> str | None:
    """One line for the log when `state` was written by a group of another size than this run's `world_size`
    (None otherwise): the old and new sizes and what was re-sharded or re-dealt. `sharded`: this run is FSDP."""
    written = ((state or {}).get("group") or {}).get("world_size")
    if written is None or written == world_size:
        return None
    done = [
        f"weights, gradients and optimizer state re-sharded from {written} to {world_size} shard(s) (FSDP)"
        if sharded
        else f"weights and optimizer state loaded whole on each of the {world_size} replica(s)"
    ]
    rngs = state.get("rng_replicas")
    if rngs is not None and len(rngs) != world_size:
        done.append(f"the writer's anchor RNG on every replica (the {len(rngs)} per-replica streams fit {len(rngs)})")
    done.append(f"the group cursor goes on, the producer dealing the remaining seqs to {world_size} replica(s)")
    return f"{source} was written by a group of {written} replica(s), this run has {world_size}: " + "; ".join(done)


def cpu_copy(obj):
    """A snapshot: every tensor copied to the CPU, so training on never changes a state already taken."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj
