"""The version floors in pyproject.toml are what the code needs (issue 19 item 6): every installed dependency
satisfies its floor, the CUDA ring's own torch guard agrees with the torch floor, and every module imports."""

import importlib
import importlib.metadata
import pkgutil
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from common import ring_cuda

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "producer", "consumer", "telemetry", "demo", "bench")


def requirements() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: r for r in map(Requirement, deps) if r.marker is None or r.marker.evaluate()}


def floor(req: Requirement) -> Version:
    (spec,) = [s for s in req.specifier if s.operator == ">="]
    return Version(spec.version)


def test_every_installed_dependency_satisfies_its_floor():
    reqs = requirements()
    assert {"torch", "transformers"} <= reqs.keys()
    for name, req in reqs.items():
        installed = importlib.metadata.version(name)
        assert req.specifier.contains(installed, prereleases=True), f"{name} {installed} does not satisfy {req}"


def test_the_torch_floor_covers_the_newest_torch_api_the_cuda_ring_calls():
    assert floor(requirements()["torch"]) >= Version(ring_cuda.TORCH_FOR_ALLOCATOR_SETTINGS)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_imports(package):
    """An API missing from the installed torch/transformers fails here at import, not on the first GPU batch.
    Entry points (`__main__`) run when imported: their code is covered by the tests that call their main()."""
    pkg = importlib.import_module(package)
    names = [m.name for m in pkgutil.walk_packages(pkg.__path__, f"{package}.") if not m.name.endswith(".__main__")]
    assert names
    for name in names:
        importlib.import_module(name)
