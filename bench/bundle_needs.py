"""What the device bundle must carry: the distributions gpu_check imports, less what the target Python already
has at a version that meets every requirement on it, at the versions of requirements.lock.

The GPU image's own packages are a list kept here (IMAGE, from /work/.library/device/KINDS.md): its torch,
triton and CUDA libraries are used as they are and are never carried. `verify()` runs where the bundle was
installed and checks, with that interpreter's own metadata, that every requirement in the closure is met.
Standard library only at import (packaging is imported where used): the image runs `--verify` before anything
else is known to work there.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The GPU image ('cuda', nvidia-h100-x1 and nvidia-h200): /work/.library/device/KINDS.md, "Python packages
# already there" (read 2026-11-17) with the versions of its "pip list" row (2026-11); None: named there
# without a version. Python 3.12.3 at /opt/torch/.venv/bin/python3.
IMAGE_PYTHON = "3.12.3"
IMAGE_RECORDED = {
    "accelerate": "1.15.0",
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "sentencepiece": "0.2.2",
    "tiktoken": "0.14.0",
    "tokenizers": "0.23.2",
    "torch": "2.11.0",
    "torchaudio": "2.11.0",
    "torchvision": "0.26.0",
    "transformers": "5.17.0",
    "triton": "3.6.0",
}
IMAGE_UNRECORDED = [
    "absl-py",
    "aiofiles",
    "aiohappyeyeballs",
    "aiohttp",
    "aiosignal",
    "annotated-doc",
    "anyio",
    "attrs",
    "botorch",
    "build",
    "certifi",
    "charset-normalizer",
    "chex",
    "click",
    "cloudpickle",
    "cmake",
    "colorama",
    "contourpy",
    "coverage",
    "cuda-bindings",
    "cuda-core",
    "cuda-pathfinder",
    "cuda-toolkit",
    "cupy-cuda13x",
    "cycler",
    "cython",
    "diffrax",
    "e3nn",
    "einops",
    "equinox",
    "etils",
    "execnet",
    "filelock",
    "flatbuffers",
    "flax",
    "fonttools",
    "formulaic",
    "frozenlist",
    "fsspec",
    "gpytorch",
    "grpcio",
    "h11",
    "h5py",
    "hf-xet",
    "httpcore",
    "httpx",
    "humanize",
    "hypothesis",
    "idna",
    "imageio",
    "iniconfig",
    "interface-meta",
    "jax",
    "jax-cuda13-pjrt",
    "jax-cuda13-plugin",
    "jaxlib",
    "jaxtyping",
    "jinja2",
    "joblib",
    "kiwisolver",
    "lazy-loader",
    "lightning",
    "lightning-utilities",
    "linear-operator",
    "lineax",
    "llvmlite",
    "lxml",
    "markdown",
    "markdown-it-py",
    "markupsafe",
    "matplotlib",
    "mdurl",
    "meson",
    "ml-dtypes",
    "mpi4py",
    "mpmath",
    "msgpack",
    "multidict",
    "multipledispatch",
    "mypy-extensions",
    "nanobind",
    "narwhals",
    "networkx",
    "ninja",
    "numba",
    "numba-cuda",
    "numpyro",
    "nvidia-cublas",
    "nvidia-cuda-cupti",
    "nvidia-cuda-nvrtc",
    "nvidia-cuda-runtime",
    "nvidia-cudnn-cu13",
    "nvidia-cufft",
    "nvidia-cufile",
    "nvidia-curand",
    "nvidia-cusolver",
    "nvidia-cusparse",
    "nvidia-cusparselt-cu13",
    "nvidia-ml-py",
    "nvidia-nccl-cu13",
    "nvidia-nvjitlink",
    "nvidia-nvshmem-cu13",
    "nvidia-nvtx",
    "onnx",
    "onnx-ir",
    "onnxruntime",
    "onnxscript",
    "opencv-python-headless",
    "optax",
    "opt-einsum",
    "opt-einsum-fx",
    "optimistix",
    "orbax-checkpoint",
    "packaging",
    "pandas",
    "pathspec",
    "patsy",
    "peft",
    "pillow",
    "pip",
    "pluggy",
    "portalocker",
    "prometheus-client",
    "propcache",
    "protobuf",
    "psutil",
    "pyarrow",
    "pybind11",
    "py-cpuinfo",
    "pygments",
    "pyparsing",
    "pyproject-hooks",
    "pyre-extensions",
    "pytest",
    "pytest-benchmark",
    "pytest-cov",
    "pytest-mock",
    "pytest-timeout",
    "pytest-xdist",
    "python-dateutil",
    "pytorch-lightning",
    "pyyaml",
    "regex",
    "requests",
    "rich",
    "sacrebleu",
    "scikit-build-core",
    "scikit-image",
    "scikit-learn",
    "scipy",
    "seaborn",
    "sentence-transformers",
    "setuptools",
    "shellingham",
    "simplejson",
    "six",
    "sortedcontainers",
    "statsmodels",
    "sympy",
    "tabulate",
    "tensorboard",
    "tensorboard-data-server",
    "tensorstore",
    "threadpoolctl",
    "tifffile",
    "timm",
    "toolz",
    "tqdm",
    "torch-geometric",
    "torchdiffeq",
    "torchmetrics",
    "treescope",
    "typer",
    "typing-extensions",
    "typing-inspect",
    "urllib3",
    "uvloop",
    "wadler-lindig",
    "werkzeug",
    "wheel",
    "wrapt",
    "xarray",
    "xxhash",
    "yarl",
    "zipp",
]
IMAGE: dict[str, str | None] = {**dict.fromkeys(IMAGE_UNRECORDED), **IMAGE_RECORDED}
# An unrecorded version that some requirement bounds is carried at the locked version (small wheels), except
# these, trusted as the image has them: its pytest plugins (xdist, cov, timeout, ...) are built for its pytest
TRUST_UNRECORDED = {"pytest": "the image's pytest plugins are matched to its pytest; our floor is pytest>=8"}

# Never carried: the target's own torch (CUDA build), its compiler and CUDA libraries.
NEVER = re.compile(r"^(torch|triton|nvidia-(?!ml-py).*|cuda-.*)$")

# pyproject dependencies that gpu_check (its stages, the pipeline's processes, the CUDA test files) imports
NEEDS = {
    "transformers": "targets, the drafter's config and export (AutoModel)",
    "tokenizers": "the assets stage's tokenizer (demo.tiny)",
    "safetensors": "checkpoints and the export",
    "huggingface-hub": "transformers' loading (common/hub.py's ids)",
    "pydantic": "every job file (common/config.py)",
    "pyzmq": "control channels and telemetry (pipeline stage, CUDA ring tests)",
    "msgpack": "the wire protocol (common/protocol.py)",
    "xxhash": "the plan fingerprint and checkpoint digests",
    "psutil": "the processes' stats (common/stats.py)",
    "nvidia-ml-py": "NVML: the memory stage, telemetry's sampler",
    "pytest": "the tests stage",
}
# pyproject dependencies gpu_check does not import: left out to keep the bundle small
LEFT_OUT = {
    "wandb": "imported only when telemetry.wandb_mode is not 'disabled' (telemetry/sinks.py); gpu_check's job"
    " disables it, and the CUDA test files do not import it",
    "datasets": "hub datasets and dflash-eval --bench only (common/hub.py, evaluation/benchmarks.py); gpu_check's"
    " chats are local JSON lines",
    "pyarrow": "parquet data only (producer/records.py)",
    "matplotlib": "telemetry.plot at a run's end; the pipeline stage ends by SIGKILL",
    "rich": "dflash-stats's live view only",
    "httpx": "the regeneration server only",
    "accelerate": "transformers' tensor parallelism (target.tp_size > 1) only",
    "hypothesis": "property tests; no CUDA test file uses it",
    "ruff": "the formatter",
    "pytest-xdist": "parallel workers for `make test`; gpu_check runs its tests stage in one process",
}


def canon(name: str) -> str:
    """PEP 503's normalized name: `PyYAML`, `pyyaml` and `py_yaml` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """`name==version` lines (pip freeze's form) as {canonical name: version}; a local tag (+cpu) kept."""
    if not path.is_file():
        raise SystemExit(f"device bundle: {path} not found: the bundle carries the locked versions (make lock)")
    lock = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip().rstrip("\\").strip()
        if not line or line.startswith("-"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;]+)(\s*;.*)?", line)
        if not m:
            raise SystemExit(f"device bundle: {path}:{n}: expected `name==version`, got {line!r}")
        lock[canon(m.group(1))] = m.group(3)
    return lock


def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, list[str]]:
    """{canonical name: its requirement strings} from pyproject's dependencies and its dev extra."""
    doc = tomllib.loads(pyproject.read_text())["project"]
    out: dict[str, list[str]] = {}
    for s in doc["dependencies"] + doc["optional-dependencies"]["dev"]:
        out.setdefault(canon(re.match(r"[A-Za-z0-9._-]+", s).group(0)), []).append(s)
    return out


@dataclass(frozen=True)
class Target:
    """The Python a bundle is built for: its version, wheel platforms, and what it already has installed
    ({name: version}, None where the version is not recorded)."""

    label: str
    python_full_version: str
    platforms: tuple[str, ...]
    present: dict[str, str | None] = field(hash=False)

    @property
    def python_version(self) -> str:
        return ".".join(self.python_full_version.split(".")[:2])

    def marker_env(self) -> dict[str, str]:
        return {
            "python_version": self.python_version,
            "python_full_version": self.python_full_version,
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
            "sys_platform": "linux",
            "platform_system": "Linux",
            "os_name": "posix",
            "platform_machine": "x86_64",
            "extra": "",
        }


MANYLINUX = (*(f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)), "manylinux2014_x86_64")
GPU_IMAGE = Target("the GPU image (CPython 3.12, manylinux x86_64)", IMAGE_PYTHON, MANYLINUX, IMAGE)


@dataclass
class Pick:
    """One distribution the closure reached: carried at `version` (the lock's) or kept as the target has it."""

    name: str
    version: str | None
    carried: bool
    why: str


def applies(req, env: dict[str, str]) -> bool:
    return req.marker is None or req.marker.evaluate(env)


def meets(version: str | None, req) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def decide(name: str, reqs: list, target: Target, lock: dict[str, str], by: dict[str, str]) -> Pick:
    """Carry `name` or keep the target's: carried when absent, too old/new for a requirement, or unrecorded
    and bounded by one (unless TRUST_UNRECORDED says why the image's is trusted)."""
    if name not in target.present:
        why = "absent"
    else:
        have = target.present[name]
        if have is None:
            bounded = [r for r in reqs if str(r.specifier)]
            if not bounded or name in TRUST_UNRECORDED:
                return Pick(name, None, False, TRUST_UNRECORDED.get(name, "kept: no requirement bounds it"))
            why = f"version not recorded; {bounded[0].name}{bounded[0].specifier} ({by[str(bounded[0])]}) bounds it"
        else:
            unmet = [r for r in reqs if not meets(have, r)]
            if not unmet:
                return Pick(name, have, False, "kept: meets every requirement on it")
            why = f"has {have}; {unmet[0].name}{unmet[0].specifier} ({by[str(unmet[0])]})"
    if name not in lock:
        raise SystemExit(f"device bundle: {name} must be carried ({why}) but requirements.lock has no version of it")
    return Pick(name, lock[name], True, why)


def verify() -> list[str]:
    """Where the bundle is installed: every requirement in the closure of NEEDS (and torch's floor) met by this
    interpreter's installed distributions, the bundle's first on sys.path. One line per problem; none: ok."""
    from importlib import metadata

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = {**default_environment(), "extra": ""}
    project = project_requirements()
    pending = [(Requirement(r), "pyproject.toml") for n in (*NEEDS, "torch") for r in project[n]]
    seen, problems = set(), []
    while pending:
        req, src = pending.pop()
        if not applies(req, env):
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{canon(req.name)}: not installed, {req} ({src}) needs it")
            continue
        name = canon(req.name)
        if not meets(dist.version, req):
            problems.append(f"{name} {dist.version} does not meet {req} ({src})")
        if name in seen or NEVER.match(name):
            continue
        seen.add(name)
        pending += [(Requirement(r), f"{name} {dist.version}") for r in dist.requires or []]
    return problems
