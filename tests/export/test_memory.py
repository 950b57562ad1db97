"""glibc's malloc as OnnxTranslator leaves it (export/runtime/memory.py): freed memory kept for the next batch."""

import subprocess
import sys

import pytest

# In a fresh process: OnnxTranslator over the bundle (argv[1]), keeping freed memory or not (argv[2]), then the
# minor page faults of rounds that fill and free 48 MB in 96 kB blocks (below glibc's default mmap threshold:
# from the heap, whose top glibc trims at each free by default)
FAULTS_PER_ROUND = """
import resource, sys, numpy as np
from nmtserve.export.runtime.translator import OnnxTranslator
OnnxTranslator(sys.argv[1], keep_freed_memory=sys.argv[2] == "keep")
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def one_round():
    blocks = [np.ones(12_000) for _ in range(500)]
    del blocks
one_round()
before = faults()
for _ in range(5):
    one_round()
print((faults() - before) / 5)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc (mallopt)")
def test_a_translator_keeps_freed_memory_for_the_next_allocations_unless_told_not_to(tiny_bundle):
    def faults_per_round(mode: str) -> float:
        done = subprocess.run([sys.executable, "-c", FAULTS_PER_ROUND, str(tiny_bundle), mode], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return float(done.stdout.strip().splitlines()[-1])
    assert faults_per_round("off") > 5000  # ~12,000: 48 MB faulted in again in 4 kB pages every round
    assert faults_per_round("keep") < 100
