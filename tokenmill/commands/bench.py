"""`tokenmill bench ...`: benchmarks that print tokenmill beside reference systems."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("bench", help="benchmarks against reference systems")
    parser.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
