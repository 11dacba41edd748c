"""The result tables `tokenmill bench` prints (throughput_table and speedup also in ops/gpu_check.py)."""

from __future__ import annotations


def speedup(result, reference) -> str:
    return f"{result.tokens_per_second / reference.tokens_per_second:.2f}x" if reference else "-"


LLAMACPP = "llama.cpp"  # the system name of llama.cpp's run in a dtype (llamacpp_compare.system_label)


def throughput_table(results, limits: dict[str, float] | None = None):
    """`limits`: dtype -> the tok/s limit of `bench peak`, for a '% of limit' column. With a llama.cpp run, an
    'x llama.cpp' column beside 'x vLLM' (against llama.cpp in the same dtype)."""
    from rich.table import Table

    limits = limits or {}
    by_key = {(r.system, r.dtype): r for r in results}
    llamacpp = any(r.system == LLAMACPP for r in results)
    table = Table("system", "dtype", "seconds", "useful tok/s", "x vLLM", *(["x llama.cpp"] if llamacpp else []),
                  "x HF static", "x HF continuous", "% of floor", "% of limit", "note",
                  title="throughput (useful generated tokens per second)")
    for r in results:
        static = by_key.get(("HF static batching", r.dtype))
        cont = by_key.get(("HF continuous batching", r.dtype))
        floor = by_key.get(("dense matmul floor", r.dtype))
        share = f"{100 * r.tokens_per_second / floor.tokens_per_second:.0f}%" if floor else "-"
        limit = limits.get(r.dtype)
        of_limit = f"{100 * r.tokens_per_second / limit:.0f}%" if limit else "-"
        against_llamacpp = [speedup(r, by_key.get((LLAMACPP, r.dtype)))] if llamacpp else []
        table.add_row(r.system, r.dtype, f"{r.seconds:.1f}", f"{r.tokens_per_second:.1f}",
                      speedup(r, by_key.get(("vLLM", r.dtype))), *against_llamacpp, speedup(r, static),
                      speedup(r, cont), share, of_limit, r.note)
    return table


def batch1_table(rows: list[tuple[str, str, float]], tokens: int):
    """Its x vLLM column: vLLM's seconds per token over the system's (above 1.00x: faster than vLLM); the same
    against llama.cpp when it ran."""
    from rich.table import Table

    references = ["vLLM"] + ([LLAMACPP] if any(system == LLAMACPP for system, _, _ in rows) else [])
    table = Table("system", "dtype", "ms per output token", *(f"x {name}" for name in references),
                  title=f"batch 1: time per output token ({tokens}-token answers, one request alone)")
    by_key = {(system, dtype): seconds for system, dtype, seconds in rows}
    for system, dtype, seconds in rows:
        ratios = [by_key.get((name, dtype)) for name in references]
        table.add_row(system, dtype, f"{1000 * seconds:.1f}",
                      *(f"{reference / seconds:.2f}x" if reference else "-" for reference in ratios))
    return table


def spec_table(results):
    from rich.table import Table

    table = Table("scenario", "system", "seconds", "tokens", "tok/s", "acceptance", "speedup",
                  title="speculative decoding (speedup: against the same system without speculation)")
    baselines = {}
    for r in results:
        if "no speculation" in r.system or r.system == "HF greedy":
            baselines[(r.scenario, r.system.split(",")[0].split(" ")[0])] = r
    for r in results:
        base = baselines.get((r.scenario, r.system.split(",")[0].split(" ")[0]))
        acceptance = "-" if r.acceptance is None else f"{100 * r.acceptance:.0f}%"
        table.add_row(r.scenario, r.system, f"{r.seconds:.1f}", str(r.tokens), f"{r.tokens_per_second:.1f}",
                      acceptance, speedup(r, base))
    return table


def prefix_table(results, title: str, baseline_system: str):
    from rich.table import Table

    by_system = {r.system: r for r in results}
    names = [baseline_system, "HF static batching", "HF continuous batching", "vLLM, prefix caching on"]
    headers = ["x baseline", "x HF static", "x HF continuous", "x vLLM"][:4 if names[3] in by_system else 3]
    table = Table("system", "prefill tokens computed", "preemptions", "seconds", "useful tok/s", *headers,
                  title=f"{title} (baseline: {baseline_system})")
    for r in results:
        fmt = lambda value: "-" if value is None else f"{value:,}"
        references = [by_system.get(name) for name in names[:len(headers)]]
        table.add_row(r.system, fmt(r.prefill_tokens), fmt(r.preemptions), f"{r.seconds:.1f}",
                      f"{r.tokens_per_second:.1f}", *(speedup(r, ref) for ref in references))
    return table


def concurrency_table(sweeps):
    from rich.table import Table

    table = Table("dtype", "batch", "tokenmill decode tok/s", "dense matmuls alone tok/s", "compute roof tok/s",
                  "memory roof tok/s", "% of roofline", title="decode throughput against concurrency")
    for dtype, points in sweeps.items():
        for p in points:
            table.add_row(dtype, str(p.batch), f"{p.decode_tokens_per_s:.1f}", f"{p.matmul_tokens_per_s:.1f}",
                          f"{p.compute_roof:.0f}", f"{p.memory_roof:.0f}",
                          f"{100 * p.decode_tokens_per_s / p.roof:.0f}%")
    return table


def latency_table(summary):
    from rich.table import Table

    table = Table("metric", "mean ms", "p50 ms", "p90 ms", "p99 ms", title="latency at batch 1")
    for name, p in summary.items():
        table.add_row(name, *(f"{1000 * value:.1f}" for value in (p.mean, p.p50, p.p90, p.p99)))
    return table



def capacity_table(contiguous, paged):
    from rich.table import Table

    table = Table("allocation", "requests at once", "KV used (tokens)", "KV reserved (tokens)", "wasted KV",
                  "waste per request (tokens)", title="capacity")
    for row in (contiguous, paged):
        share = row.wasted_tokens / row.reserved_tokens if row.reserved_tokens else 0.0
        table.add_row(row.scheme, f"{row.requests:,}", f"{row.used_tokens:,}", f"{row.reserved_tokens:,}",
                      f"{row.wasted_tokens:,} ({100 * share:.0f}%)", f"{row.waste_per_request:.1f}")
    return table


def jobs_table(whole, sharded):
    from rich.table import Table

    table = Table("run", "shards", "seconds", "completion tokens", "completion tok/s", title="bench jobs")
    for run in (whole, sharded):
        table.add_row(run.label, str(run.shards), f"{run.seconds:.1f}", f"{run.completion_tokens:,}",
                      f"{run.tokens_per_second:.1f}")
    return table
