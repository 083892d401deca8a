"""common.host_memory: a batch loop that allocates the same large CPU tensors stops page-faulting them in
again every batch. Run in fresh interpreters: malloc settings are process-wide."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# An attention-and-MLP-shaped batch: 16 MiB of scores per layer and a few MiB of activations, freed as the
# loop goes, as a CPU target forward does. Prints the page faults per batch after three warm-up batches.
LOOP = """
import resource, sys, torch
from common.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() is True
torch.set_num_threads(1)
x, w1, w2 = torch.ones(1024, 256), torch.full((256, 768), 1e-3), torch.full((768, 256), 1e-3)
def batch():
    h = x
    for _ in range(8):
        scores = torch.softmax(torch.zeros(4, 1024, 1024), -1)
        h = h + torch.relu(h @ w1) @ w2 + scores[0, :, :256]
    return h
for _ in range(3):
    batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    batch()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4)
"""


def faults_per_batch(mode: str) -> float:
    proc = subprocess.run(
        [sys.executable, "-c", LOOP, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_batch_reuses_the_pages_the_previous_batch_freed():
    churn, kept = faults_per_batch("default"), faults_per_batch("keep")
    # by default glibc returns the freed activations to the kernel and faults them in again (16 MiB = 4,096
    # pages per layer, ~36,000 a batch); with the policy a batch faults in little (0 to ~800 seen)
    assert churn > 4096, churn
    assert kept < churn / 10, (kept, churn)
