"""`make install` picks the torch build for the machine: the CPU wheel index without an NVIDIA driver (when it
answers), torch==2.13.0 from PyPI or a local wheel when it does not, the CUDA build with a driver."""

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def torch_line(tmp_path: Path, with_driver: bool, cpu_index: str) -> str:
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
        assert torch_line(tmp_path, False, index) == ["--index-url", index, '"torch==2.13.0"']
    finally:
        server.shutdown()
        server.server_close()


def test_pinned_cpu_torch_when_the_index_does_not_answer(tmp_path):
    assert torch_line(tmp_path, False, (tmp_path / "missing").as_uri()) == ['"torch==2.13.0"']


def test_cuda_build_with_a_driver(tmp_path):
    assert torch_line(tmp_path, True, (tmp_path / "missing").as_uri()) == ['"torch"']
