"""The gathered LoRA product (Punica's BGMV/SGMV): one call per projection adds every row's own adapter to the
projection's output for a whole mixed batch, `out[t] += (x[t] @ lora_a[s].T) @ lora_b[s]` for s = slots[t] >= 0,
rows of slot -1 (the base model) untouched. Sums in float32; out's value plus the product rounded to its dtype once.

- CPU: the C kernel (engine/kernels/csrc/lora.c), which groups the rows by slot so each adapter's weights are
  read once per group (`TOKENMILL_CPU_LORA_KERNEL=0`, or no compiler: the torch reference);
- CUDA: the Triton kernels (engine/lora/triton_kernels.py; without triton: the torch reference).

Shapes: x [T, in] and out [T, out], float32 or bfloat16, each row contiguous, rows at any stride (out may be a
column slice of a wider tensor); lora_a [S, R, in] and lora_b [S, R, out] float32 contiguous (B transposed, the
scaling folded in); slots [T] int64."""

from __future__ import annotations

import functools
import logging
import os

import torch

from engine.kernels import cpu_kernel
from engine.lora.grouping import segments

log = logging.getLogger("tokenmill.lora")


def lora_reference(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """The product in torch, one slot's rows at a time (synchronizes with the device to find the slots)."""
    for slot in torch.unique(slots[slots >= 0]).tolist():
        rows = (slots == slot).nonzero().squeeze(1)
        delta = (x[rows].float() @ lora_a[slot].T) @ lora_b[slot]
        out[rows] = (out[rows].float() + delta).to(out.dtype)


def lora_apply(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               slots: torch.Tensor) -> None:
    """out += each row's adapter's product of x, in place, with the fastest kernel that takes these tensors."""
    if x.is_cuda:
        triton_kernels = _triton_kernels()
        if triton_kernels is not None and out.stride(1) == 1:
            triton_kernels.lora_triton(x, out, lora_a, lora_b, slots, _step_segments(slots, lora_a.shape[0]))
            return
    elif _cpu_kernel_takes(x, out, lora_a, lora_b, slots):
        cpu_kernel.lora(x, out, lora_a, lora_b, slots)
        return
    lora_reference(x, out, lora_a, lora_b, slots)


_last_segments: tuple | None = None  # (slots, its version, the slot count, segments(slots)) of the last call


def _step_segments(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`segments` of the step's slots, computed once for all its projections' calls (the same tensor each)."""
    global _last_segments
    cached = _last_segments
    if cached is None or cached[0] is not slots or cached[1] != slots._version or cached[2] != num_slots:
        cached = _last_segments = (slots, slots._version, num_slots, segments(slots, num_slots))
    return cached[3]


def _cpu_kernel_takes(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      slots: torch.Tensor) -> bool:
    return (os.environ.get("TOKENMILL_CPU_LORA_KERNEL", "1") != "0" and x.dtype in cpu_kernel.SUFFIXES
            and out.dtype == x.dtype and x.stride(1) == 1 and out.stride(1) == 1
            and lora_a.dtype == lora_b.dtype == torch.float32 and lora_a.is_contiguous() and lora_b.is_contiguous()
            and slots.dtype == torch.int64 and slots.is_contiguous() and cpu_kernel._library() is not None)


@functools.cache
def _triton_kernels():
    try:
        from engine.lora import triton_kernels
    except ImportError as error:
        log.warning("no triton (%s): the LoRA products run in torch", error)
        return None
    return triton_kernels
