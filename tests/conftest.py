"""Test-wide settings: must run before any project module (the Triton interpreter is read when a kernel is
decorated, i.e. when consumer.kernels is imported)."""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRITON_INTERPRET_PRESET = os.environ.get("TRITON_INTERPRET")  # a user's own choice is kept
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
