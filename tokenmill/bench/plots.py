"""PNG plots of the benchmarks, drawn with matplotlib's object API on the Agg canvas (no display, no pyplot
global state): throughput against concurrency under the roofline, and TTFT/TPOT distributions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from tokenmill.bench.throughput import ConcurrencyPoint, RequestLatency

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red")


def plot_concurrency(sweeps: dict[str, list[ConcurrencyPoint]], path: Path) -> Path:
    """Decode tokens/s against running sequences per dtype: tokenmill, the dense matmuls alone, and the roofline
    min(compute roof, memory roof); log-log."""
    figure = Figure(figsize=(9, 5.5), layout="constrained")
    axes = figure.subplots()
    for color, (dtype, points) in zip(COLORS, sweeps.items(), strict=False):
        batches = [p.batch for p in points]
        axes.plot(batches, [p.decode_tokens_per_s for p in points], "o-", color=color, lw=2,
                  label=f"tokenmill decode ({dtype})")
        axes.plot(batches, [p.matmul_tokens_per_s for p in points], "s--", color=color, alpha=0.7,
                  label=f"dense matmuls alone ({dtype})")
        axes.plot(batches, [p.roof for p in points], ":", color=color, lw=2.5,
                  label=f"roofline: min(compute, memory) ({dtype})")
        compute_roof = points[0].compute_roof
        axes.axhline(compute_roof, color=color, lw=0.8, alpha=0.4)
        axes.annotate(f"compute roof {compute_roof:.0f} tok/s ({dtype})", (batches[0], compute_roof),
                      textcoords="offset points", xytext=(2, 3), fontsize="x-small", color=color)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    plain_numbers(axes.yaxis)
    batches = sorted({p.batch for points in sweeps.values() for p in points})
    axes.set_xticks(batches, [str(b) for b in batches])
    axes.set_xlabel("concurrency (sequences decoding together)")
    axes.set_ylabel("generated tokens per second")
    axes.set_title("Decode throughput against concurrency, under the roofline")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    return save(figure, path)


def plot_latency_distributions(latencies: dict[str, list[RequestLatency]], path: Path) -> Path:
    """Histograms of time to first token and time per output token per run, with p50 and p99 marked."""
    figure = Figure(figsize=(11, 4.5), layout="constrained")
    ttft_axes, tpot_axes = figure.subplots(1, 2)
    for color, (label, runs) in zip(COLORS, latencies.items(), strict=False):
        histogram(ttft_axes, [1000 * r.ttft for r in runs], label, color)
        histogram(tpot_axes, [1000 * r.tpot for r in runs if r.tpot is not None], label, color)
    ttft_axes.set(title="Time to first token (queueing included)", xlabel="milliseconds", ylabel="requests")
    tpot_axes.set(title="Time per output token", xlabel="milliseconds", ylabel="requests")
    for axes in (ttft_axes, tpot_axes):
        axes.legend(fontsize="small")
        axes.grid(True, alpha=0.3)
        axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        plain_numbers(axes.xaxis)
    return save(figure, path)


def histogram(axes, values_ms: list[float], label: str, color: str) -> None:
    if not values_ms:
        return
    axes.hist(values_ms, bins=min(30, max(5, len(values_ms) // 4)), histtype="step", lw=2, color=color, label=label)
    for q, style in ((50, "--"), (99, ":")):
        value = float(np.percentile(values_ms, q))
        axes.axvline(value, color=color, ls=style, label=f"{label} p{q} {value:.4g} ms")


def plain_numbers(axis) -> None:
    """Tick labels as plain numbers (no offsets, no powers of ten)."""
    formatter = FuncFormatter(lambda value, _position: f"{value:g}")
    axis.set_major_formatter(formatter)
    axis.set_minor_formatter(formatter)


def save(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
