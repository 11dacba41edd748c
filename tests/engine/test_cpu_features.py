"""The kernels' hardware probes agree with the CPU's own flags (/proc/cpuinfo) and Linux: a build that silently
lost AMX or AVX-512 (an old compiler, a wrong -march, a failed build) fails here on a CPU that has them."""

import platform

import pytest
import torch

from engine.kernels import cpu_kernel
from tests.engine.cpu_flags import (
    AMX_FLAGS,
    AVX512_FLAGS,
    cpu_flags,
    has_c_compiler,
    linux_grants_amx_tiles,
)

X86_LINUX = platform.system() == "Linux" and platform.machine() == "x86_64"


@pytest.mark.skipif(not X86_LINUX, reason="/proc/cpuinfo's x86 flags: Linux on x86_64 only")
def test_the_cpu_flags_are_read():
    """Else every expectation below would be "no AMX, no AVX-512" and pass whatever the kernels do."""
    assert {"sse2", "avx"} <= cpu_flags(), sorted(cpu_flags())[:20]


def test_amx_ready_exactly_where_the_cpu_has_amx_and_linux_grants_the_tiles():
    flags = AMX_FLAGS & cpu_flags()
    expected = flags == AMX_FLAGS and has_c_compiler() and linux_grants_amx_tiles()
    assert cpu_kernel.amx_ready() is expected, \
        f"CPU flags {sorted(flags)} of {sorted(AMX_FLAGS)}, C compiler {has_c_compiler()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_avx512_ready_exactly_where_the_cpu_has_the_dtypes_avx512_flags(dtype):
    """float32: avx512f; bfloat16: avx512f and avx512_bf16; float16: no kernel of ours on any CPU."""
    needs = AVX512_FLAGS.get(dtype)
    expected = needs is not None and needs <= cpu_flags() and has_c_compiler()
    assert cpu_kernel.avx512_ready(dtype) is expected, \
        f"{dtype}: needs {sorted(needs or [])}, CPU has {sorted((needs or set()) & cpu_flags())}"


def test_the_kernels_build_wherever_there_is_a_c_compiler(monkeypatch):
    """Every probe above is False without the built library: a failed build must not pass as "no AMX here"."""
    monkeypatch.delenv("TOKENMILL_CPU_ATTENTION_KERNEL", raising=False)
    assert cpu_kernel.available(torch.float32) is has_c_compiler()
