"""`bench peak`: the model's own GEMM shapes timed on this machine (fused QKV, O, fused gate/up, down and the
LM head, `F.linear` on torch's threads), and the tok/s limit they set: the most tokens per second that a step
of only these matmuls reaches at any of the timed batch sizes, every token through the LM head (a decode
step). Attention, norms, sampling and scheduling come on top, so no engine reaches it; `bench throughput`
prints each system's share of it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.bench.throughput import best_time, load_dense_weights, matmul_peak_flops, time_dense_pass

ROWS = (16, 64, 256)
SHAPE_NAMES = ("qkv", "o", "gate_up", "down")


@dataclass
class Peak:
    dtype: str
    flops_per_token: int
    square_gflops: float  # a 2048 x 2048 x 2048 matmul: the machine's best case
    shapes: list[tuple[str, int, int, dict[int, float]]] = field(default_factory=list)  # name, out, in, GFLOP/s
    limits: dict[int, float] = field(default_factory=dict)  # rows -> tok/s of a matmul-only step

    @property
    def limit(self) -> float:
        return max(self.limits.values())

    @property
    def limit_rows(self) -> int:
        return max(self.limits, key=self.limits.get)


def measure(model_dir, dtype: str, rows: tuple[int, ...] = ROWS, repeats: int = 3) -> Peak:
    weights = load_dense_weights(model_dir, dtype)
    peak = Peak(dtype, weights.flops_per_token, matmul_peak_flops(dtype) / 1e9)
    named = list(zip(SHAPE_NAMES, weights.matrices[0], strict=True)) + [("lm_head", weights.lm_head)]
    with torch.inference_mode():
        for name, weight in named:
            rates = {}
            for count in rows:
                x = torch.randn(count, weight.shape[1], dtype=weight.dtype)
                seconds = best_time(lambda x=x, weight=weight: F.linear(x, weight), repeats)
                rates[count] = 2 * count * weight.numel() / seconds / 1e9
            peak.shapes.append((name, weight.shape[0], weight.shape[1], rates))
    peak.limits = decode_limits(weights, rows, repeats)
    return peak


def decode_limits(weights, rows: tuple[int, ...] = ROWS, repeats: int = 3) -> dict[int, float]:
    """rows -> tok/s of a decode step of the model's matmuls alone (every row through the LM head)."""
    return {count: count / time_dense_pass(weights, count, count, repeats) for count in rows}


def native(dtype: str) -> bool:
    """False for bfloat16 on a CPU without avx512_bf16 or AMX: torch emulates it there, thousands of times slower
    than float32 (a 2048-cube matmul took 5 minutes on an AVX2 EPYC), so it sets no useful limit."""
    from engine.model_loader import cpu_has_native_bf16

    return dtype != "bfloat16" or cpu_has_native_bf16()


def native_dtypes(dtypes: list[str], console) -> list[str]:
    """The dtypes this CPU runs natively; a line for each one skipped (bfloat16 without avx512_bf16 or AMX)."""
    for dtype in [d for d in dtypes if not native(d)]:
        console.print(f"{dtype} skipped: this CPU has no native {dtype} (avx512_bf16 or AMX)")
    return [d for d in dtypes if native(d)]


def limit_only(model_dir, dtype: str) -> float:
    """The tok/s limit alone (for `bench throughput`'s share column)."""
    return max(decode_limits(load_dense_weights(model_dir, dtype)).values())


def peak_table(peaks: list[Peak]):
    from rich.table import Table

    rows = sorted({count for peak in peaks for count in peak.limits})
    table = Table("dtype", "GEMM (out x in)", *[f"GFLOP/s at {count} rows" for count in rows],
                  title="the model's GEMM shapes on this machine")
    for peak in peaks:
        for name, out, inner, rates in peak.shapes:
            table.add_row(peak.dtype, f"{name} ({out} x {inner})", *[f"{rates[count]:.0f}" for count in rows])
        table.add_row(peak.dtype, "square 2048 matmul", *[f"{peak.square_gflops:.0f}"] * len(rows))
    return table


def limit_table(peaks: list[Peak]):
    from rich.table import Table

    table = Table("dtype", "GFLOP per token", *[f"tok/s at {count} rows" for count in ROWS], "limit (tok/s)",
                  title="tok/s limit: a decode step of the model's matmuls alone")
    for peak in peaks:
        table.add_row(peak.dtype, f"{peak.flops_per_token / 1e9:.3f}",
                      *[f"{peak.limits.get(count, 0):.0f}" for count in ROWS], f"{peak.limit:.0f}")
    return table
