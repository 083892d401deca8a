"""What a drafter's replica group has trained: one cursor per (node, producer).

The cursor is computed from the exact sets of seqs the replicas trained in completed steps (the
`gather_trained` collective of consumer/distributed.py); each HELLO to producer p resumes p from its own
cursor, and every checkpoint and ledger record carries the cursors (docs/design.md, docs/reliability.md).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from common.accounting import per_node
from consumer.distributed import GroupError

log = logging.getLogger("consumer")


@dataclass(frozen=True)
class GroupCursor:
    """Per node and per producer: the seq producer p must resume from (the lowest seq of its shard that no
    completed step trained) and the seqs of its shard above that already trained (dropped when a resumed
    producer replays them). Target replica p of R makes the node's seqs ≡ p mod R (producer/delivery.py).

    Why per producer: one cursor per node would sit at the slowest producer's lowest untrained seq while
    every seq a faster producer delivered piled up above it, growing with the lag between the producers
    (and written into every checkpoint and ledger record). Per producer, what lies above a cursor is what
    was in flight from that producer (its slots, the batches of a step being accumulated), however far
    apart the producers run. R = 1 is the per-node cursor.

    A max-of-last-seq cursor would be wrong: with round-robin delivery and join semantics a replica can
    train seq s+R in a completed step while s is still in flight to another; so the cursor is the lowest
    untrained seq, computed from the exact sets the replicas trained.

    In a checkpoint ("group") and a ledger record the lists are flat, one entry per (node, producer) at
    index node × producers + producer: with one producer that is the per-node layout of checkpoints
    written before cursors were per producer (they carry no "producers" key and read as producers = 1).
    """

    producers: int
    cursors: tuple[tuple[int, ...], ...]  # [node][producer]
    trained_above: tuple[tuple[tuple[int, ...], ...], ...]  # [node][producer]: sorted seqs

    @classmethod
    def fresh(cls, nnodes: int, producers: int = 1) -> GroupCursor:
        return cls(producers, (tuple(range(producers)),) * nnodes, (((),) * producers,) * nnodes)

    @classmethod
    def from_state(cls, state: dict, nnodes: int, producers: int, source: str) -> GroupCursor:
        """From a checkpoint's trainer state (its "group" entry, or a single-replica checkpoint's last_seq),
        for a run of `nnodes` nodes with `producers` target replicas each. A checkpoint written under another
        target.replicas is re-dealt exactly: the seqs are the node plan's, whatever the number of producers."""
        group = state.get("group")
        if group is None:
            if nnodes != 1:
                raise GroupError(f"{source} was written by a single-node run; its seqs do not apply to {nnodes} nodes")
            written = cls(1, ((state["last_seq"] + 1,),), (((),),))
        else:
            written = cls._unflatten(group, source)
            if len(written.cursors) != nnodes:
                raise GroupError(
                    f"{source} was written by a group over {len(written.cursors)} node(s); this run has {nnodes}:"
                    " every node's data shard differs, so its cursors do not apply (resume with the same --nnodes)"
                )
        if written.producers != producers:
            log.info(
                "%s was written with target.replicas = %d, this run has %d: its trained seqs are re-dealt"
                " to %d producer cursor(s) per node",
                source,
                written.producers,
                producers,
                producers,
            )
        return written.regroup(producers)

    @classmethod
    def _unflatten(cls, group: dict, source: str) -> GroupCursor:
        producers = group.get("producers", 1)
        flat_c, flat_a = group["cursors"], group["trained_above"]
        if not isinstance(producers, int) or producers < 1 or len(flat_c) % producers or len(flat_a) != len(flat_c):
            raise GroupError(
                f"{source}: its group cursor is malformed ({len(flat_c)} cursors, {len(flat_a)}"
                f" trained_above lists, producers = {producers!r}: want one of each per node and producer)"
            )
        return cls(
            producers,
            tuple(per_node(flat_c, producers)),
            tuple(tuple(tuple(a) for a in node) for node in per_node(flat_a, producers)),
        )

    def to_state(self) -> dict:
        return {
            "producers": self.producers,
            "cursors": [c for node in self.cursors for c in node],
            "trained_above": [list(a) for node in self.trained_above for a in node],
        }

    def node_cursor(self, node: int) -> int:
        """The lowest seq of the node that no completed step trained (every seq below it is trained)."""
        return min(self.cursors[node])

    def above(self, node: int) -> set[int]:
        """The node's seqs trained above their producer's cursor: a resumed producer replays them."""
        return {s for seqs in self.trained_above[node] for s in seqs}

    def advance(self, trained: Mapping[int, Iterable[int]]) -> GroupCursor:
        """Add the seqs each node's replicas trained in completed steps since this cursor was made."""
        r = self.producers
        cursors = [list(node) for node in self.cursors]
        above = [[set(a) for a in node] for node in self.trained_above]
        for node, seqs in trained.items():
            counts = Counter(seqs)
            again = sorted(s for s, n in counts.items() if n > 1 or s < cursors[node][s % r] or s in above[node][s % r])
            if again:  # the delivery promises this never happens: say so loudly, keep going
                log.error("node %d: seqs %s were trained twice by the group", node, again)
            for s in counts:
                above[node][s % r].add(s)
            for p in range(r):
                c, done = cursors[node][p], above[node][p]
                while c in done:
                    c += r
                cursors[node][p], above[node][p] = c, {s for s in done if s > c}
        return GroupCursor(
            r, tuple(map(tuple, cursors)), tuple(tuple(tuple(sorted(a)) for a in node) for node in above)
        )

    def regroup(self, producers: int) -> GroupCursor:
        """The same trained seqs dealt to `producers` cursors per node (exact: a seq s is trained iff it lies
        below its producer's cursor or above it in trained_above)."""
        if producers == self.producers:
            return self
        r = self.producers
        cursors, above = [], []
        for node_c, node_a in zip(self.cursors, self.trained_above, strict=True):
            sets = [set(a) for a in node_a]

            def trained(s: int, node_c=node_c, sets=sets) -> bool:
                return s < node_c[s % r] or s in sets[s % r]

            low = min(node_c)  # every seq below it is trained; every seq from `top` on is not
            top = max([*node_c, *(max(a) + 1 for a in node_a if a)])
            new_c, new_a = [], []
            for q in range(producers):
                c = low + (q - low) % producers
                while trained(c):
                    c += producers
                new_c.append(c)
                new_a.append(tuple(s for s in range(c + producers, top, producers) if trained(s)))
            cursors.append(tuple(new_c))
            above.append(tuple(new_a))
        return GroupCursor(producers, tuple(cursors), tuple(above))
