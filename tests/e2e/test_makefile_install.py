"""`make install` builds .venv from requirements.lock: the locked torch in the build for the machine (the CPU wheel
index without an NVIDIA driver when it answers, a local or PyPI wheel when it does not, the CUDA build with a
driver, which brings its own triton), then every other locked line with --no-deps; and the lock is complete and
inside pyproject.toml's ranges."""

import functools
import http.server
import importlib.metadata
import os
import shutil
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK_PATH = ROOT / "requirements.lock"
LOCK = {
    canonicalize_name(name): version
    for name, version in (s.split("==", 1) for s in LOCK_PATH.read_text().splitlines() if not s.startswith("#"))
}


def dry_install(tmp_path: Path, with_driver: bool, cpu_index: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("sh", "bash"):
        (bin_dir / tool).unlink(missing_ok=True)
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if with_driver:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": str(bin_dir)}
    out = subprocess.run([shutil.which("make"), "-n", "-B", "-C", str(ROOT), "install", f"VENV={tmp_path}/venv", f"PYTHON={Path(sys.executable).resolve()}",
                          f"TORCH_CPU_INDEX={cpu_index}"], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    return out


def torch_line(tmp_path: Path, with_driver: bool, cpu_index: str) -> list[str]:
    out = dry_install(tmp_path, with_driver, cpu_index)
    (line,) = [line for line in out.splitlines() if '"torch' in line]
    return line.split("pip install -q", 1)[1].split()


def test_cpu_index_when_no_driver_and_it_answers(tmp_path):
    """A local HTTP index stands in for download.pytorch.org (reachable): the probe fetches <index>/torch/."""
    (tmp_path / "index" / "torch").mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        index = f"http://127.0.0.1:{server.server_port}"
        assert torch_line(tmp_path, False, index) == ["--index-url", index, f'"torch=={LOCK["torch"]}"']
    finally:
        server.shutdown()
        server.server_close()


def test_locked_torch_when_the_index_does_not_answer(tmp_path):
    assert torch_line(tmp_path, False, (tmp_path / "missing").as_uri()) == [f'"torch=={LOCK["torch"]}"']


def test_cuda_build_of_the_locked_torch_with_a_driver_and_its_own_triton(tmp_path):
    assert torch_line(tmp_path, True, (tmp_path / "missing").as_uri()) == [f'"torch=={LOCK["torch"]}"']
    out = dry_install(tmp_path, True, (tmp_path / "missing").as_uri())
    assert "grep -vE '^(torch|triton)=='" in out


def test_the_rest_of_the_lock_installs_without_resolving_and_is_checked(tmp_path):
    lines = dry_install(tmp_path, False, (tmp_path / "missing").as_uri()).splitlines()
    assert any("rm -rf" in line and line.split()[-1].endswith("/venv") for line in lines)  # a new lock: a new venv
    assert any("pip install -q --no-deps -r" in line for line in lines)
    assert any("pip install -q --no-deps --no-build-isolation -e ." in line for line in lines)
    checks = [i for i, line in enumerate(lines) if line.endswith("-m pip check")]
    editable = [i for i, line in enumerate(lines) if "--no-build-isolation -e ." in line]
    assert checks and checks[0] > editable[0]  # the whole set is checked once everything is in


def test_the_lock_pins_every_dependency_within_pyprojects_ranges():
    """Every requirement of pyproject.toml (runtime and dev) and, transitively, of every locked package is locked
    at a version its specifier admits: an incomplete lock would leave `pip install --no-deps` short."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    roots = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    env = {"python_version": "3.11", "platform_machine": "x86_64", "sys_platform": "linux", "extra": ""}
    missing, outside = [], []
    for req in roots:
        if req.marker and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        if name not in LOCK:
            missing.append(str(req))
        elif not req.specifier.contains(LOCK[name], prereleases=True):
            outside.append(f"{req} (locked {LOCK[name]})")
    assert not missing and not outside, f"{LOCK_PATH.name}: missing {missing}, outside the range {outside}"
    assert len(LOCK) >= 60 and {"pip", "setuptools", "torch", "transformers", "pyzmq"} <= LOCK.keys()


def test_the_environment_running_the_suite_is_the_lock_or_says_how_it_differs():
    """Under `make test` (.venv) the installed set is exactly the lock; under `make test-latest` (.venv-latest) it
    differs by design, and every difference is printed (the drift the lock holds back)."""
    # site-packages alone: once setuptools is imported (torch's cpp_extension does) its _vendor folder is on
    # sys.path, and the packages vendored there are no part of the environment
    site_packages = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_relative_to(sys.prefix)]
    dists = importlib.metadata.distributions(path=site_packages)
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in dists}
    installed.pop("dflash-pipeline", None)
    installed = {n: v.split("+")[0] if n == "torch" else v for n, v in installed.items()}
    drift = sorted(f"{n}: locked {LOCK.get(n)}, installed {installed.get(n)}"
                   for n in LOCK.keys() | installed.keys() if LOCK.get(n) != installed.get(n))  # fmt: skip
    if Path(sys.prefix).name == ".venv":
        assert not drift, f"{Path(sys.prefix)} is not the lock: {drift}"
    else:
        print(f"{Path(sys.prefix)} differs from {LOCK_PATH.name} in {len(drift)} package(s):", *drift, sep="\n  ")
        assert installed.get("torch"), "no torch installed"
