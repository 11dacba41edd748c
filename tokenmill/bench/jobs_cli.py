"""`tokenmill bench jobs`: its arguments (the engine options among them) and its run."""

from __future__ import annotations

import argparse

from tokenmill.bench.tables import jobs_table
from tokenmill.options import add_engine_options, engine_kwargs


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "jobs", help="a job cut into small shards against the same rows as one shard (tokenmill run's path)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The mixed chat workload (as `bench throughput`: distinct chat prompts, each forced to a fixed "
                    "output length in [min, max], EOS ignored, greedy) as OpenAI Batch JSONL rows, run as a job "
                    "of one shard and as a job of --shard-size shards through the local job runner on one engine "
                    "(SQLite and a local folder in a temporary directory). Prints completion tok/s of both, the "
                    "ratio (target: at least 90%) and whether the outputs are identical.")
    parser.add_argument("--num-rows", type=int, default=64, help="rows in the job (default: 64)")
    parser.add_argument("--shard-size", type=int, default=16, help="rows per shard of the sharded run (default: 16)")
    parser.add_argument("--min-tokens", type=int, default=16, help="shortest forced output (default: 16)")
    parser.add_argument("--max-tokens", type=int, default=192, help="longest forced output (default: 192)")
    add_engine_options(parser)
    parser.set_defaults(handler=run_jobs)


def run_jobs(args: argparse.Namespace) -> int:
    import logging

    from rich.console import Console

    from engine import EngineConfig, LLMEngine
    from tokenmill.bench import jobs, vllm_compare

    if args.num_rows < 1 or not 1 <= args.shard_size <= args.num_rows:
        raise ValueError("--num-rows must be at least 1 and --shard-size between 1 and --num-rows")
    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args)))
    for name in ("tokenmill.jobs", "alembic"):  # a line per shard and per migration would bury the table
        logging.getLogger(name).setLevel(logging.WARNING)
    console = Console(width=max(Console().width, 120))
    console.print(f"machine: {vllm_compare.cpu_description()}")
    dtype = str(engine.runner.dtype).removeprefix("torch.")
    console.print(f"{args.num_rows} chat rows, outputs of {args.min_tokens}-{args.max_tokens} tokens (EOS ignored), "
                  f"greedy, {dtype}, {args.threads or 'default'} threads, max_num_seqs {engine.config.max_num_seqs}")
    whole, sharded = jobs.compare(engine, args.num_rows, args.shard_size, args.min_tokens, args.max_tokens)
    console.print(jobs_table(whole, sharded))
    ratio = sharded.tokens_per_second / whole.tokens_per_second
    identical = whole.outputs == sharded.outputs
    console.print(f"shards of {args.shard_size}: {100 * ratio:.0f}% of one shard's completion tok/s (target >= 90%); "
                  f"outputs {'identical' if identical else 'DIFFER'}")
    return 0 if identical else 1
