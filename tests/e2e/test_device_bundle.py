"""The device bundle (bench/device_bundle.py), proved here: the same code builds it for this interpreter, its
script installs it with no network into a bare virtual environment that holds only torch (and triton, as the GPU
image does), and gpu_check's plan and its imports and ipc stages run from there. The GPU image's own bundle is
built too (cp312 manylinux wheels from PyPI): within 64 MiB, no torch."""

import json
import os
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from bench.bundle_needs import (
    GPU_IMAGE,
    LEFT_OUT,
    NEEDS,
    NEVER,
    TRUST_UNRECORDED,
    canon,
    decide,
    project_requirements,
    read_lock,
)
from bench.device_bundle import LIMIT_BYTES

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "device-bundle"  # wheels kept between runs (pip reuses a file already there)
OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "PIP_NO_INDEX": "1"}


def torch_closure() -> list[metadata.Distribution]:
    """torch and triton as installed here, with what torch itself requires (sympy, jinja2, ...)."""
    from packaging.markers import default_environment

    env, seen, out, pending = {**default_environment(), "extra": ""}, set(), [], ["torch", "triton"]
    while pending:
        name = canon(pending.pop())
        if name in seen:
            continue
        seen.add(name)
        dist = metadata.distribution(name)
        out.append(dist)
        reqs = [Requirement(r) for r in dist.requires or []]
        pending += [r.name for r in reqs if r.marker is None or r.marker.evaluate(env)]
    return out


def bare_venv(path: Path) -> Path:
    """A venv holding only torch (linked from this interpreter's, no download) and what torch requires."""
    venv.create(path, with_pip=True, symlinks=True)
    python = path / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
    )
    for dist in torch_closure():
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            if not (site / top).exists():  # the venv's own pip and setuptools stay
                (site / top).symlink_to(Path(dist.locate_file(top)))
    return python


def test_every_pyproject_dependency_is_needed_by_gpu_check_or_left_out_with_a_reason():
    names = set(project_requirements()) - {"torch", "triton"}
    assert set(NEEDS) | set(LEFT_OUT) == names and not set(NEEDS) & set(LEFT_OUT)
    assert {"wandb", "datasets", "pyarrow"} <= set(LEFT_OUT)


def test_what_the_gpu_image_gets_carried_and_what_it_keeps():
    lock = read_lock(ROOT / "requirements.lock")
    by = {"transformers>=5.24": "pyproject.toml", "pydantic>=2.7": "pyproject.toml", "regex>=2025.10.22": "x"}
    old = decide("transformers", [Requirement("transformers>=5.24")], GPU_IMAGE, lock, by)
    assert old.carried and old.version == lock["transformers"] and old.why.startswith("has 5.17.0; transformers>=5.24")
    absent = decide("pydantic", [Requirement("pydantic>=2.7")], GPU_IMAGE, lock, by)
    assert absent.carried and absent.why == "absent"
    numpy = decide("numpy", [Requirement("numpy>=1.17")], GPU_IMAGE, lock, by)
    assert not numpy.carried and numpy.version == "2.5.2"
    unrecorded = decide("regex", [Requirement("regex>=2025.10.22")], GPU_IMAGE, lock, by)
    assert unrecorded.carried and "version not recorded" in unrecorded.why
    assert not decide("pytest", [Requirement("pytest>=8")], GPU_IMAGE, lock, {"pytest>=8": "p"}).carried
    assert "pytest" in TRUST_UNRECORDED
    with pytest.raises(SystemExit, match=r"requirements\.lock has no version of it"):
        decide("pydantic", [Requirement("pydantic>=2.7")], GPU_IMAGE, {}, by)


def test_a_lock_line_that_is_not_name_equals_version_is_refused_by_line(tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text("# header\nPyYAML==6.0.4\ntorch==2.13.0+cpu\nnumpy>=2\n")
    with pytest.raises(SystemExit, match=r"requirements\.lock:4: expected `name==version`, got 'numpy>=2'"):
        read_lock(lock)
    lock.write_text("# header\nPyYAML==6.0.4\ntorch==2.13.0+cpu\n")
    assert read_lock(lock) == {"pyyaml": "6.0.4", "torch": "2.13.0+cpu"}


@pytest.mark.slow
def test_the_gpu_image_bundle_is_within_64_mib_and_holds_no_torch():
    out = CACHE / "cp312"
    run = subprocess.run(
        [sys.executable, "-m", "bench.device_bundle", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    lock = read_lock(ROOT / "requirements.lock")
    names = {w["name"]: w["version"] for w in manifest["wheels"]}
    assert not {n for n in names if NEVER.match(n)} and NEVER.match("nvidia-cublas") and NEVER.match("torch")
    assert {"transformers", "pydantic", "pydantic-core", "pyzmq"} <= set(names)
    assert all(lock[n] == v for n, v in names.items())  # the locked versions
    assert all("cp312" in w["file"] or "-none-" in w["file"] or "abi3" in w["file"] for w in manifest["wheels"])
    files = sorted(p.name for p in out.glob("*.whl"))
    assert files == sorted(w["file"] for w in manifest["wheels"])  # one version of each, nothing stale
    assert manifest["total_bytes"] == sum((out / f).stat().st_size for f in files) <= LIMIT_BYTES
    assert "wandb" not in names and "datasets" not in names and manifest["kept"]["numpy"] == "2.5.2"
    assert f"{len(files)} wheels, {manifest['total_bytes'] / 2**20:.2f} MiB" in run.stdout


@pytest.mark.slow
def test_a_bundle_for_this_python_runs_gpu_check_offline_in_a_venv_holding_only_torch(tmp_path):
    python = bare_venv(tmp_path / "bare")
    out = CACHE / f"cp{sys.version_info.major}{sys.version_info.minor}"
    build = subprocess.run(
        [sys.executable, "-m", "bench.device_bundle", str(out), "--for-python", str(python)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    carried = {w["name"] for w in manifest["wheels"]}
    assert {"transformers", "pydantic", "pyzmq", "numpy", "tokenizers"} <= carried and "torch" not in carried
    assert manifest["total_bytes"] <= LIMIT_BYTES

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | OFFLINE
    env |= {"PYTHON": str(python), "BUNDLE_ENV": str(tmp_path / "env"), "CUDA_VISIBLE_DEVICES": ""}
    plan = subprocess.run(
        ["bash", str(out / "run-gpu-check.sh"), "--plan", "--device-memory", "79"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert f"device bundle: {len(carried)} wheels installed" in plan.stdout
    assert "device bundle: requirements met" in plan.stdout
    assert "  pipeline     60 s   50 s   110 s  68.4 GiB" in plan.stdout and "at 8,192 tokens" in plan.stdout

    # the stages run from the bundle's venv, also when PYTHONPATH names the repository alone (as tests do)
    bundled = tmp_path / "env" / "venv" / "bin" / "python"
    stage_env = {**env, "PYTHONPATH": str(ROOT)}
    results = {}
    for stage in ("imports", "ipc"):
        run = subprocess.run(
            [bundled, "-m", "bench.gpu_check_stages", stage, "--workdir", str(tmp_path / "work")],
            cwd=ROOT,
            env=stage_env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        results[stage] = json.loads(run.stdout.strip().splitlines()[-1])
    lock = read_lock(ROOT / "requirements.lock")
    imports = results["imports"]
    assert imports["ok"] is True and imports["failed"] == {}, imports
    assert imports["versions"]["transformers"] == lock["transformers"]
    assert imports["versions"]["pydantic"] == lock["pydantic"] and imports["versions"]["torch"] == metadata.version(
        "torch"
    )
    assert results["ipc"]["ok"] is False and results["ipc"]["says"].startswith("no CUDA: ")
    where = subprocess.run(
        [bundled, "-c", "import transformers, torch; print(transformers.__file__); print(torch.__file__)"],
        cwd=ROOT,
        env=stage_env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.split()
    assert where[0].startswith(str(tmp_path / "env" / "site")) and str(tmp_path / "bare") in where[1]
