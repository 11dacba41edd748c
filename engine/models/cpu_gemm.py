"""Prepacked CPU GEMMs: each weight is reordered once into the kernel's blocked layout (oneDNN for
bfloat16, MKL for float32) instead of on every call, as vLLM's CPU build does. The results equal
`F.linear`'s bit for bit (tests/engine/test_cpu_gemm.py); where the ops are missing, `F.linear` runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_ROWS = 64  # the batch size the packed layout is tuned for; any number of rows runs


def _mkldnn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedWeight:
    """`weight` (and `bias`) as a function x -> x @ weight.T + bias, through a prepacked kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias, self.packed = weight, bias, None
        if weight.device.type != "cpu" or weight.dim() != 2:
            return
        if weight.dtype == torch.bfloat16 and _mkldnn_ok() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
            self.kind = "onednn"
        elif weight.dtype == torch.float32 and torch._C.has_mkl:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACK_ROWS)
            self.kind = "mkl"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dim() != 2 or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, PACK_ROWS)


class Linear(torch.nn.Linear):
    """`nn.Linear` that runs through a prepacked CPU kernel once `pack()` was called (after the weights
    are loaded and cast: packing copies them)."""

    packed: PackedWeight | None = None

    def pack(self) -> None:
        self.packed = PackedWeight(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) if self.packed is None else self.packed(x)
