"""NVML sampling (package nvidia-ml-py, module `pynvml`) in background threads; never a CUDA context.

Devices are keyed by UUID (NVML indexes ignore CUDA_VISIBLE_DEVICES). A field that raises NotSupported
is dropped for that device after its first failure; no NVML at all (no driver, no library) is logged
once and the sampler stays empty. NVML calls serialise in the driver and PCIe throughput blocks for
20 ms, so everything runs at ~1 Hz off the telemetry loop; ECC / remapped rows every `slow_every`.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

# clock-event reason bits worth a metric of their own (nvmlClocksEventReason*)
CLOCK_EVENT_FLAGS = {"power_cap": 0x4 | 0x80, "hw_slowdown": 0x8, "thermal": 0x20 | 0x40}


def _fast_fields(nv: ModuleType) -> dict[str, Callable[[Any], dict[str, float]]]:
    """Field name -> reader of one device handle, sampled every interval."""

    def utilization(h):
        u = nv.nvmlDeviceGetUtilizationRates(h)
        return {"util_pct": u.gpu, "mem_util_pct": u.memory}

    def memory(h):
        m = nv.nvmlDeviceGetMemoryInfo(h)
        return {"memory_used_bytes": m.used, "memory_total_bytes": m.total}

    def clock_events(h):
        mask = nv.nvmlDeviceGetCurrentClocksEventReasons(h)
        flags = {f"clock_event_{k}": float(bool(mask & bits)) for k, bits in CLOCK_EVENT_FLAGS.items()}
        return {"clock_event_reasons": mask, **flags}

    return {
        "utilization": utilization,
        "memory": memory,
        "power": lambda h: {"power_w": nv.nvmlDeviceGetPowerUsage(h) / 1e3},
        "power_limit": lambda h: {"power_limit_w": nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3},
        "energy": lambda h: {"energy_mj": nv.nvmlDeviceGetTotalEnergyConsumption(h)},
        "temperature": lambda h: {"temperature_c": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)},
        "sm_clock": lambda h: {"sm_clock_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)},
        "mem_clock": lambda h: {"mem_clock_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)},
        "clock_events": clock_events,
        "pcie_tx": lambda h: {
            "pcie_tx_bytes_per_s": 1024.0 * nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)
        },
        "pcie_rx": lambda h: {
            "pcie_rx_bytes_per_s": 1024.0 * nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)
        },
    }


def _slow_fields(nv: ModuleType) -> dict[str, Callable[[Any], dict[str, float]]]:
    def ecc(h):
        kind = nv.NVML_VOLATILE_ECC
        return {
            "ecc_uncorrected": nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, kind),
            "ecc_corrected": nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, kind),
        }

    def remapped_rows(h):
        corrected, uncorrected, pending, failed = nv.nvmlDeviceGetRemappedRows(h)
        return {
            "remapped_rows_correctable": corrected,
            "remapped_rows_uncorrectable": uncorrected,
            "remap_pending": float(bool(pending)),
            "remap_failure": float(bool(failed)),
        }

    return {"ecc": ecc, "remapped_rows": remapped_rows}


class _Device:
    def __init__(self, index: int, handle: Any, uuid: str, name: str) -> None:
        self.index, self.handle, self.uuid, self.name = index, handle, uuid, name
        self.unsupported: set[str] = set()
        self.lost = False
        self.values: dict[str, float] = {}
        self.xid_count = 0
        self.last_xid: int | None = None
        self.window_energy: tuple[float, float] | None = None  # (monotonic, energy_mj) at last window


class NvmlSampler:
    """Samples every GPU at `interval_s` in its own thread; `window()` returns per-GPU figures."""

    def __init__(
        self,
        interval_s: float,
        log: logging.Logger,
        nvml: ModuleType | None = None,
        slow_every: int = 10,
    ) -> None:
        self.interval_s, self.log, self.slow_every = interval_s, log, slow_every
        self.error: str | None = None  # why NVML is unavailable
        self.errors = 0  # transient call failures
        self.devices: list[_Device] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.nv = self._init(nvml)

    @property
    def available(self) -> bool:
        return self.nv is not None

    def _init(self, nvml: ModuleType | None) -> ModuleType | None:
        try:
            nv = nvml or importlib.import_module("pynvml")
            nv.nvmlInit()
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                self.devices.append(_Device(i, h, str(nv.nvmlDeviceGetUUID(h)), str(nv.nvmlDeviceGetName(h))))
        except Exception as err:  # ImportError, NVMLError_LibraryNotFound / DriverNotLoaded / NoPermission
            self.error = f"{type(err).__name__}: {err}"
            self.log.warning("NVML unavailable (%s): GPU metrics disabled for this run", self.error)
            return None
        self._fast, self._slow = _fast_fields(nv), _slow_fields(nv)
        self.log.info("NVML: %d GPU(s) %s", len(self.devices), [d.uuid for d in self.devices])
        return nv

    def start(self) -> None:
        if not self.available:
            return
        self._threads = [
            threading.Thread(target=self._sample_loop, name="nvml-sampler", daemon=True),
            threading.Thread(target=self._xid_loop, name="nvml-xid", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop the threads within timeout_s in all; True when they joined. NVML is shut down only then: a
        thread still inside an NVML call (a hung driver) must not find the library gone under it."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            self.log.error(
                "NVML: thread(s) %s did not stop within %.1f s (a hung driver call?); NVML left initialised",
                stuck,
                timeout_s,
            )
            return False
        if self.available:
            try:
                self.nv.nvmlShutdown()
            except Exception as err:
                self.log.debug("nvmlShutdown: %s", err)
        return True

    def sample_once(self, slow: bool) -> None:
        """Read every supported field of every device (the sampler thread calls this)."""
        fields = {**self._fast, **self._slow} if slow else self._fast
        for dev in self.devices:
            if dev.lost:
                continue
            values: dict[str, float] = {}
            for field, read in fields.items():
                if field in dev.unsupported:
                    continue
                try:
                    values.update({k: float(v) for k, v in read(dev.handle).items()})
                except self.nv.NVMLError_NotSupported:
                    dev.unsupported.add(field)
                    self.log.info("NVML: %s not supported on GPU %d (%s); no longer polled", field, dev.index, dev.uuid)
                except self.nv.NVMLError_GpuIsLost:
                    dev.lost = True
                    self.log.error("NVML: GPU %d (%s) is lost", dev.index, dev.uuid)
                    break
                except self.nv.NVMLError as err:
                    self.errors += 1
                    self.log.debug("NVML: %s on GPU %d failed: %s", field, dev.index, err)
            with self._lock:
                dev.values.update(values)

    def window(self, now: float) -> list[dict[str, Any]]:
        """Latest figures per GPU, with the energy-derived average power since the previous call."""
        out = []
        with self._lock:
            for dev in self.devices:
                figures: dict[str, Any] = {"index": dev.index, "uuid": dev.uuid, "name": dev.name}
                figures.update(dev.values)
                figures["lost"] = dev.lost
                figures["xid_count"] = dev.xid_count
                figures["last_xid"] = dev.last_xid
                energy = dev.values.get("energy_mj")
                if energy is not None:
                    if dev.window_energy is not None and now > dev.window_energy[0]:
                        t0, e0 = dev.window_energy
                        figures["energy_j"] = (energy - e0) / 1e3
                        figures["energy_avg_w"] = (energy - e0) / 1e3 / (now - t0)
                    dev.window_energy = (now, energy)
                out.append(figures)
        return out

    def _sample_loop(self) -> None:
        n = 0
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.sample_once(slow=n % self.slow_every == 0)
            except Exception:  # not an NVMLError (a binding that changed shape): keep sampling, say it once
                self.errors += 1
                if self.errors == 1:
                    self.log.exception("NVML: sampling failed")
            n += 1
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def _xid_loop(self) -> None:
        """XID critical errors: one event set per device, polled with a short wait."""
        nv, sets = self.nv, []
        for dev in self.devices:
            try:
                es = nv.nvmlEventSetCreate()
                nv.nvmlDeviceRegisterEvents(dev.handle, nv.nvmlEventTypeXidCriticalError, es)
                sets.append((dev, es))
            except nv.NVMLError as err:
                self.log.info("NVML: XID events unavailable on GPU %d: %s", dev.index, err)
        while sets and not self._stop.is_set():
            for dev, es in sets:
                try:
                    data = nv.nvmlEventSetWait_v2(es, 200)
                except nv.NVMLError_Timeout:
                    continue
                except nv.NVMLError as err:
                    self.log.debug("NVML: event wait on GPU %d: %s", dev.index, err)
                    self._stop.wait(1.0)
                    continue
                with self._lock:
                    dev.xid_count += 1
                    dev.last_xid = int(data.eventData)
                self.log.error("NVML: XID %d on GPU %d (%s)", data.eventData, dev.index, dev.uuid)
        for _, es in sets:
            try:
                nv.nvmlEventSetFree(es)
            except nv.NVMLError:
                pass
