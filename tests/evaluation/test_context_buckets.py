"""τ by context-length bucket (evaluation/context_buckets.py) against a hand count."""

import pytest

from evaluation.context_buckets import DEFAULT_EDGES, BucketTally, bucket_label, check_edges, format_buckets


def test_steps_fall_in_half_open_buckets_and_tau_is_their_mean():
    tally = BucketTally((4, 8))
    tally.add([1, 3, 4, 7], [2, 1, 5, 3])  # one response
    tally.add([8, 20], [4, 6])  # another
    got = [(b.label, b.low, b.high, b.steps, b.accepted, b.tau) for b in tally.buckets()]
    assert got == [("<4", 0, 4, 2, 3, 1.5), ("4–8", 4, 8, 2, 8, 4.0), ("≥8", 8, None, 2, 10, 5.0)]
    assert format_buckets(tally.buckets()) == "<4 1.50 (2) | 4–8 4.00 (2) | ≥8 5.00 (2)"


def test_default_buckets_are_1k_4k_16k_and_an_empty_one_has_no_tau():
    tally = BucketTally()
    tally.add([1023, 1024, 20_000], [3, 5, 1])
    b = tally.buckets()
    assert DEFAULT_EDGES == (1024, 4096, 16384)
    assert [x.label for x in b] == ["<1K", "1K–4K", "4K–16K", "≥16K"]
    assert [(x.steps, x.tau) for x in b] == [(1, 3.0), (1, 5.0), (0, None), (1, 1.0)]
    assert format_buckets(b).split(" | ")[2] == "4K–16K - (0)"
    assert bucket_label(0, 24) == "<24" and bucket_label(1536, None) == "≥1536"


@pytest.mark.parametrize("edges", [(), (0, 8), (8, 8), (16, 8)])
def test_edges_must_be_positive_and_increasing(edges):
    with pytest.raises(ValueError, match="positive and strictly increasing"):
        check_edges(edges)


def test_one_context_length_per_step():
    with pytest.raises(ValueError, match="2 context lengths for 1 steps"):
        BucketTally().add([5, 6], [1])
