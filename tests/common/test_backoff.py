"""common/backoff.py: the producer's poll of a slot's write event gives the core back (issue 34 §3), measured
with bench/wait_cpu.py's CPU share of a wait (process_time over wall time)."""

from bench.wait_cpu import host_wait
from common.backoff import CAP_S, FIRST_S, Backoff


def test_delays_double_from_50_us_to_a_1_ms_cap():
    b = Backoff()
    assert [round(b.next() * 1e6) for _ in range(8)] == [50, 100, 200, 400, 800, 1000, 1000, 1000]
    assert (FIRST_S, CAP_S) == (50e-6, 1e-3)


def test_a_backoff_wait_burns_under_half_the_cpu_of_a_spinning_one():
    """Medians of 3 waits of 0.2 s each; on an idle core spinning is ~1.0 and the backoff ~0.01."""
    spin = sorted(host_wait("spin", 0.2) for _ in range(3))[1]
    backoff = sorted(host_wait("backoff", 0.2) for _ in range(3))[1]
    assert backoff < 0.5 * spin, (backoff, spin)
