"""Replica groups, unit level: round flags, the group cursor, the environment, the launch plan's variables,
and two real gloo processes whose summed step equals one trainer's step over both batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.config import parse_job
from common.launch_plan import plan
from consumer.distributed import GroupEnv, GroupError, RoundFlags, _buckets
from consumer.group_cursor import GroupCursor
from consumer.target_parts import load_target_parts
from consumer.trainer import Trainer
from tests.consumer.test_drafter_common import (
    LAYER_IDS,
    distinct_seqs,
    drafter_cfg,
    packed,
    target_features,
    tiny_target,
)
from tests.jobs import run_ranks

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------- round flags
def test_round_completes_when_everyone_has_a_batch_or_ended_or_someone_starved():
    def total(*flags):
        return RoundFlags.from_tensor(sum(f.to_tensor() for f in flags))

    batch, waiting, ended = RoundFlags(has_batch=1, tokens=10), RoundFlags(), RoundFlags(ended=1)
    assert total(batch, batch).complete(2) and total(batch, batch).tokens == 20
    assert not total(batch, waiting).complete(2)  # the other may get its batch within a poll
    assert total(batch, RoundFlags(starved=1)).complete(2)  # it did not: join with zero gradient
    assert total(batch, ended).complete(2)  # end of data on one replica: the other goes on
    assert not total(ended, ended).complete(2)  # nothing to step: the group ends instead
    assert not total(RoundFlags(starved=1), RoundFlags(starved=1)).complete(2)


# ------------------------------------------------------------------------------------------- cursor
def test_cursor_is_the_lowest_untrained_seq_and_remembers_what_lies_above():
    c = GroupCursor.fresh(2)  # one producer per node
    # node 0: seq 2 still in flight to a replica while 3 was trained (round-robin + join): max+1 would skip 2
    c = c.advance({0: [0, 1, 3], 1: [0, 1]})
    assert c.cursors == ((2,), (2,)) and c.trained_above == (((3,),), ((),))
    c = c.advance({0: [2, 4], 1: []})
    assert c.cursors == ((5,), (2,)) and c.trained_above == (((),), ((),))
    state = c.to_state()
    assert state == {"producers": 1, "cursors": [5, 2], "trained_above": [[], []]}  # the per-node layout
    assert GroupCursor.from_state({"group": state}, 2, 1, "ckpt") == c


def test_cursor_from_a_single_replica_checkpoint_and_refusals():
    assert GroupCursor.from_state({"last_seq": 9}, 1, 1, "ckpt").cursors == ((10,),)
    with pytest.raises(GroupError, match="single-node run"):
        GroupCursor.from_state({"last_seq": 9}, 2, 1, "ckpt")
    with pytest.raises(GroupError, match="over 2 node"):
        GroupCursor.from_state({"group": GroupCursor.fresh(2).to_state()}, 3, 1, "ckpt")


def test_cursor_logs_a_seq_trained_twice(caplog):
    GroupCursor(1, ((4,),), (((6,),),)).advance({0: [3, 6, 4]})
    assert "seqs [3, 6] were trained twice" in caplog.text


# ------------------------------------------------------------------------------------------- environment
def test_env_ranks_from_replica_and_node_and_checks_torchrun_variables():
    env = GroupEnv.resolve(
        {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, replica=1, replicas=2, node_rank=1, nnodes=2
    )
    assert (env.rank, env.world_size, env.local_rank) == (3, 4, 1)
    assert GroupEnv.resolve({}, replica=0, replicas=1, node_rank=0, nnodes=1).world_size == 1  # no group
    with pytest.raises(GroupError, match="RANK=0 in the environment"):
        GroupEnv.resolve({"RANK": "0", "MASTER_PORT": "1"}, replica=1, replicas=2, node_rank=0, nnodes=1)
    with pytest.raises(GroupError, match="needs MASTER_ADDR and MASTER_PORT"):
        GroupEnv.resolve({}, replica=0, replicas=2, node_rank=0, nnodes=1)
    with pytest.raises(GroupError, match="MASTER_ADDR=<unset>"):
        GroupEnv.resolve({"MASTER_PORT": "1"}, replica=0, replicas=1, node_rank=0, nnodes=2)


def test_buckets_split_by_dtype_and_size():
    ts = [torch.zeros(4), torch.zeros(4), torch.zeros(2, dtype=torch.float64), torch.zeros(8)]
    assert [len(b) for b in _buckets(ts, 32)] == [2, 1, 1]
    assert [len(b) for b in _buckets(ts, 16)] == [1, 1, 1, 1]


def test_launch_plan_gives_each_replica_its_rank_and_each_drafter_its_port(tmp_path):
    job = parse_job(
        {
            "job": {"run_dir": str(tmp_path)},
            "target": {"path": "t"},
            "data": {"path": "d"},
            "drafters": [{"name": "a", "replicas": 2}, {"name": "b"}],
        }
    )
    procs = {p.name: p for p in plan(job, "job.toml", "py", node_rank=1, nnodes=2, master_addr="h", master_port=30000)}
    a1, b0 = procs["consumer-a-r1"].env, procs["consumer-b-r0"].env
    assert (a1["RANK"], a1["WORLD_SIZE"], a1["LOCAL_RANK"], a1["MASTER_PORT"]) == ("3", "4", "1", "30000")
    assert (b0["RANK"], b0["WORLD_SIZE"], b0["MASTER_PORT"], b0["MASTER_ADDR"]) == ("1", "2", "30001", "h")
    assert procs["consumer-a-r1"].command[:2] == ["env", "MASTER_ADDR=h"]
    one_node = {p.name: p for p in plan(job, "job.toml", "py")}
    assert one_node["consumer-b-r0"].env == {} and one_node["consumer-b-r0"].command[0] == "py"


# ------------------------------------------------------------------------------------------- two processes
def worker(rank: int, port: int, data: str, out: str) -> None:
    """One replica: step 1 sums batch A (rank 0) and B (rank 1); step 2 has A on rank 0 and nothing on rank 1."""
    from consumer.distributed import ReplicaGroup

    torch.set_num_threads(1)
    d = torch.load(data, weights_only=True)
    env = GroupEnv.resolve(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, replica=rank, replicas=2, node_rank=0, nnodes=1
    )
    group = ReplicaGroup(env, torch.device("cpu"), timeout_s=60)
    trainer = Trainer(drafter_cfg(anchors_per_seq=64), load_target_parts(d["target"]), LAYER_IDS, "cpu")
    steps = []  # the step's gradient as the optimizer sees it: Σ grad / Σw over the group

    def sync(params, weight, loss):
        group.sum_grads(params, weight, loss)
        steps.append([p.grad / weight for p in params])

    trainer.grad_sync = sync
    state = group.broadcast_state(lambda: ("here", {"x": torch.arange(3)}) if rank == 0 else None)
    group.broadcast_params(trainer.params)
    trainer.accumulate(*d["batches"][rank], seq=rank)
    trainer.optimizer_step(rank)
    if rank == 0:
        trainer.accumulate(*d["batches"][0], seq=2)
    trainer.optimizer_step(2 if rank == 0 else rank)
    trained = group.gather_trained([0, 2] if rank == 0 else [1])
    params = [p.detach().clone() for p in trainer.params]
    torch.save({"params": params, "steps": steps, "state": state, "trained": trained}, out)
    group.close()


@pytest.mark.slow
def test_two_gloo_replicas_step_exactly_like_one_trainer_over_both_batches(tmp_path):
    """Σw·CE / Σw over the group: batches of different weight, summed, equal one trainer's accumulated
    step (anchors cover every position, so no randomness differs); a step where one replica has no batch
    equals one trainer's step on the other's; both replicas end with identical bits."""
    model = tiny_target(tmp_path / "target")
    batches = []
    for lengths, seed in (([40, 56], 1), ([24], 2)):
        seqs = distinct_seqs(lengths, seed=seed)
        ids, mask, cu = packed(seqs)
        batches.append((target_features(model, seqs), ids, mask, cu))
    torch.save({"target": str(tmp_path / "target"), "batches": batches}, tmp_path / "data.pt")
    code = "import sys; from tests.consumer.test_scaleout_unit import worker; worker(int(sys.argv[1]), *sys.argv[2:])"
    run_ranks(lambda r, port: ["-c", code, r, port, tmp_path / "data.pt", tmp_path / f"r{r}.pt"], timeout=120)

    ref = Trainer(drafter_cfg(anchors_per_seq=64), load_target_parts(tmp_path / "target"), LAYER_IDS, "cpu")
    ref_steps = []
    ref.grad_sync = lambda params, weight, loss: ref_steps.append([p.grad / weight for p in params])
    ref.accumulate(*batches[0], seq=0)
    ref.accumulate(*batches[1], seq=1)
    ref.optimizer_step(1)
    ref.accumulate(*batches[0], seq=2)
    ref.optimizer_step(2)
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt", weights_only=True) for r in range(2))
    for got0, got1, want in zip(r0["steps"], r1["steps"], ref_steps, strict=True):
        for a, b, w in zip(got0, got1, want, strict=True):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-7)
    for a, b, want in zip(r0["params"], r1["params"], ref.params, strict=True):
        assert torch.equal(a, b)  # bit-identical replicas
        torch.testing.assert_close(a, want.detach(), rtol=1e-5, atol=1e-6)
    assert r1["state"][0] == "here" and torch.equal(r1["state"][1]["x"], torch.arange(3))
    assert r0["trained"] == r1["trained"] == {0: [0, 2, 1]}
