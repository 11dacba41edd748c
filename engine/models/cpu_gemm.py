"""Prepacked CPU GEMMs: each weight is reordered once into the kernel's blocked layout instead of on every
call, as vLLM's CPU build does. bfloat16 runs on our AMX kernel where the CPU has AMX (engine/attention/csrc/
amx_gemm.c: it streams the weight with prefetch, 1.2-2x oneDNN at decode batches of 1-64 rows on a 2-core Xeon,
and sums in the same order at any number of rows; over `AMX_MAX_ROWS` rows, outside batch-invariant mode, oneDNN),
else through oneDNN (`TOKENMILL_BF16_GEMM=amx|onednn`).
float32 runs through MKL (the same kernel as `F.linear`, bit for bit) or oneDNN, whichever is faster for that
weight's shape on this CPU, timed once per shape when the model loads at decode batches of 4 and 32 rows: on AMD
EPYCs (AVX2 and AVX-512) oneDNN ran the 49152-row LM head twice as fast as MKL, and on AVX-512 the layers'
projections 1.2-3x as fast. Not at 64 rows: MKL's packed path runs only at exactly the packed batch size (other
sizes take plain sgemm on the unpacked weight), so timing at 64 chose MKL on an Intel Xeon where oneDNN is 1.2-1.5x
faster at the 20-50 rows decodes mostly have.
Where the ops are missing, `F.linear` runs.

Batch-invariant mode (`row_tile`): every call runs in tiles of exactly `INVARIANT_ROWS` rows, the last one padded,
on a kernel fixed per dtype (not timed), so a row's result never depends on how many rows came with it. The AMX
kernel needs no tiles: it is invariant as it is."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention import cpu_kernel

log = logging.getLogger("tokenmill.cpu_gemm")

PACK_ROWS = 64  # the batch size the packed layout is tuned for; any number of rows runs
ONEDNN_MARGIN = 1.1  # float32 takes oneDNN only this much faster than MKL: a clear win, the same on every run
TIMED_ROWS = (4, 32)  # a small and a typical decode batch
INVARIANT_ROWS = 64  # rows of every GEMM call in batch-invariant mode
AMX_MAX_ROWS = 512  # more rows than this go to oneDNN (`F.linear`), except in batch-invariant mode


def _mkldnn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def row_tiled(linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int) -> torch.Tensor:
    """linear(x) computed `tile` rows at a time, the last tile padded with zeros: the GEMM always sees one shape."""
    rows = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -rows % tile)) if rows % tile else x.contiguous()
    parts = [linear(padded[start:start + tile]) for start in range(0, padded.shape[0], tile)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts))[:rows]


class PackedWeight:
    """`weight` (and `bias`) as a function x -> x @ weight.T + bias, through a prepacked kernel."""

    row_tile = 0  # > 0: batch-invariant, every call in tiles of this many rows

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, amx: bool = True) -> None:
        """`amx=False`: oneDNN for bfloat16 even where the AMX kernel runs (an encoder's batches of thousands of
        rows, where oneDNN is faster and fuses the activation)."""
        self.weight, self.bias, self.packed = weight, bias, None
        if weight.device.type != "cpu" or weight.dim() != 2:
            return
        if weight.dtype == torch.bfloat16 and amx and bfloat16_kernel(*weight.shape) == "amx":
            self.packed, self.kind = cpu_kernel.amx_pack(weight), "amx"
            self.bias_f32 = bias.detach().float() if bias is not None else None
        elif weight.dtype == torch.bfloat16 and _mkldnn_ok() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
            self.kind = "onednn"
        elif weight.dtype == torch.float32 and torch._C.has_mkl:
            self.kind = float32_kernel(*weight.shape) if _mkldnn_ok() else "mkl"
            self.packed = _pack(weight.detach(), self.kind)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_tile and x.dim() == 2 and not self.invariant_kernel:
            return row_tiled(self._linear, x, self.row_tile)
        return self._linear(x)

    @property
    def invariant_kernel(self) -> bool:
        """The kernel itself gives a row the same result in any batch: no tiles needed."""
        return self.packed is not None and self.kind == "amx"

    def set_row_tile(self, tile: int) -> None:
        """Batch-invariant mode on (`tile` rows per call) or off (0). On, float32 leaves the timed kernel choice
        (it may differ between processes) for a fixed one, repacking the weight if needed."""
        self.row_tile = tile
        if tile and self.packed is not None and self.kind != (fixed := fixed_float32_kernel()) \
                and self.weight.dtype == torch.float32:
            self.kind, self.packed = fixed, _pack(self.weight.detach(), fixed)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dim() != 2 or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        if self.kind == "amx":
            if x.shape[0] > AMX_MAX_ROWS and not self.row_tile:  # a long prefill: oneDNN, about 1.3x faster there
                return F.linear(x, self.weight, self.bias)
            return cpu_kernel.amx_linear(x, self.packed, self.bias_f32, self.weight.shape[0])
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, PACK_ROWS)


def _pack(weight: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_ROWS)


def _run(kind: str, x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return torch.ops.mkl._mkl_linear(x, packed, weight, None, PACK_ROWS)


def bfloat16_kernel(out_features: int, in_features: int) -> str:
    """"amx" where our AMX kernel runs and takes this shape, else "onednn"; `TOKENMILL_BF16_GEMM` forces one."""
    forced = os.environ.get("TOKENMILL_BF16_GEMM", "")
    if forced not in ("", "amx", "onednn"):
        raise ValueError(f"TOKENMILL_BF16_GEMM must be amx or onednn, not {forced!r}")
    fits = out_features % cpu_kernel.AMX_MULTIPLE == 0 and in_features % cpu_kernel.AMX_MULTIPLE == 0
    return "amx" if forced != "onednn" and fits and cpu_kernel.amx_ready() else "onednn"


def float32_kernel(out_features: int, in_features: int) -> str:
    """"mkl" or "onednn" for a float32 weight of this shape: `TOKENMILL_FLOAT32_GEMM=mkl|onednn`, or else the
    one measured faster here."""
    if forced := os.environ.get("TOKENMILL_FLOAT32_GEMM"):
        if forced not in ("mkl", "onednn"):
            raise ValueError(f"TOKENMILL_FLOAT32_GEMM must be mkl or onednn, not {forced!r}")
        return forced
    return fastest_float32_kernel(out_features, in_features)


def fixed_float32_kernel() -> str:
    """The float32 kernel of batch-invariant mode: `TOKENMILL_FLOAT32_GEMM`, else oneDNN where it runs, else MKL."""
    return os.environ.get("TOKENMILL_FLOAT32_GEMM") or ("onednn" if _mkldnn_ok() else "mkl")


@functools.cache
def fastest_float32_kernel(out_features: int, in_features: int) -> str:
    """"mkl", or "onednn" where it is clearly faster (`ONEDNN_MARGIN`) on this CPU for a float32 weight of this
    shape, summed over `TIMED_ROWS`: best of three calls each on random data, about 0.2 s for a small model's
    largest shape, once per shape and process."""
    weight = torch.randn(out_features, in_features)
    inputs = [torch.randn(rows, in_features) for rows in TIMED_ROWS]
    seconds = {}
    for kind in ("mkl", "onednn"):
        packed = _pack(weight, kind)
        seconds[kind] = 0.0
        for x in inputs:
            _run(kind, x, packed, weight)
            best = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                _run(kind, x, packed, weight)
                best = min(best, time.perf_counter() - started)
            seconds[kind] += best
    kind = "onednn" if seconds["onednn"] * ONEDNN_MARGIN < seconds["mkl"] else "mkl"
    log.debug("float32 GEMM %dx%d: %s (mkl %.2f ms, onednn %.2f ms)", out_features, in_features, kind,
              seconds["mkl"] * 1e3, seconds["onednn"] * 1e3)
    return kind


class Linear(torch.nn.Linear):
    """`nn.Linear` that runs through a prepacked CPU kernel once `pack()` was called (after the weights
    are loaded and cast: packing copies them)."""

    packed: PackedWeight | None = None
    row_tile = 0  # batch-invariant mode without a packed kernel (e.g. CUDA): F.linear in tiles of this many rows

    def pack(self, amx: bool = True) -> None:
        self.packed = PackedWeight(self.weight, self.bias, amx)

    def set_row_tile(self, tile: int) -> None:
        self.row_tile = tile
        if self.packed is not None:
            self.packed.set_row_tile(tile)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        if self.row_tile and x.dim() == 2:
            return row_tiled(lambda chunk: F.linear(chunk, self.weight, self.bias), x, self.row_tile)
        return F.linear(x, self.weight, self.bias)
