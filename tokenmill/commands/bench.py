"""`tokenmill bench ...`: benchmarks that print tokenmill beside reference systems in one run. Each benchmark's
arguments and run live beside it, in `tokenmill.bench.<name>_cli`; this module only registers them."""

from __future__ import annotations

import argparse

from tokenmill.bench import (
    capacity_cli,
    embed_cli,
    int8_cli,
    jobs_cli,
    kv_fp8_cli,
    kv_sharing_cli,
    latency_cli,
    lora_cli,
    peak_cli,
    prefix_cli,
    roofline_cli,
    spec_cli,
    swap_cli,
    throughput_cli,
)

BENCHMARKS = (throughput_cli, prefix_cli, spec_cli, peak_cli, capacity_cli, latency_cli, embed_cli, jobs_cli, lora_cli,
              swap_cli, kv_fp8_cli, int8_cli, kv_sharing_cli, roofline_cli)


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("bench", help="benchmarks against reference systems",
                                 description="Benchmarks run every system in the same process, one after another, "
                                             "and print one table, so the numbers share a machine state.")
    benches = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for benchmark in BENCHMARKS:
        benchmark.register(benches)
