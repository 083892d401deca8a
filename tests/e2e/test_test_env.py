"""The test session's own settings: Triton is interpreted exactly where no GPU can compile it."""

import os

import pytest
import torch
from conftest import TRITON_INTERPRET_PRESET

from consumer.kernels import weighted_ce


@pytest.mark.skipif(TRITON_INTERPRET_PRESET is not None, reason="TRITON_INTERPRET was set by the user")
def test_triton_is_interpreted_only_without_cuda():
    interpret = not torch.cuda.is_available()
    assert (os.environ.get("TRITON_INTERPRET") == "1") is interpret
    assert weighted_ce.INTERPRET is interpret  # what the kernel module read when it was imported
