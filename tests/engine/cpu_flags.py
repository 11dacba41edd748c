"""What this CPU offers our kernels, derived from /proc/cpuinfo and Linux, never from cpu_kernel itself: the tests'
independent expectation of `amx_ready()`, `avx512_ready(dtype)` and the kernel choices built on them."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
from pathlib import Path

import torch

AMX_FLAGS = {"amx_tile", "amx_bf16", "avx512_bf16"}  # amx_gemm.c's build condition (its tiles load bfloat16 pairs)
AVX512_FLAGS = {torch.float32: {"avx512f"}, torch.bfloat16: {"avx512f", "avx512_bf16"}}  # avx512_gemm.c's
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18  # x86_64 Linux


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The `flags` line of /proc/cpuinfo (empty where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    line = next((line for line in lines if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def has_c_compiler() -> bool:
    """The kernels build at first use with the system's C compiler; without one nothing of ours runs."""
    return bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))


@functools.cache
def linux_grants_amx_tiles() -> bool:
    """Linux lets this process use the AMX tile data (asked as the kernel asks, with arch_prctl)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def amx_expected() -> bool:
    return AMX_FLAGS <= cpu_flags() and has_c_compiler() and linux_grants_amx_tiles()


def avx512_expected(dtype: torch.dtype) -> bool:
    """float32 needs avx512f, bfloat16 also avx512_bf16; no other dtype has an AVX-512 kernel."""
    return dtype in AVX512_FLAGS and AVX512_FLAGS[dtype] <= cpu_flags() and has_c_compiler()


def expected_bfloat16_kernel() -> str:
    """A bfloat16 weight whose sides are 32-column multiples: AMX -> "amx"; else avx512_bf16 -> "avx512"; else
    "onednn"."""
    return "amx" if amx_expected() else "avx512" if avx512_expected(torch.bfloat16) else "onednn"


def expected_fixed_float32_kernel() -> str:
    """Batch-invariant float32, 32-column multiples, nothing forced: avx512f -> "avx512"; else oneDNN where torch
    has it (any x86 wheel) -> "onednn"; else "mkl"."""
    if avx512_expected(torch.float32):
        return "avx512"
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    return "onednn" if onednn else "mkl"
