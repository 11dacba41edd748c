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
                    "ratio (target: at least 90%) and whether the outputs are identical. --against-engine and "
                    "--memory measure one-token rows instead: the job path against the engine alone, and a job's "
                    "peak RSS and finalize time at two sizes.")
    parser.add_argument("--num-rows", type=int, default=None,
                        help="rows in the job (default: 64; with --against-engine 20000)")
    parser.add_argument("--shard-size", type=int, default=None,
                        help="rows per shard of the sharded run (default: 16; with --against-engine or --memory "
                             "tokenmill run's, 500)")
    parser.add_argument("--min-tokens", type=int, default=16, help="shortest forced output (default: 16)")
    parser.add_argument("--max-tokens", type=int, default=192, help="longest forced output (default: 192)")
    parser.add_argument("--sampling", choices=("greedy", "seeded", "default"), default="greedy",
                        help="rows greedy, or each at temperature 1 with its own seed, or (--against-engine, "
                             "--memory) at tokenmill run's default, temperature 1 without a seed (default: greedy)")
    parser.add_argument("--against-engine", action="store_true",
                        help="instead: --num-rows one-token chat rows through tokenmill run's path (the in-process "
                             "job runner, SQLite, a local folder; the model loaded beforehand) against the engine "
                             "alone (LLM.chat) on the same rows and sampling; prints rows/s of both, the ratio "
                             "(target: at least 90%%) and peak RSS")
    parser.add_argument("--repeats", type=int, default=1,
                        help="--against-engine: engine and job runs, alternating (default: 1)")
    parser.add_argument("--memory", metavar="ROWS,ROWS", type=row_counts,
                        help="instead: a job of one-token rows alone at each size (e.g. 20000,1000000), each in a "
                             "fresh process: rows/s, finalize seconds and peak RSS, the last against the first "
                             "(target: within 10%%, finalize under a minute)")
    parser.add_argument("--tiny-model", action="store_true",
                        help="a tiny random-weight model instead of --model (for --memory's big jobs)")
    add_engine_options(parser)
    parser.set_defaults(handler=run_jobs)


def run_jobs(args: argparse.Namespace) -> int:
    import logging

    from rich.console import Console

    from engine import EngineConfig, LLMEngine
    from tokenmill.bench import jobs, vllm_compare

    if args.against_engine or args.memory:
        return run_against_engine(args)
    args.num_rows, args.shard_size = args.num_rows or 64, args.shard_size or 16
    if args.sampling == "default":
        raise ValueError("--sampling default is for --against-engine and --memory")
    if args.num_rows < 1 or not 1 <= args.shard_size <= args.num_rows:
        raise ValueError("--num-rows must be at least 1 and --shard-size between 1 and --num-rows")
    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args)))
    for name in ("tokenmill.jobs", "alembic"):  # a line per shard and per migration would bury the table
        logging.getLogger(name).setLevel(logging.WARNING)
    console = Console(width=max(Console().width, 120))
    console.print(f"machine: {vllm_compare.cpu_description()}")
    dtype = str(engine.runner.dtype).removeprefix("torch.")
    console.print(f"{args.num_rows} chat rows, outputs of {args.min_tokens}-{args.max_tokens} tokens (EOS ignored), "
                  f"{args.sampling}, {dtype}, {args.threads or 'default'} threads, "
                  f"max_num_seqs {engine.config.max_num_seqs}")
    whole, sharded = jobs.compare(engine, args.num_rows, args.shard_size, args.min_tokens, args.max_tokens,
                                  args.sampling)
    console.print(jobs_table(whole, sharded))
    ratio = sharded.tokens_per_second / whole.tokens_per_second
    identical = whole.outputs == sharded.outputs
    console.print(f"shards of {args.shard_size}: {100 * ratio:.0f}% of one shard's completion tok/s (target >= 90%); "
                  f"outputs {'identical' if identical else 'DIFFER'}")
    return 0 if identical else 1


def row_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected row counts separated by commas, got {text!r}") from None
    if len(counts) < 2 or min(counts) < 1:
        raise argparse.ArgumentTypeError("expected at least two row counts, each at least 1")
    return counts


def run_against_engine(args: argparse.Namespace) -> int:
    """--against-engine and --memory: the job path against the engine alone, or the job at two sizes."""
    import logging
    import sys
    import tempfile
    from pathlib import Path

    from engine import EngineConfig, LLMEngine
    from tokenmill.bench import jobs_engine, vllm_compare

    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # each result as it comes, also into a file
    num_rows = args.num_rows or 20000
    if num_rows < 1 or args.shard_size is not None and args.shard_size < 1 or args.repeats < 1:
        raise ValueError("--num-rows, --shard-size and --repeats must be at least 1")
    for name in ("tokenmill.jobs", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    print(f"machine: {vllm_compare.cpu_description()}")
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-jobs-") as directory:
        kwargs = engine_kwargs(args)
        if args.tiny_model:
            from tokenmill.bench.tiny_model import save_random_model

            save_random_model(Path(directory) / "tiny-model")
            kwargs["model"] = str(Path(directory) / "tiny-model")
        shard = args.shard_size or "tokenmill run's default"
        if args.memory:
            print(f"one-token chat rows, {args.sampling} sampling, shards of {shard}; each job alone in a fresh "
                  f"process, its model loaded before the clock starts")
            results = jobs_engine.memory(kwargs, args.memory, args.sampling, args.shard_size, Path(directory),
                                         progress_bar)
            for result in results:
                print(f"{result['rows']:>9} rows: {result['rows'] / result['seconds']:8.1f} rows/s, "
                      f"finalize {result['finalize_s']:.2f} s, peak RSS {result['peak_rss_mb']:.0f} MiB "
                      f"(after the model load {result['loaded_rss_mb']:.0f} MiB)")
            first, last = results[0], results[-1]
            growth = last["peak_rss_mb"] / first["peak_rss_mb"] - 1
            ok = growth <= 0.10 and last["finalize_s"] < 60
            print(f"peak RSS of {last['rows']} rows against {first['rows']}: {100 * growth:+.1f}% (target <= +10%); "
                  f"finalize {last['finalize_s']:.1f} s (target < 60 s): {'ok' if ok else 'MISSED'}")
            return 0
        engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))
        dtype = str(engine.runner.dtype).removeprefix("torch.")
        print(f"{num_rows} one-token chat rows, {args.sampling} sampling, {dtype}, {args.threads or 'default'} "
              f"threads, max_num_seqs {engine.config.max_num_seqs}, shards of {shard}; the model loaded before "
              f"the clocks start")
        pairs = jobs_engine.against_engine(engine, num_rows, args.sampling, args.shard_size, args.repeats,
                                           on_pair=print_pair, progress_bar=progress_bar)
    if len(pairs) > 1:
        best_alone, best_job = (max(t.rows_per_second for t in side) for side in zip(*pairs, strict=True))
        ratios = sorted(job.rows_per_second / alone.rows_per_second for alone, job in pairs)
        print(f"best of {len(pairs)}: engine alone {best_alone:.1f} rows/s, job {best_job:.1f} rows/s: "
              f"{100 * best_job / best_alone:.0f}%; median of the pairs' ratios {100 * ratios[len(ratios) // 2]:.0f}%")
    return 0


def progress_bar():
    """`tokenmill run`'s progress bar, on stderr (live on a terminal only)."""
    from rich.console import Console

    from tokenmill.progress import JobProgressBar

    return JobProgressBar(Console(stderr=True))


def print_pair(alone, job) -> None:
    for timed in (alone, job):
        print(f"{timed.label:<28} {timed.rows_per_second:8.1f} rows/s ({timed.seconds:.1f} s, CPU "
              f"{timed.cpu_seconds:.1f} s), peak RSS {timed.peak_rss_mb:.0f} MiB")
    print(f"job path: {100 * job.rows_per_second / alone.rows_per_second:.0f}% of the engine alone's rows/s (target "
          f">= 90%); its validation and planning {job.setup_s:.2f} s, finalize {job.finalize_s:.2f} s")
