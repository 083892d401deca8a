"""Test-wide settings: must run before any project module (the Triton interpreter is read when a kernel is
decorated, i.e. when consumer.kernels is imported)."""

import json
import os
import pathlib
import resource
import shutil
import subprocess
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A user's own TRITON_INTERPRET is kept. What the user set is read once, in the first pytest process, and handed to
# pytest-xdist's workers, which inherit the environment this file has already changed by then.
os.environ.setdefault("DFLASH_TEST_TRITON_INTERPRET_PRESET", os.environ.get("TRITON_INTERPRET", ""))
TRITON_INTERPRET_PRESET = os.environ["DFLASH_TEST_TRITON_INTERPRET_PRESET"] or None
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DIR", str(ROOT / ".cache" / "wandb"))
os.environ.setdefault("WANDB_CACHE_DIR", str(ROOT / ".cache" / "wandb-cache"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run in its interpreter only where there is no GPU to compile them for: on a GPU the
# compiled kernel and its autotune configs are what the tests check. The variable is read when a kernel is
# decorated (consumer.kernels is imported by the tests, after this file), so setting it here is in time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Under pytest-xdist (`make test` runs `-n auto --dist loadfile`) two workers may start launch.sh jobs at once:
# each worker gets its own base rendezvous port, so two jobs' replica groups never meet on torchrun's 29500.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if WORKER.startswith("gw"):
    os.environ.setdefault("MASTER_PORT", str(31000 + 200 * int(WORKER[2:])))

DURATIONS = ROOT / "tests" / "durations.json"


def pytest_addoption(parser):
    parser.addoption(
        "--write-durations",
        action="store_true",
        help=f"write each test file's wall seconds of this run to {DURATIONS.relative_to(ROOT)} (the suite's order)",
    )
    parser.addoption(
        "--cpu-log",
        metavar="FILE",
        help="append a JSON line a test to FILE: its wall seconds and the CPU seconds of the test process and of the"
        " processes it started and reaped (launch.sh's included): where the suite's time goes, also under xdist",
    )


def _cpu_seconds() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """--cpu-log: setup, call and teardown of one test, the fixtures it built included."""
    path = item.config.getoption("--cpu-log")
    if not path:
        yield
        return
    (own0, children0), t0 = _cpu_seconds(), time.monotonic()
    yield
    own1, children1 = _cpu_seconds()
    row = {"test": item.nodeid, "wall": round(time.monotonic() - t0, 3), "cpu_self": round(own1 - own0, 3)}
    row["cpu_children"] = round(children1 - children0, 3)
    with open(path, "a") as f:  # one short line a write: the workers' lines do not interleave
        f.write(json.dumps(row) + "\n")


def pytest_collection_modifyitems(config, items):
    """Longest test files first (tests/durations.json, seconds per file), each file's tests together and in
    their own order: under xdist's loadfile scheduling the files are handed out in this order, so the longest
    ones start at once instead of ending the run alone; module fixtures are still set up once a file."""
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::")[0], i)
    items.sort(key=lambda it: (-known.get(f := it.nodeid.split("::")[0], 0.0), first[f]))


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _file_seconds[report.nodeid.split("::")[0]] = _file_seconds.get(report.nodeid.split("::")[0], 0.0) + report.duration


def pytest_sessionfinish(session):
    """--write-durations: this run's files replace their entries; files it did not run keep theirs."""
    if session.config.getoption("--write-durations") and not WORKER:
        known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
        known |= {k: round(v, 1) for k, v in _file_seconds.items()}
        DURATIONS.write_text(json.dumps(dict(sorted(known.items())), indent=0) + "\n")


@pytest.fixture
def short_tmp():
    """A fresh folder with a short path (/tmp/dft-XXXXXXXX) for a run folder: its ipc:// socket paths must stay
    within 107 characters, which pytest's tmp_path (longer under xdist: .../popen-gwN/...) can exceed."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="dft-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tmpfs(short_tmp):
    """`tmpfs(size_kib, read_only=False)`: a real small file system of its own, mounted under `short_tmp` and
    unmounted after the test (a full or read-only disk); root only, the test is skipped otherwise."""
    mounted = []

    def mount(size_kib: int, *, read_only: bool = False):
        path = short_tmp / f"mnt{len(mounted)}"  # a run folder's socket paths are short
        path.mkdir()
        opts = f"size={size_kib}k" + (",ro" if read_only else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)
