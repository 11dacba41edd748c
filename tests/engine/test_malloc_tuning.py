"""keep_freed_memory: a step's large activations reuse freed heap blocks instead of faulting in fresh pages."""

import platform
import subprocess
import sys

import pytest

STEPS = """
import ctypes, resource, sys
from engine import malloc_tuning
if sys.argv[1] == "keep":
    assert malloc_tuning.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
sizes = [int(mib * (1 << 20)) for mib in (4.7, 1.5, 6.0, 1.5, 12.0, 1.5)]  # an encoder layer's activations
def step():
    live = []
    for size in sizes:
        live.append(libc.malloc(size))
        ctypes.memset(live[-1], 1, size)
        if len(live) > 2:
            libc.free(live.pop(0))
    for block in live:
        libc.free(block)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds are glibc's")
def test_freed_activation_blocks_serve_the_next_steps_without_page_faults():
    def page_faults(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True)
        return int(done.stdout.split()[-1])

    assert page_faults("default") > 20 * 1000  # blocks over glibc's threshold mapped afresh on every step
    assert page_faults("keep") < 100
