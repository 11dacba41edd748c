"""Result tables shared by `tokenmill bench` and ops/gpu_check.py."""

from __future__ import annotations


def speedup(result, reference) -> str:
    return f"{result.tokens_per_second / reference.tokens_per_second:.2f}x" if reference else "-"


def throughput_table(results, limits: dict[str, float] | None = None):
    """`limits`: dtype -> the tok/s limit of `bench peak`, for a '% of limit' column."""
    from rich.table import Table

    limits = limits or {}
    table = Table("system", "dtype", "seconds", "useful tok/s", "x vLLM", "x HF static", "x HF continuous",
                  "% of floor", "% of limit", "note", title="throughput (useful generated tokens per second)")
    by_key = {(r.system, r.dtype): r for r in results}
    for r in results:
        static = by_key.get(("HF static batching", r.dtype))
        cont = by_key.get(("HF continuous batching", r.dtype))
        floor = by_key.get(("dense matmul floor", r.dtype))
        share = f"{100 * r.tokens_per_second / floor.tokens_per_second:.0f}%" if floor else "-"
        limit = limits.get(r.dtype)
        of_limit = f"{100 * r.tokens_per_second / limit:.0f}%" if limit else "-"
        table.add_row(r.system, r.dtype, f"{r.seconds:.1f}", f"{r.tokens_per_second:.1f}",
                      speedup(r, by_key.get(("vLLM", r.dtype))), speedup(r, static), speedup(r, cont), share,
                      of_limit, r.note)
    return table


def batch1_table(rows: list[tuple[str, str, float]], tokens: int):
    from rich.table import Table

    table = Table("system", "dtype", "ms per output token", "x vLLM",
                  title=f"batch 1: time per output token ({tokens}-token answers, one request alone)")
    by_key = {(system, dtype): seconds for system, dtype, seconds in rows}
    for system, dtype, seconds in rows:
        reference = by_key.get(("vLLM", dtype))
        table.add_row(system, dtype, f"{1000 * seconds:.1f}", f"{seconds / reference:.2f}x" if reference else "-")
    return table
