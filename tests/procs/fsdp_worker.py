"""One replica of a two-process gloo group on the CPU that trains the same batch schedule three ways:
replicas without sharding (the DDP-like all-reduce path), FSDP2 straight through, and FSDP2 with a
checkpoint and a resume halfway; then a schedule of three batches per step both ways, the FSDP run taking
its batches through a real BatchStream (a CPU ring and control socket of its own, served by a thread here),
as ConsumerService feeds the trainer. Rank 0 saves what the test compares.

    python -m tests.procs.fsdp_worker TARGET_DIR BATCHES.pt OUT_DIR RANK WORLD PORT
"""

from __future__ import annotations

import contextlib
import secrets
import sys
import threading
import unittest.mock
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from common.channel import ProducerChannel, Received
from common.config import parse_job
from common.packed_batch import required_slot_bytes, slot_items
from common.protocol import Attached, Batch, Hello, Release, Welcome
from common.ring import SlotRing, layout_to_wire, plan_layout
from consumer.checkpoint import load_latest, write_checkpoint
from consumer.checkpoint_state import checkpoint_state
from consumer.distributed import GroupEnv, ReplicaGroup, RoundFlags
from consumer.export.layout import drafter_shape, trainer_export_config
from consumer.stream import BatchStream, ReceivedBatch
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer
from tests.consumer.test_drafter_common import LAYER_IDS, drafter_cfg

# per step: the batch indices each rank trains (rank 1 has fewer batches in steps 2 and 3: join semantics)
SCHEDULE = [
    {0: [0], 1: [1]},
    {0: [2, 3], 1: [4]},
    {0: [5], 1: []},
    {0: [6], 1: [7]},
    {0: [0, 1], 1: [2, 3]},
    {0: [4], 1: [5]},
]
RESUME_AT = 3  # steps before the checkpoint in the resumed run
NAN_BATCH = 8  # the worker's copy of batch 0 with a NaN in its hidden states: the step that trains it is skipped
# optimizer = "muon": the same schedule with a non-finite batch in step 5, after the resume point
MUON_SCHEDULE = [*SCHEDULE[:4], {0: [NAN_BATCH, 1], 1: [2, 3]}, SCHEDULE[5]]
# tokens_per_step spanning three rounds: each rank's three batches of a step come one per round
STREAM_SCHEDULE = [
    {0: [0, 1, 2], 1: [3, 4, 5]},
    {0: [6, 7, 1], 1: [2, 0, 4]},
    {0: [5, 3, 7], 1: [6, 1, 0]},
]
HEARTBEAT_S, HEARTBEAT_TIMEOUT_S = 0.2, 60.0  # a loaded machine must not fence anyone


def wait_message(channel: ProducerChannel, kind: type, timeout_s: float = 120.0) -> Received:
    while True:
        ev = channel.recv(timeout_s)
        if ev is None:
            raise TimeoutError(f"no {kind.__name__} within {timeout_s} s")
        if isinstance(ev, Received) and isinstance(ev.msg, kind):
            return ev


def serve_batches(channel: ProducerChannel, ring: SlotRing, batches: list, order: list[int]) -> None:
    """The producer's side by hand: WELCOME, then `batches[order[n]]` as seq n into the ring's slots, a
    slot reused as soon as its release came (the consumer releases right after its copy-out)."""
    hello = wait_message(channel, Hello)
    channel.send(
        hello.peer, Welcome(1, "cpu", ring.num_slots, ring.slot_bytes, ring.handle(), HEARTBEAT_S, HEARTBEAT_TIMEOUT_S)
    )
    wait_message(channel, Attached)
    free = list(range(ring.num_slots))
    for seq, i in enumerate(order):
        while not free:
            free += [slot for _seq, slot in wait_message(channel, Release).msg.pairs]
        slot = free.pop(0)
        hidden, input_ids, loss_mask, cu_seqlens = batches[i]
        layout = plan_layout(slot_items(input_ids.numel(), cu_seqlens.numel() - 1, hidden.shape[1], "float32"))
        views = ring.begin_write(slot, layout)
        ring.end_write(
            slot,
            views,
            {"hidden": hidden, "input_ids": input_ids, "loss_mask": loss_mask, "cu_seqlens": cu_seqlens},
            seq,
        )
        channel.send(hello.peer, Batch(1, seq, slot, 0, layout_to_wire(layout), [seq], input_ids.numel(), -1))


def newton_schulz_float32(grad: torch.Tensor, ns_coefficients, ns_steps: int, eps: float) -> torch.Tensor:
    """Muon's orthogonalisation (consumer/muon.py `newton_schulz`, torch's `_zeropower_via_newtonschulz`) in float32, not
    bfloat16. The replicas and FSDP sum gradients in different orders; in bf16 the quintic turns that fp32
    rounding into bf16 flips (measured on this schedule: weights |Δ| 1.9e-4 after one step, 4.4e-3 after
    four, when training moved them 2.2e-2); in float32 the two stay within 3.1e-7 over six steps, so what
    the test compares is the sharding, not the NS's rounding."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@contextlib.contextmanager
def float32_newton_schulz():
    with (
        unittest.mock.patch("consumer.muon.newton_schulz", newton_schulz_float32),
        unittest.mock.patch("consumer.muon.TRANSFER_DTYPE", torch.float32),
    ):
        yield


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def main(target: str, batches_path: str, out_dir: str, rank: int, world: int, port: int) -> int:
    torch.manual_seed(0)
    env = GroupEnv(rank, world, rank, 0, 1, "127.0.0.1", port)
    group = ReplicaGroup(env, torch.device("cpu"), timeout_s=300)
    parts = load_target_parts(target)
    batches = torch.load(batches_path, weights_only=True)
    nan_hidden = batches[0][0].clone()
    nan_hidden[3, 5] = float("nan")
    batches.append((nan_hidden, *batches[0][1:]))  # NAN_BATCH
    cfg = drafter_cfg(num_layers=2, grad_clip=0.5, warmup_frac=0.2, total_steps=20, distributed="fsdp")
    out = Path(out_dir)

    def trainer(fsdp: bool, optimizer: str = "adamw") -> Trainer:
        t = Trainer(cfg.model_copy(update={"optimizer": optimizer}), parts, LAYER_IDS, "cpu")
        if fsdp:
            group.shard(t)
        else:
            group.broadcast_params(t.params)
        t.grad_sync = group.sum_grads
        group.split_muon(t.optimizer)
        return t

    def run(t: Trainer, steps: range, schedule: list[dict] = SCHEDULE) -> list[dict]:
        seen = []
        for s in steps:
            for i in schedule[s][rank]:
                t.accumulate(*batches[i], seq=10 * s + i)
            t.optimizer_step(10 * s + 9)
            params = {n: full(p) for n, p in t.model.named_parameters()}  # collective under FSDP
            seen.append({"params": params, "grad_norm": float(t._grad_norm), "step": t.step})
        return seen

    def run_rounds(t: Trainer, next_batch) -> list[dict]:
        """As ConsumerService: one batch per round, a step once the group's tokens reach tokens_per_step."""
        seen = []
        for _ in STREAM_SCHEDULE:
            group_tokens = 0
            while group_tokens < t.cfg.tokens_per_step:
                hidden, input_ids, loss_mask, cu_seqlens, seq = next_batch()
                t.accumulate(hidden, input_ids, loss_mask, cu_seqlens, seq=seq)
                group_tokens += world * input_ids.numel()  # every batch of the schedule has the same T
            t.optimizer_step(seq)
            seen.append(
                {
                    "params": {n: full(p) for n, p in t.model.named_parameters()},
                    "grad_norm": float(t._grad_norm),
                    "step": t.step,
                }
            )
        return seen

    order = [i for step in STREAM_SCHEDULE for i in step[rank]]
    tokens_per_step = 3 * world * batches[0][1].numel()
    cfg = cfg.model_copy(update={"tokens_per_step": tokens_per_step})
    direct = iter(order)
    stream_ddp = run_rounds(trainer(False), lambda: (*batches[next(direct)], 0))
    job = parse_job(
        {
            "job": {"run_dir": str(out / f"stream-r{rank}")},
            "target": {"path": "x"},
            "data": {"path": "y"},
            "drafters": [{"name": "d0"}],
            "transport": {"heartbeat_interval_s": HEARTBEAT_S, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S},
        }
    )
    job.run_paths.make()
    width = batches[0][0].shape[1]
    ring = SlotRing.create(
        "cpu", 2, required_slot_bytes(job.data.tokens_per_batch, width, "float32"), name=f"fsdp-{secrets.token_hex(6)}"
    )
    channel = ProducerChannel(job.run_paths.ipc(job.run_paths.control_socket(0)), HEARTBEAT_S, HEARTBEAT_TIMEOUT_S)
    server = threading.Thread(target=serve_batches, args=(channel, ring, batches, order), daemon=True)
    server.start()
    stream = BatchStream(job, "d0", 0, torch.device("cpu"), resume_seq=lambda: 0)
    stream.connect()

    def from_stream():
        item = stream.next(timeout_s=120)
        assert isinstance(item, ReceivedBatch), item
        return item.hidden, item.input_ids, item.loss_mask, item.cu_seqlens, item.seq

    stream_fsdp = run_rounds(trainer(True), from_stream)
    server.join(60)
    stream.close()
    channel.close()
    ring.close()
    cfg = cfg.model_copy(update={"tokens_per_step": 0})

    replicas = run(trainer(False), range(len(SCHEDULE)))
    straight_trainer = trainer(True)
    straight = run(straight_trainer, range(len(SCHEDULE)))
    straight_state = straight_trainer.gather_state(keep=group.is_writer)  # collective: rank 0 keeps it

    first = trainer(True)
    run(first, range(RESUME_AT))

    def write_then_load(state: dict | None, ckpt: Path, t: Trainer) -> None:
        """Rank 0 writes `state`, then every rank loads the checkpoint into `t` as the service resumes."""
        if group.is_writer:
            write_checkpoint(ckpt, checkpoint_state(state, shape=drafter_shape(t)), trainer_export_config(t))
        group.sync_round(RoundFlags())  # a barrier: the checkpoint is on disk before anyone resumes

        def latest():
            ck = load_latest(ckpt)
            return str(ck.path), ck.state

        where, loaded = group.broadcast_state(latest)
        t.load_state_dict(loaded, where)

    resumed_trainer = trainer(True)
    write_then_load(first.gather_state(keep=group.is_writer), out / "ckpt", resumed_trainer)
    resumed = run(resumed_trainer, range(RESUME_AT, len(SCHEDULE)))
    resumed_state = resumed_trainer.gather_state(keep=group.is_writer)

    with float32_newton_schulz():  # the replicas and FSDP compared at fp32 tolerance (the NS in bf16 is not)
        muon_plain = trainer(False, "muon")
        muon_replicas = run(muon_plain, range(RESUME_AT), MUON_SCHEDULE)
        muon_plain_state = muon_plain.gather_state(keep=group.is_writer)  # unsharded: rank 0's state_dict()
        muon_replicas += run(muon_plain, range(RESUME_AT, len(MUON_SCHEDULE)), MUON_SCHEDULE)
        muon_replicas_state = muon_plain.gather_state(keep=group.is_writer)
        muon_sharded_trainer = trainer(True, "muon")
        muon_sharded = run(muon_sharded_trainer, range(len(MUON_SCHEDULE)), MUON_SCHEDULE)
        muon_sharded_state = muon_sharded_trainer.gather_state(keep=group.is_writer)
    muon_straight_trainer = trainer(True, "muon")  # Muon's bf16 NS as it is: resume bit-exact under FSDP
    muon_straight = run(muon_straight_trainer, range(len(MUON_SCHEDULE)), MUON_SCHEDULE)
    muon_straight_state = muon_straight_trainer.gather_state(keep=group.is_writer)
    muon_first = trainer(True, "muon")
    run(muon_first, range(RESUME_AT), MUON_SCHEDULE)
    muon_resumed_trainer = trainer(True, "muon")
    write_then_load(muon_first.gather_state(keep=group.is_writer), out / "muon-ckpt", muon_resumed_trainer)
    muon_resumed = run(muon_resumed_trainer, range(RESUME_AT, len(MUON_SCHEDULE)), MUON_SCHEDULE)
    muon_resumed_state = muon_resumed_trainer.gather_state(keep=group.is_writer)
    from_plain = trainer(True, "muon")  # the replicas' unsharded checkpoint, loaded sharded and gathered again
    write_then_load(muon_plain_state, out / "muon-plain-ckpt", from_plain)
    from_plain_state = from_plain.gather_state(keep=group.is_writer)
    if group.is_writer:
        torch.save(
            {
                "muon_replicas": muon_replicas,
                "muon_replicas_state": muon_replicas_state,
                "muon_sharded": muon_sharded,
                "muon_sharded_state": muon_sharded_state,
                "muon_straight": muon_straight,
                "muon_straight_state": muon_straight_state,
                "muon_resumed": muon_resumed,
                "muon_resumed_state": muon_resumed_state,
                "muon_plain_state": muon_plain_state,
                "from_plain_state": from_plain_state,
                "replicas": replicas,
                "straight": straight,
                "resumed": resumed,
                "straight_state": straight_state,
                "resumed_state": resumed_state,
                "stream_ddp": stream_ddp,
                "stream_fsdp": stream_fsdp,
            },
            out / "result.pt",
        )
    group.close()
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(a[0], a[1], a[2], int(a[3]), int(a[4]), int(a[5])))
