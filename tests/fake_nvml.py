"""A fake NVML driver behind pynvml's own names, for the telemetry tests (no tests in here).

Why it can be trusted: its constants and exception classes ARE the installed pynvml's (nvidia-ml-py, a
runtime dependency), every function it offers is checked at each call against the real function's
signature, and asking it for a name it does not provide raises and is recorded in `missing` (a thread
that hits one dies, so tests assert `missing == []` after running the sampler's threads). The test module
checks statically that every pynvml name telemetry/nvml.py uses exists in pynvml and in this fake.
"""

from __future__ import annotations

import inspect
import itertools
import queue
import threading
import time
import types
from collections import Counter
from typing import Any

import pynvml

# what the fake driver implements; everything else in pynvml is reported missing
FUNCTIONS = (
    "nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID",
    "nvmlDeviceGetName", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetClockInfo", "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetPcieThroughput",
    "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows", "nvmlEventSetCreate", "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait_v2", "nvmlEventSetFree",
)  # fmt: skip


class FakeNvml(types.ModuleType):
    """`gpus` UUIDs ("GPU-…", as NVML names them); `unsupported`: functions that raise NotSupported."""

    def __init__(
        self, gpus: tuple[str, ...] = ("GPU-0000",), *, unsupported: tuple[str, ...] = (), init_error: int | None = None
    ):
        super().__init__("fake_pynvml")
        self.uuids = list(gpus)
        self.calls: Counter[str] = Counter()
        self.missing: list[str] = []
        self.initialised = 0
        self.open_event_sets = 0
        self._unsupported = set(unsupported)
        self._init_error = init_error
        self._energy = [itertools.count(0, 50_000) for _ in gpus]  # mJ: +50 J per read
        self._events: dict[int, queue.Queue[int]] = {}  # event set id -> XIDs pending
        self._registered: dict[int, int] = {}  # device index -> event set id
        self._lock = threading.Lock()
        for name in FUNCTIONS:
            self.__dict__[name] = self._checked(name, getattr(self, f"_{name}"))

    # -------------------------------------------------------------------------- pynvml's own names
    def __getattr__(self, name: str) -> Any:
        if name.startswith(("NVML", "nvmlEventType", "nvmlClocksEventReason")) and hasattr(pynvml, name):
            return getattr(pynvml, name)  # constants and exception classes: the real ones
        with self._lock:
            self.missing.append(name)
        raise AttributeError(f"the fake NVML has no {name!r} (telemetry/nvml.py calls a function it lacks)")

    def _checked(self, name: str, impl):
        real = inspect.signature(getattr(pynvml, name))

        def call(*args, **kwargs):
            real.bind(*args, **kwargs)  # a TypeError here: the code calls pynvml with the wrong arguments
            with self._lock:
                self.calls[name] += 1
            if name in self._unsupported:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return impl(*args, **kwargs)

        return call

    def _device(self, handle: Any) -> int:
        if not (isinstance(handle, tuple) and handle[0] == "fake-device" and 0 <= handle[1] < len(self.uuids)):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        return handle[1]

    # -------------------------------------------------------------------------- the driver
    def xid(self, index: int, code: int) -> None:
        """Raise an XID critical error on GPU `index` (delivered to its registered event set)."""
        self._events[self._registered[index]].put(code)

    def _nvmlInit(self):
        if self._init_error is not None:
            raise pynvml.NVMLError(self._init_error)
        self.initialised += 1

    def _nvmlShutdown(self):
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        self.initialised -= 1

    def _nvmlDeviceGetCount(self):
        return len(self.uuids)

    def _nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(self.uuids):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ("fake-device", index)

    def _nvmlDeviceGetUUID(self, handle):
        return self.uuids[self._device(handle)]

    def _nvmlDeviceGetName(self, handle):
        return f"Fake H200 #{self._device(handle)}"

    def _nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=80 + self._device(handle), memory=40)

    def _nvmlDeviceGetMemoryInfo(self, handle, version=None):
        self._device(handle)
        return types.SimpleNamespace(used=2**30, total=141 * 2**30, free=140 * 2**30)

    def _nvmlDeviceGetPowerUsage(self, handle):
        self._device(handle)
        return 350_000  # mW

    def _nvmlDeviceGetEnforcedPowerLimit(self, handle):
        self._device(handle)
        return 700_000

    def _nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return next(self._energy[self._device(handle)])

    def _nvmlDeviceGetTemperature(self, handle, sensor):
        self._device(handle)
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return 61

    def _nvmlDeviceGetClockInfo(self, handle, type):
        self._device(handle)
        return {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 3201}[type]

    def _nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        self._device(handle)
        return pynvml.nvmlClocksEventReasonSwPowerCap

    def _nvmlDeviceGetPcieThroughput(self, device, counter):
        self._device(device)
        return {pynvml.NVML_PCIE_UTIL_TX_BYTES: 1000, pynvml.NVML_PCIE_UTIL_RX_BYTES: 2000}[counter]

    def _nvmlDeviceGetTotalEccErrors(self, handle, errorType, counterType):
        self._device(handle)
        return 0

    def _nvmlDeviceGetRemappedRows(self, device):
        self._device(device)
        return (1, 0, 0, 0)

    def _nvmlEventSetCreate(self):
        with self._lock:
            es = len(self._events)
            self._events[es] = queue.Queue()
            self.open_event_sets += 1
        return es

    def _nvmlDeviceRegisterEvents(self, handle, eventTypes, eventSet):
        assert eventTypes == pynvml.nvmlEventTypeXidCriticalError and eventSet in self._events
        self._registered[self._device(handle)] = eventSet

    def _nvmlEventSetWait_v2(self, eventSet, timeoutms):
        """Blocks up to timeoutms like the driver, then NVMLError_Timeout."""
        try:
            code = self._events[eventSet].get(timeout=timeoutms / 1e3)
        except queue.Empty:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None
        device = next(i for i, es in self._registered.items() if es == eventSet)
        return types.SimpleNamespace(
            device=("fake-device", device),
            eventType=pynvml.nvmlEventTypeXidCriticalError,
            eventData=code,
            gpuInstanceId=0,
            computeInstanceId=0,
            time=time.time(),
        )

    def _nvmlEventSetFree(self, eventSet):
        with self._lock:
            self._events.pop(eventSet)
            self.open_event_sets -= 1
