"""Telemetry pieces in isolation: the stats codec, window arithmetic, NVML handling, the W&B file reader."""

import logging
import struct
import zlib

import msgpack
import pynvml
import pytest

from common.profile import ProfileStats
from common.stats import StatsDecodeError, StatsPayload, decode_stats, encode_stats
from telemetry.aggregate import Aggregator, metric_name, source_prefix
from telemetry.nvml import NvmlSampler
from telemetry.sinks import WandbSink
from telemetry.wandb_reader import BLOCK, WandbFileError, iter_payloads
from tests.fake_nvml import FakeNvml


def payload(prof: ProfileStats, seq: int, mono: float, *, role="consumer", name="d0_r0", pid=100, step=None):
    snap = prof.snapshot()
    return StatsPayload(
        role=role,
        name=name,
        pid=pid,
        host="h",
        seq=seq,
        wall_time=1e9 + mono,
        mono_time=mono,
        uptime_s=mono,
        step=step,
        final=False,
        timers=snap["timers"],
        gpu_timers=snap["gpu_timers"],
        counters=snap["counters"],
        gauges=snap["gauges"],
        cuda_memory={},
        cuda_device=None,
        gpu_uuid=None,
        process={"cpu_s": mono / 2, "rss_bytes": 1 << 20},
    )


# ---- codec --------------------------------------------------------------------------------------


def test_stats_codec_round_trip():
    prof = ProfileStats()
    prof.add("forward", 0.01)
    prof.count("tokens", 7)
    prof.gauge("loss", 2.5)
    p = payload(prof, seq=3, mono=10.0, step=42)
    frames = encode_stats(p)
    assert frames[0] == b"stats.consumer.d0_r0"
    assert decode_stats(frames) == p


def _body(**override):
    prof = ProfileStats()
    prof.count("tokens", 1)
    topic, raw = encode_stats(payload(prof, seq=0, mono=1.0))
    body = msgpack.unpackb(raw)
    body.update(override)
    return topic, body


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"stats.consumer.d0_r0"], "expected 2 frames"),
        ([b"stats.consumer.d0_r0", b"\xc1\xc1"], "not valid msgpack"),
        ([b"stats.consumer.d0_r0", msgpack.packb([1, 2])], "expected a map"),
        ([b"stats.consumer.d0_r0", msgpack.packb({"v": 99})], "schema version 99"),
        ([b"stats.consumer.d0_r0", msgpack.packb({"v": 1})], "lacks key"),
    ],
)
def test_decode_rejects_garbage_with_a_reason(frames, reason):
    with pytest.raises(StatsDecodeError, match=reason):
        decode_stats(frames)


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({"seq": "x"}, "seq has type str"),
        ({"counters": {"tokens": "many"}}, r"counters\['tokens'\] must be a number"),
        ({"timers": {"f": {"count": 1}}}, r"timers\['f'\] must be a map with keys"),
        ({"role": "bad.role"}, "role 'bad.role' does not match"),
        ({"source": "producer.producer"}, "do not match"),
        ({"final": 1}, "final has type int"),
    ],
)
def test_decode_rejects_bad_fields(override, reason):
    topic, body = _body(**override)
    with pytest.raises(StatsDecodeError, match=reason):
        decode_stats([topic, msgpack.packb(body)])


def test_decode_rejects_topic_that_does_not_match_source():
    _, body = _body()
    with pytest.raises(StatsDecodeError, match="do not match"):
        decode_stats([b"stats.producer.producer", msgpack.packb(body)])


# ---- window arithmetic ---------------------------------------------------------------------------


def test_windows_difference_totals_and_rates_use_source_time():
    prof, agg = ProfileStats(), Aggregator(stale_after_s=10.0)
    prof.count("tokens", 100)
    prof.add("wait_batch", 0.5)
    prof.gauge("loss", 4.0)
    agg.ingest(payload(prof, seq=0, mono=2.0, step=1), now=2.0)  # first message: since start (2 s)
    m1, _ = agg.close_window(now=2.0)
    assert m1["consumer/d0_r0/tokens"] == 100
    assert m1["consumer/d0_r0/tokens_per_s"] == pytest.approx(50.0)
    assert m1["consumer/d0_r0/wait_batch_pct"] == pytest.approx(25.0)

    prof.count("tokens", 300)
    prof.add("wait_batch", 1.0)
    prof.add("wait_batch", 2.0)
    prof.gauge("loss", 2.0)
    prof.gauge("loss", 1.0)
    agg.ingest(payload(prof, seq=1, mono=5.0, step=2), now=5.0)
    prof.count("tokens", 60)
    agg.ingest(payload(prof, seq=2, mono=8.0, step=3), now=8.0)
    m2, summaries = agg.close_window(now=8.0)
    assert m2["consumer/d0_r0/tokens"] == 360
    assert m2["consumer/d0_r0/tokens_per_s"] == pytest.approx(360 / 6.0)
    assert m2["consumer/d0_r0/wait_batch_ms"] == pytest.approx(1500.0)
    assert m2["consumer/d0_r0/wait_batch_max_ms"] == pytest.approx(2000.0)
    assert m2["consumer/d0_r0/wait_batch_pct"] == pytest.approx(50.0)
    assert m2["consumer/d0_r0/loss"] == pytest.approx(1.5)
    assert m2["consumer/d0_r0/step"] == 3.0
    assert m2["consumer/d0_r0/cpu_pct"] == pytest.approx(50.0)
    assert summaries[0]["state"] == "live" and summaries[0]["step"] == 3
    assert summaries[0]["wait_pct"] == pytest.approx(50.0)


def test_sequence_gaps_are_counted_and_totals_survive_them():
    prof, agg = ProfileStats(), Aggregator(stale_after_s=10.0)
    total = 0
    for seq in range(10):
        prof.count("tokens", seq + 1)
        total += seq + 1
        if seq in (3, 4, 7):  # lost in transit
            continue
        agg.ingest(payload(prof, seq=seq, mono=float(seq + 1)), now=float(seq))
    m, summaries = agg.close_window(now=10.0)
    assert agg.gaps == 3 and summaries[0]["gaps"] == 3
    assert m["consumer/d0_r0/tokens"] == total


def test_restart_starts_a_new_baseline():
    agg = Aggregator(stale_after_s=10.0)
    first = ProfileStats()
    first.count("tokens", 500)
    agg.ingest(payload(first, seq=5, mono=5.0, pid=1), now=5.0)
    agg.close_window(now=5.0)
    second = ProfileStats()
    second.count("tokens", 20)
    agg.ingest(payload(second, seq=0, mono=1.0, pid=2), now=6.0)
    m, summaries = agg.close_window(now=6.0)
    assert m["consumer/d0_r0/tokens"] == 20
    assert summaries[0]["restarts"] == 1 and summaries[0]["pid"] == 2


def test_stale_sources_and_replica_balance():
    agg = Aggregator(stale_after_s=3.0)
    for name, tokens in (("d0_r0", 100), ("d0_r1", 50)):
        prof = ProfileStats()
        prof.count("tokens", tokens)
        agg.ingest(payload(prof, seq=0, mono=1.0, name=name), now=0.0)
    prod = ProfileStats()
    for key, n in (("tokens", 400), ("sequences", 8), ("batches", 2), ("loss_tokens", 100)):
        prod.count(key, n)
    prod.add("forward", 0.5)
    prod.add("write_slot", 0.1)
    prod.gauge("slots_in_use", 3.0)
    agg.ingest(payload(prod, seq=0, mono=1.0, role="producer", name="producer"), now=0.0)
    m, summaries = agg.close_window(now=1.0)
    assert m["drafter/d0/replica_balance"] == pytest.approx(0.5)
    assert m["drafter/d0/tokens_per_s"] == pytest.approx(150.0)
    assert m["pipeline/tokens_per_s"] == pytest.approx(400.0)
    assert m["producer/busy_pct"] == pytest.approx(60.0)
    assert m["producer/tokens_per_batch"] == 200.0
    assert m["producer/mean_seq_len"] == 50.0
    assert m["producer/loss_mask_frac"] == 0.25
    assert m["producer/slots_in_use"] == 3.0
    assert all(s["state"] == "live" for s in summaries)
    _, later = agg.close_window(now=5.0)  # stale after 3 s, forgotten after 6 s
    assert [s["state"] for s in later] == ["stale"] * 3
    assert later[0]["tokens_per_s"] == pytest.approx(100.0)  # the last window that had data


def test_metric_names_are_wandb_safe():
    assert metric_name("consumer", "d0_r0", "loss") == "consumer/d0_r0/loss"
    assert metric_name("gpu", 0, "util_pct") == "gpu/0/util_pct"
    assert metric_name("consumer", "d-0.x", "1st key") == "consumer/d_0_x/_1st_key"
    assert source_prefix("producer", "producer") == "producer"
    assert source_prefix("consumer", "d0_r0") == "consumer/d0_r0"


# ---- NVML --------------------------------------------------------------------------------------


def test_nvml_fields_sampled_and_unsupported_ones_dropped_after_first_failure(caplog):
    nv = FakeNvml(("GPU-0000",), unsupported=("nvmlDeviceGetPcieThroughput",))
    sampler = NvmlSampler(1.0, logging.getLogger("t"), nvml=nv)
    assert sampler.available and [d.uuid for d in sampler.devices] == ["GPU-0000"]
    with caplog.at_level(logging.INFO):
        for i in range(3):
            sampler.sample_once(slow=i == 0)
    assert nv.calls["nvmlDeviceGetPcieThroughput"] == 2  # tx and rx once each, then never again
    assert nv.calls["nvmlDeviceGetUtilizationRates"] == 3
    assert nv.calls["nvmlDeviceGetRemappedRows"] == 1
    assert sum("not supported" in r.message for r in caplog.records) == 2
    (first,) = sampler.window(now=10.0)
    assert first["util_pct"] == 80 and first["power_w"] == 350.0 and first["power_limit_w"] == 700.0
    assert first["clock_event_power_cap"] == 1.0 and first["clock_event_thermal"] == 0.0
    assert first["remapped_rows_correctable"] == 1
    assert "pcie_tx_bytes_per_s" not in first and "energy_avg_w" not in first
    sampler.sample_once(slow=False)  # energy +50 J
    (second,) = sampler.window(now=12.0)
    assert second["energy_j"] == pytest.approx(50.0)
    assert second["energy_avg_w"] == pytest.approx(25.0)


def test_nvml_absent_is_reported_once_and_sampler_stays_empty(caplog):
    nv = FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    with caplog.at_level(logging.INFO):
        sampler = NvmlSampler(1.0, logging.getLogger("t"), nvml=nv)
        sampler.start()
        sampler.stop()
    assert not sampler.available and "NVML Shared Library Not Found" in sampler.error
    assert sampler.window(now=1.0) == []
    assert sum("NVML unavailable" in r.message for r in caplog.records) == 1


# ---- W&B sink and file reader ---------------------------------------------------------------------


def test_wandb_queue_full_drops_and_counts(tmp_path):
    sink = WandbSink(
        mode="offline",
        project="p",
        entity=None,
        root_dir=tmp_path,
        group="g",
        run_id="r",
        queue_size=2,
        log=logging.getLogger("t"),
    )  # fmt: skip  (thread never started)
    results = [sink.submit({"a/x": 1.0}, []) for _ in range(5)]
    assert results == [True, True, False, False, False]
    assert sink.dropped == 3 and sink.depth == 2


def _write_log_file(path, payloads):
    """Minimal writer of the LevelDB-log framing, to exercise fragmentation across blocks."""
    out = bytearray(struct.pack("<4sHB", b":W&B", 0xBEE1, 0))
    for data in payloads:
        first = True
        while True:
            room = BLOCK - len(out) % BLOCK
            if room < 7:
                out += b"\0" * room
                continue
            chunk, data = data[: room - 7], data[room - 7 :]
            kind = (1 if not data else 2) if first else (4 if not data else 3)
            out += struct.pack("<IHB", zlib.crc32(bytes([kind]) + chunk), len(chunk), kind) + chunk
            first = False
            if not data:
                break
    path.write_bytes(bytes(out))


def test_reader_reassembles_records_across_blocks_and_checks_crc(tmp_path):
    big = bytes(range(256)) * 400  # 100 KiB: first, middle, middle, last
    payloads = [b"small", big, b"after"]
    path = tmp_path / "run-x.wandb"
    _write_log_file(path, payloads)
    assert list(iter_payloads(path)) == payloads
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(WandbFileError, match="CRC mismatch"):
        list(iter_payloads(path))
    path.write_bytes(b"nope")
    with pytest.raises(WandbFileError, match="shorter than"):
        list(iter_payloads(path))


# ---- bounds against a rogue publisher (issue 24) -----------------------------------------------------------


def test_sources_are_capped_a_newcomer_evicts_a_quiet_one_else_is_refused_and_named(caplog):
    agg = Aggregator(stale_after_s=3.0, max_sources=4)
    for i in range(4):
        assert agg.ingest(payload(ProfileStats(), seq=0, mono=1.0, name=f"d{i}_r0"), now=0.0)
    with caplog.at_level(logging.WARNING, logger="dflash.telemetry"):
        assert not agg.ingest(payload(ProfileStats(), seq=0, mono=1.0, name="rogue"), now=1.0)  # all 4 live
        assert not agg.ingest(payload(ProfileStats(), seq=0, mono=1.0, name="rogue2"), now=1.0)
    assert agg.refused == 2 and sorted(agg.sources) == [f"consumer.d{i}_r0" for i in range(4)]
    assert caplog.text.count("telemetry keeps at most 4 sources") == 1  # named once, then counted
    assert agg.ingest(payload(ProfileStats(), seq=1, mono=2.0, name="d2_r0"), now=4.5)  # d2 stays live
    assert agg.ingest(payload(ProfileStats(), seq=0, mono=1.0, name="new"), now=4.5)  # d0, d1, d3 are stale
    assert agg.evicted == 1 and sorted(agg.sources) == [
        "consumer.d1_r0",
        "consumer.d2_r0",
        "consumer.d3_r0",
        "consumer.new",
    ]


def test_a_silent_source_is_forgotten_after_twice_stale_after_s():
    agg = Aggregator(stale_after_s=3.0)
    agg.ingest(payload(ProfileStats(), seq=0, mono=1.0, name="d0_r0"), now=0.0)
    agg.ingest(payload(ProfileStats(), seq=0, mono=1.0, name="d0_r1"), now=4.0)
    _, summaries = agg.close_window(now=5.9)
    assert [(s["name"], s["state"]) for s in summaries] == [("d0_r0", "stale"), ("d0_r1", "live")]
    _, summaries = agg.close_window(now=6.1)
    assert [s["name"] for s in summaries] == ["d0_r1"] and agg.forgotten == 1


def test_a_source_over_the_rate_limit_loses_messages_never_totals():
    prof, agg = ProfileStats(), Aggregator(stale_after_s=10.0)
    accepted = []
    for seq in range(100):  # 100 messages at one instant: the burst of 40 passes
        prof.count("tokens", 1)
        accepted.append(agg.ingest(payload(prof, seq=seq, mono=1.0 + seq / 1e4), now=0.0))
    assert sum(accepted) == 40 and agg.rate_limited == 60
    m1, _ = agg.close_window(now=0.5)
    prof.count("tokens", 1)
    assert agg.ingest(payload(prof, seq=100, mono=2.0), now=1.0)  # 20 tokens/s refilled
    m2, summaries = agg.close_window(now=1.5)
    assert m1["consumer/d0_r0/tokens"] + m2["consumer/d0_r0/tokens"] == 101
    assert summaries[0]["rate_limited"] == 60 and summaries[0]["gaps"] == 60


def test_a_source_with_thousands_of_keys_keeps_a_small_window():
    from telemetry.aggregate import MAX_FIGURES

    prof, agg = ProfileStats(), Aggregator(stale_after_s=10.0)
    for i in range(1000):
        prof.count(f"k{i}", 1)
    agg.ingest(payload(prof, seq=0, mono=1.0), now=0.0)
    metrics, _ = agg.close_window(now=1.0)
    assert len([k for k in metrics if k.startswith("consumer/d0_r0/")]) == MAX_FIGURES
