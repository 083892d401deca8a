"""The NVML sampler and XID threads against a complete fake driver (tests/fake_nvml.py) and, on a GPU, the
real library (issue 13 item 10): every pynvml name the code uses exists in pynvml and in the fake; the
threads run for real, stop() joins them and shuts NVML down; GPU UUIDs are the ones publishers report."""

from __future__ import annotations

import ast
import logging
import threading
import time
import types
from pathlib import Path

import pynvml
import pytest
import torch

from common.config import JobConfig
from common.profile import ProfileStats
from common.stats import StatsPublisher, ingest_endpoint
from telemetry import nvml as nvml_module
from telemetry.nvml import NvmlSampler
from telemetry.service import TelemetryService
from tests.conftest import requires_cuda
from tests.fake_nvml import FUNCTIONS, FakeNvml

LOG = logging.getLogger("nvml-test")
UUIDS = ("GPU-5a3b9c1d-0e2f-4a6b-8c7d-9e0f1a2b3c4d", "GPU-0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b")


def names_the_code_uses() -> set[str]:
    """Every attribute telemetry/nvml.py reads from the NVML module (`nv.X`, `self.nv.X`)."""
    tree = ast.parse(Path(nvml_module.__file__).read_text())
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "nv") or (
                isinstance(owner, ast.Attribute) and owner.attr == "nv"
            ):
                used.add(node.attr)
    return used


def wait_for(what: str, done, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


def test_every_nvml_name_the_code_uses_is_real_and_faked():
    used = names_the_code_uses()
    assert {"nvmlInit", "nvmlEventSetWait_v2", "nvmlDeviceGetRemappedRows", "NVMLError_Timeout"} <= used
    assert sorted(n for n in used if not hasattr(pynvml, n)) == []  # a typo or a name pynvml dropped
    functions = {n for n in used if callable(getattr(pynvml, n)) and not isinstance(getattr(pynvml, n), type)}
    assert sorted(functions - set(FUNCTIONS)) == []  # the fake lacks a function the code calls
    fake = FakeNvml()
    for name in used:
        getattr(fake, name)
    assert fake.missing == []


def test_the_fake_refuses_what_it_lacks_and_wrong_arguments():
    fake = FakeNvml()
    with pytest.raises(AttributeError, match="nvmlDeviceGetFanSpeed"):
        fake.nvmlDeviceGetFanSpeed  # noqa: B018
    assert fake.missing == ["nvmlDeviceGetFanSpeed"]
    fake.nvmlInit()
    with pytest.raises(TypeError):
        fake.nvmlDeviceGetTemperature(fake.nvmlDeviceGetHandleByIndex(0))  # the sensor argument is missing


def test_threads_sample_catch_an_xid_and_stop_cleanly(caplog):
    fake = FakeNvml(UUIDS, unsupported=("nvmlDeviceGetPcieThroughput",))
    sampler = NvmlSampler(0.05, LOG, nvml=fake, slow_every=3)
    assert [d.uuid for d in sampler.devices] == list(UUIDS)
    sampler.start()
    try:
        wait_for("ten samples of each GPU", lambda: fake.calls["nvmlDeviceGetUtilizationRates"] >= 20)
        wait_for("both XID event sets registered", lambda: fake.calls["nvmlDeviceRegisterEvents"] == 2)
        fake.xid(1, 79)  # "GPU has fallen off the bus"
        wait_for("the XID", lambda: sampler.window(time.monotonic())[1]["xid_count"] == 1)
    finally:
        joined = sampler.stop(timeout_s=2.0)
    assert joined and not any(t.is_alive() for t in sampler._threads)
    assert fake.initialised == 0 and fake.open_event_sets == 0  # nvmlShutdown called, event sets freed
    assert fake.missing == []
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 4  # tx and rx once per GPU, then dropped
    first, second = sampler.window(time.monotonic())
    assert (first["uuid"], second["uuid"]) == UUIDS
    assert first["util_pct"] == 80 and second["util_pct"] == 81 and first["sm_clock_mhz"] == 1980
    assert first["clock_event_power_cap"] == 1.0 and first["remapped_rows_correctable"] == 1
    assert (first["xid_count"], second["xid_count"], second["last_xid"]) == (0, 1, 79)
    assert f"NVML: XID 79 on GPU 1 ({UUIDS[1]})" in caplog.text


def test_a_hung_driver_call_is_reported_and_nvml_left_alone(caplog):
    fake = FakeNvml(UUIDS[:1])
    release = threading.Event()
    wait = fake.nvmlEventSetWait_v2

    def hung(es, timeout_ms):
        release.wait(30)  # a driver call that ignores its timeout
        return wait(es, timeout_ms)

    fake.nvmlEventSetWait_v2 = hung
    sampler = NvmlSampler(0.05, LOG, nvml=fake)
    sampler.start()
    wait_for("the XID thread in its wait", lambda: fake.calls["nvmlDeviceRegisterEvents"] == 1)
    assert sampler.stop(timeout_s=0.3) is False
    assert "did not stop within 0.3 s" in caplog.text and fake.initialised == 1  # no shutdown under it
    release.set()
    for t in sampler._threads:
        t.join(5)
    assert not any(t.is_alive() for t in sampler._threads)


def test_gpu_uuids_in_windows_match_the_publishers(tmp_path, monkeypatch):
    """A real telemetry service with the fake NVML, and a real publisher of a process that uses CUDA device 1
    (torch.cuda answers stubbed: this machine has no GPU): the window's GPU list and the process's gpu_uuid
    name the same GPU, as NVML spells it."""
    run = Path(f"/tmp/dfn-{tmp_path.name[-12:]}")
    job = JobConfig.model_validate(
        {
            "job": {"run_dir": str(run)},
            "target": {"path": "unused"},
            "data": {"path": "unused"},
            "drafters": [{"name": "d0"}],
            "telemetry": {"interval_s": 0.1, "window_s": 0.3, "nvml_interval_s": 0.05, "wandb_mode": "disabled"},
        }
    )
    fake = FakeNvml(UUIDS)
    service = TelemetryService(job, LOG, nvml=fake)
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,))
    thread.start()
    props = types.SimpleNamespace(uuid=UUIDS[1].removeprefix("GPU-"))  # torch prints its CUuuid 8-4-4-4-12
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"allocated_bytes.all.current": 5})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    prof = ProfileStats()
    publisher = StatsPublisher(ingest_endpoint(job.run_paths), "consumer", "d0_r0", 0.0, prof, logger=LOG)
    try:

        def joined() -> bool:
            prof.count("tokens", 10)
            publisher.publish()
            docs = service_docs(run)
            return any(d["sources"] and d["gpus"] for d in docs)

        wait_for("a window with the process and the GPUs", joined)
    finally:
        publisher.close(final=True, linger_ms=200)
        stop.set()
        thread.join(10)
    assert not thread.is_alive() and fake.initialised == 0 and fake.missing == []
    doc = next(d for d in service_docs(run) if d["sources"] and d["gpus"])
    (source,) = doc["sources"]
    assert [g["uuid"] for g in doc["gpus"]] == list(UUIDS)
    assert source["gpu_uuid"] == UUIDS[1] == doc["gpus"][1]["uuid"]


def service_docs(run: Path) -> list[dict]:
    import json

    path = run / "telemetry" / "metrics.jsonl"
    return [json.loads(li) for li in path.read_text().splitlines() if li] if path.is_file() else []


@requires_cuda
@pytest.mark.cuda
def test_real_nvml_uuid_is_the_publishers(caplog):
    """On a GPU: the real library's threads run and stop, and device 0's UUID is the one a publisher reports."""
    torch.cuda.init()
    torch.zeros(1, device="cuda:0")
    sampler = NvmlSampler(0.1, LOG)
    assert sampler.available, sampler.error
    sampler.start()
    time.sleep(1.0)
    assert sampler.stop(timeout_s=2.0)
    publisher = StatsPublisher("ipc:///tmp/dfn-real.sock", "consumer", "d0_r0", 0.0, ProfileStats(), logger=LOG)
    try:
        _, uuid, _ = publisher._cuda_memory()
    finally:
        publisher.close()
    nvml_uuids = {d.uuid for d in sampler.devices}
    assert uuid in nvml_uuids, (uuid, nvml_uuids)
    assert all("util_pct" in g for g in sampler.window(time.monotonic()))
