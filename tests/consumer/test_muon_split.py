"""Muon with Newton–Schulz split over the replicas (consumer/muon.py, issue 34 §1): on one process the step is
torch.optim.Muon's, bit for bit; over 2 and 3 gloo processes, replicated weights (the replicas' all-reduce
path) and FSDP2 row shards step to the same bits as the unsplit torch.optim.Muon, through a skipped
non-finite step, while each replica orthogonalises only its share of the matrices."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

from common.flop_model import newton_schulz_flops
from consumer.muon import SplitMuon, assign_owners, rounds
from tests.jobs import run_ranks

# uneven counts and awkward shapes: tall, wide, rows not divisible by 2 or 3, and a 2-row matrix that leaves
# the third FSDP replica an empty shard
SHAPES = [(7, 5), (4, 9), (2, 3), (16, 16), (10, 33)]
HYPER = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "adjust_lr_fn": "match_rms_adamw"}
STEPS = 4
SKIPPED = 2  # this step's gradients hold a NaN and found_inf is set: nothing may move


def grads_at(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(s, generator=g) for s in SHAPES]
    if step == SKIPPED:
        out[1][0, 0] = math.nan
    return out


def initial() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


def reference() -> list[list[torch.Tensor]]:
    """torch.optim.Muon, unsplit: the weights after each step (the skipped step: skipped by not stepping)."""
    params = [torch.nn.Parameter(w) for w in initial()]
    opt = torch.optim.Muon(params, **HYPER)
    seen = []
    for step in range(STEPS):
        if step != SKIPPED:
            for p, g in zip(params, grads_at(step), strict=True):
                p.grad = g
            opt.step()
        seen.append([p.detach().clone() for p in params])
    return seen


def test_one_process_steps_like_torch_muon_bit_for_bit():
    """Nesterov or not, both lr adjustments, a tall and a wide matrix: weights and momentum equal torch's."""
    for extra in ({}, {"nesterov": False}, {"adjust_lr_fn": "original"}):
        hyper = {**HYPER, **extra}
        a = [torch.nn.Parameter(w) for w in initial()]
        b = [torch.nn.Parameter(w.clone()) for w in initial()]
        ta, sb = torch.optim.Muon(a, **hyper), SplitMuon(b, **hyper)
        for step in range(3):
            for x, y, g in zip(a, b, grads_at(step + SKIPPED + 1), strict=True):
                x.grad, y.grad = g, g.clone()
            sb.found_inf = torch.zeros(()) if step == 1 else None  # the masked path, not skipping
            ta.step()
            sb.step()
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), extra
            assert torch.equal(ta.state[x]["momentum_buffer"], sb.state[y]["momentum_buffer"]), extra
        assert sb.state_dict()["param_groups"] == ta.state_dict()["param_groups"]  # the checkpoint format


def test_a_torch_muon_state_loads_into_split_muon_and_steps_on_alike():
    a = [torch.nn.Parameter(w) for w in initial()]
    ta = torch.optim.Muon(a, **HYPER)
    for p, g in zip(a, grads_at(0), strict=True):
        p.grad = g
    ta.step()
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    sb = SplitMuon(b, **HYPER)
    sb.load_state_dict(copy.deepcopy(ta.state_dict()))  # as from disk: no tensor shared with `ta`
    for x, y, g in zip(a, b, grads_at(1), strict=True):
        x.grad, y.grad = g, g.clone()
    ta.step()
    sb.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_owners_balance_newton_schulz_flops_for_uneven_counts():
    costs = [newton_schulz_flops([s], 5) for s in SHAPES]
    assert assign_owners(costs, 1) == [0] * 5
    two = assign_owners(costs, 2)
    assert two == assign_owners(costs, 2) and sorted(set(two)) == [0, 1]
    loads = [sum(c for c, o in zip(costs, two, strict=True) if o == r) for r in range(2)]
    assert max(loads) <= sum(costs) - min(loads) and max(loads) < sum(costs)
    # equal matrices: a replica each, the remainder to the lowest ranks
    assert assign_owners([1.0] * 5, 3) == [0, 1, 2, 0, 1]
    # one large matrix and many small: the large one alone on one replica
    assert assign_owners([10.0, 1.0, 1.0, 1.0, 1.0], 2) == [0, 1, 1, 1, 1]
    # rounds: each replica's j-th largest matrix in round j; alone, one matrix a round
    assert rounds([10.0, 1.0, 2.0, 1.0, 1.0], [0, 1, 1, 1, 1]) == [[0, 2], [1], [3], [4]]
    assert rounds([1.0, 3.0, 2.0], [0, 0, 0]) == [[1], [2], [0]]


# ------------------------------------------------------------------------------------------- the group
def worker(rank: int, port: int, world: int, out: str) -> None:
    """One replica: the schedule stepped by SplitMuon on replicated weights and on FSDP2 row shards; writes
    the largest difference from torch.optim.Muon's weights at every step, and the FLOPs it orthogonalised."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    import consumer.muon as muon

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    done_flops = {"replicated": 0.0, "fsdp": 0.0}
    layout = "replicated"
    plain_ns = muon.newton_schulz

    def counting(update, coefficients, steps, eps):
        done_flops[layout] += newton_schulz_flops([tuple(update.shape)], steps)
        return plain_ns(update, coefficients, steps, eps)

    muon.newton_schulz = counting
    want = reference()
    diffs: dict[str, list[float]] = {}
    for layout in ("replicated", "fsdp"):
        module = torch.nn.ParameterList([torch.nn.Parameter(w) for w in initial()])
        if layout == "fsdp":
            mesh = init_device_mesh("cpu", (world,))
            fully_shard(module, mesh=mesh)
        params = list(module.parameters())
        opt = SplitMuon(params, **HYPER)
        if layout == "replicated":
            opt.split_over(dist.group.WORLD)
        diffs[layout] = []
        for step in range(STEPS):
            for p, g in zip(params, grads_at(step), strict=True):
                p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
            opt.found_inf = torch.tensor(float(step == SKIPPED))
            opt.step()
            got = [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in params]
            diffs[layout].append(max(float((a - b).abs().max()) for a, b in zip(got, want[step], strict=True)))
        assert all(isinstance(p, DTensor) for p in params) == (layout == "fsdp")
    with open(out, "w") as f:
        json.dump({"diffs": diffs, "flops": done_flops}, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_split_steps_equal_unsplit_torch_muon_and_each_replica_does_its_share(tmp_path, world):
    """Bit for bit (max |Δ| = 0): momentum and the weight update are element-wise on each replica's
    storage, and each matrix's Newton–Schulz runs once, on the same bf16 input as unsplit."""
    code = (
        "import sys; from tests.consumer.test_muon_split import worker; worker(*map(int, sys.argv[1:4]), sys.argv[4])"
    )
    run_ranks(lambda r, port: ["-c", code, r, port, world, tmp_path / f"r{r}.json"], ranks=world, timeout=180)
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]
    want = reference()
    moved = max(float((a - b).abs().max()) for a, b in zip(want[-1], initial(), strict=True))
    assert moved > 1e-2  # the steps moved the weights
    for res in results:
        assert res["diffs"] == {"replicated": [0.0] * STEPS, "fsdp": [0.0] * STEPS}
    costs = [newton_schulz_flops([s], 5) for s in SHAPES]
    owners = assign_owners(costs, world)
    for layout in ("replicated", "fsdp"):
        done = [res["flops"][layout] for res in results]
        share = [STEPS * sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(world)]
        assert done == pytest.approx(share)  # every step, the skipped one too (its result is discarded)
        assert sum(done) == pytest.approx(STEPS * sum(costs)) and all(0 < d < sum(done) for d in done)


def dying_worker(rank: int, port: int, out: str) -> None:
    """Rank 1 leaves the group before the step; rank 0 steps and writes the error it got."""
    import torch.distributed as dist

    from consumer.distributed import GroupError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:
        dist.barrier()
        os._exit(0)  # gone without a word: its peer sees the connection close
    params = [torch.nn.Parameter(w) for w in initial()]
    opt = SplitMuon(params, **HYPER)
    opt.split_over(dist.group.WORLD)
    for p, g in zip(params, grads_at(0), strict=True):
        p.grad = g
    dist.barrier()
    try:
        opt.step()
        message = "no error"
    except GroupError as err:
        message = str(err)
    with open(out, "w") as f:
        f.write(message)
    os._exit(0)


@pytest.mark.slow
def test_a_replica_gone_during_the_exchange_is_a_group_error_naming_it(tmp_path):
    code = "import sys; from tests.consumer.test_muon_split import dying_worker; dying_worker(*map(int, sys.argv[1:3]), sys.argv[3])"
    run_ranks(lambda r, port: ["-c", code, r, port, tmp_path / "err.txt"], timeout=120)
    message = (tmp_path / "err.txt").read_text()
    assert message.startswith("Muon on replica 0: the group failed during the Newton–Schulz exchange"), message
