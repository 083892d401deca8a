"""ProfileStats arithmetic, snapshots of plain values, deltas and the log line."""

import json

import msgpack
import pytest

from common.profile import ProfileStats, format_profile_line, snapshot_delta
from tests.conftest import requires_cuda


def test_timer_totals_count_sum_max_min():
    prof = ProfileStats()
    for s in (0.5, 0.25, 2.0, 1.0):
        prof.add("forward", s)
    t = prof.snapshot()["timers"]["forward"]
    assert t["count"] == 4
    assert t["sum_s"] == pytest.approx(3.75)
    assert t["max_s"] == 2.0
    assert t["min_s"] == 0.25


def test_timer_context_manager_adds_elapsed_and_records_on_exception():
    prof = ProfileStats()
    with prof.timer("data"):
        sum(range(1000))
    with pytest.raises(ValueError), prof.timer("data"):
        raise ValueError("boom")
    t = prof.snapshot()["timers"]["data"]
    assert t["count"] == 2
    assert 0.0 < t["sum_s"] < 5.0
    assert t["min_s"] <= t["max_s"]


def test_nested_timers_of_one_key_both_count():
    prof = ProfileStats()
    with prof.timer("step"), prof.timer("step"):
        pass
    assert prof.snapshot()["timers"]["step"]["count"] == 2


def test_counters_and_gauges():
    prof = ProfileStats()
    prof.count("tokens", 100)
    prof.count("tokens", 28)
    prof.count("batches")
    for v in (3.0, 1.0, 2.0):
        prof.gauge("loss", v)
    snap = prof.snapshot()
    assert snap["counters"] == {"tokens": 128, "batches": 1}
    assert snap["gauges"]["loss"] == {"last": 2.0, "count": 3, "sum": 6.0, "max": 3.0, "min": 1.0}


def test_non_python_numbers_are_rejected_with_the_key_named():
    class FakeTensor:
        def __float__(self):
            raise AssertionError("would sync the GPU")

    prof = ProfileStats()
    with pytest.raises(TypeError, match="loss"):
        prof.gauge("loss", FakeTensor())
    with pytest.raises(TypeError, match="tokens"):
        prof.count("tokens", FakeTensor())


def test_snapshot_is_plain_python_and_detached():
    prof = ProfileStats()
    prof.add("forward", 0.1)
    prof.count("tokens", 5)
    prof.gauge("lr", 1e-3)
    snap = prof.snapshot()

    def plain(x):
        if isinstance(x, dict):
            return all(type(k) is str and plain(v) for k, v in x.items())
        return type(x) in (int, float)

    assert plain(snap)
    assert msgpack.unpackb(msgpack.packb(snap)) == snap
    json.dumps(snap)
    prof.add("forward", 0.1)
    prof.count("tokens", 5)
    assert snap["timers"]["forward"]["count"] == 1
    assert snap["counters"]["tokens"] == 5


def test_recent_max_resets_per_snapshot_and_delta_uses_it():
    prof = ProfileStats()
    prof.add("forward", 3.0)
    prof.count("tokens", 10)
    prof.gauge("loss", 4.0)
    first = prof.snapshot()
    assert first["timers"]["forward"]["recent_max_s"] == 3.0
    prof.add("forward", 1.0)
    prof.add("forward", 2.0)
    prof.count("tokens", 7)
    prof.gauge("loss", 2.0)
    prof.gauge("loss", 1.0)
    second = prof.snapshot()
    assert second["timers"]["forward"]["max_s"] == 3.0
    assert second["timers"]["forward"]["recent_max_s"] == 2.0
    d = snapshot_delta(first, second)
    assert d["timers"]["forward"] == {"count": 2, "sum_s": 3.0, "mean_s": 1.5, "max_s": 2.0}
    assert d["counters"]["tokens"] == 7
    assert d["gauges"]["loss"] == {"last": 1.0, "count": 2, "mean": 1.5}
    since_start = snapshot_delta(None, second)
    assert since_start["timers"]["forward"]["count"] == 3
    assert since_start["counters"]["tokens"] == 17


def test_delta_omits_timers_that_did_not_run():
    prof = ProfileStats()
    prof.add("a", 1.0)
    s1 = prof.snapshot()
    prof.add("b", 1.0)
    d = snapshot_delta(s1, prof.snapshot())
    assert set(d["timers"]) == {"b"}


def test_profile_line_orders_by_total_time_and_reports_share():
    prof = ProfileStats()
    prof.add("small", 0.001)
    for _ in range(4):
        prof.add("big", 0.5)
    prof.count("tokens", 400)
    line = format_profile_line(prof.snapshot(), wall_s=4.0)
    assert line.index("big") < line.index("small")
    assert "big 4×500.00ms (max 500.00) 50.0%" in line
    assert "tokens=100/s" in line
    assert "small" not in format_profile_line(prof.snapshot(), wall_s=4.0, top=1)


def test_profile_line_of_empty_snapshot():
    assert format_profile_line(ProfileStats().snapshot(), wall_s=0.0) == "prof 0.0s"


@pytest.mark.cuda
@requires_cuda
def test_cuda_timer_reads_only_completed_events():
    import torch

    prof = ProfileStats()
    with prof.cuda_timer("sleep"):
        torch.cuda._sleep(200_000_000)  # keeps the GPU busy well past the next line
    prof.collect_cuda()
    assert "sleep" not in prof.snapshot()["gpu_timers"]  # not finished: not read, not waited for
    torch.cuda.synchronize()  # the test may wait; collect_cuda never does
    prof.collect_cuda()
    t = prof.snapshot()["gpu_timers"]["sleep"]
    assert t["count"] == 1 and t["sum_s"] > 0
