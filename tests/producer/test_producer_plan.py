"""The batch plan: deterministic, resumable at any seq, every sample once per epoch, budget held, shards."""

import numpy as np
import pytest

from producer.plan import BatchPlan, shard_sample_ids

BUDGET = 256


def lengths(n=300, seed=0, max_length=200):
    return np.random.default_rng(seed).integers(1, max_length + 1, size=n).tolist()


def plan(**kw):
    args = dict(lengths=lengths(), seed=7, epochs=3, tokens_per_batch=BUDGET, length_group_window=4)
    args.update(kw)
    return BatchPlan(**args)


def as_tuples(batches):
    return [(b.seq, b.epoch, b.sample_ids, b.num_tokens) for b in batches]


def test_same_inputs_same_plan_and_seed_changes_it():
    a = as_tuples(plan().batches_from(0))
    assert a == as_tuples(plan().batches_from(0))
    assert a != as_tuples(plan(seed=8).batches_from(0))
    assert [s for s, *_ in a] == list(range(len(a)))


@pytest.mark.parametrize("k", [0, 1, 17, 40])
def test_restart_at_seq_k_continues_identically(k):
    full = as_tuples(plan().batches_from(0))
    assert as_tuples(plan().batches_from(k)) == full[k:]


def test_restart_past_the_end_is_empty():
    p = plan()
    assert list(p.batches_from(len(p))) == []


def test_every_sample_once_per_epoch_and_budget_held():
    lens = lengths()
    p = plan(lengths=lens)
    per_epoch: dict[int, list[int]] = {}
    for b in p.batches_from(0):
        assert b.num_tokens == sum(lens[i] for i in b.sample_ids) <= BUDGET
        per_epoch.setdefault(b.epoch, []).extend(b.sample_ids)
    assert sorted(per_epoch) == [0, 1, 2]
    for ids in per_epoch.values():
        assert sorted(ids) == list(range(len(lens)))
    orders = [ids for _, ids in sorted(per_epoch.items())]
    assert orders[0] != orders[1]  # reshuffled per epoch


def test_batches_are_length_grouped_within_windows():
    """Sorting inside a window makes batches more uniform than packing the shuffled order."""
    lens = np.array(lengths(n=2000))
    grouped = BatchPlan(lens, 0, 1, BUDGET, length_group_window=16)
    ungrouped = BatchPlan(lens, 0, 1, BUDGET, length_group_window=1)

    def spread(p):
        return np.mean([np.ptp(lens[list(b.sample_ids)]) for b in p.batches_from(0) if len(b.sample_ids) > 1])

    assert spread(grouped) < 0.5 * spread(ungrouped)


def test_full_budget_sample_is_kept_and_oversized_rejected():
    lens = [BUDGET, 3, BUDGET, 5]
    p = BatchPlan(lens, 0, 1, BUDGET, 2)
    assert sorted(i for b in p.batches_from(0) for i in b.sample_ids) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="sample 1 has 257 tokens"):
        BatchPlan([3, BUDGET + 1], 0, 1, BUDGET, 2)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_shards_are_disjoint_cover_and_deterministic(count):
    n = 101
    shards = [shard_sample_ids(n, 5, i, count) for i in range(count)]
    assert sorted(np.concatenate(shards).tolist()) == list(range(n))
    assert all(np.array_equal(s, shard_sample_ids(n, 5, i, count)) for i, s in enumerate(shards))
    plans = [plan(lengths=lengths(n), shard_index=i, shard_count=count, epochs=1) for i in range(count)]
    seen = [i for p in plans for b in p.batches_from(0) for i in b.sample_ids]
    assert sorted(seen) == list(range(n))
    with pytest.raises(ValueError, match="shard_index"):
        shard_sample_ids(n, 5, count, count)


def test_the_batches_of_an_epoch_do_not_depend_on_the_number_of_epochs():
    """Raising data.epochs appends epochs to the plan: the seqs already trained keep their samples."""
    three, five = plan(epochs=3), plan(epochs=5)
    assert as_tuples(five.batches_from(0))[: len(three)] == as_tuples(three.batches_from(0))
    assert len(five) == len(three) + five.batches_per_epoch(3) + five.batches_per_epoch(4)
    resumed = next(iter(five.batches_from(len(three))))
    assert (resumed.seq, resumed.epoch) == (len(three), 3)
