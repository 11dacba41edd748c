"""`tokenmill bench kv-sharing`: its arguments and its run."""

from __future__ import annotations

import argparse

from engine.config import DEFAULT_MODEL, DTYPES


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "kv-sharing", help="one job of long shared prefixes over two workers, without and with --kv-sharing",
        description="A job of chat rows: --prefixes distinct system prompts of at least --prefix-tokens tokens, "
                    "--questions questions each, shuffled, greedy, --max-tokens each (EOS ignored), as OpenAI "
                    "Batch JSONL. Two real Celery workers (`tokenmill worker`, --threads each, their own "
                    "processes) run it, once without and once with --kv-sharing, each pair started afresh and "
                    "warmed up, on a SQLite database and a local folder in a temporary directory, with --redis-url "
                    "as broker and KV store (its keys removed afterwards). Prints, side by side, the prefill tokens "
                    "the workers computed, the tokens they loaded from Redis, the rest found in their own prefix "
                    "caches, the job's seconds (submit to completed) and tokens/s, and whether the outputs are "
                    "identical; with the CPU's model and flags.")
    parser.add_argument("--prefixes", type=int, default=8, help="distinct shared prefixes (default: 8)")
    parser.add_argument("--questions", type=int, default=8, help="questions per prefix (default: 8)")
    parser.add_argument("--prefix-tokens", type=int, default=512,
                        help="tokens of each shared system prompt at least (default: 512)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per row (default: 16)")
    parser.add_argument("--shard-size", type=int, default=4, help="rows per shard (default: 4)")
    parser.add_argument("--shards-in-flight", type=int, default=1, help="shards each worker runs at once (default: 1)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per worker (default: 1)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"the workers' model (default: {DEFAULT_MODEL})")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="the workers' dtype (default: auto)")
    parser.add_argument("--kv-cache-memory", type=float, default=0.5, metavar="GIB",
                        help="each worker's KV pool in GiB (default: 0.5)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0",
                        help="broker, result backend and KV store (default: redis://127.0.0.1:6379/0)")
    parser.add_argument("--seed", type=int, default=0, help="the rows' shuffle (default: 0)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="pairs of runs, without then with, each with fresh workers; the summary compares "
                             "the medians (default: 1)")
    parser.set_defaults(handler=run_kv_sharing)


def run_kv_sharing(args: argparse.Namespace) -> int:
    import logging
    from statistics import median

    from rich.console import Console
    from rich.table import Table
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model
    from tokenmill.bench import kv_sharing, vllm_compare

    for value, name in ((args.prefixes, "--prefixes"), (args.questions, "--questions"), (args.shard_size,
                        "--shard-size"), (args.shards_in_flight, "--shards-in-flight"), (args.threads, "--threads"),
                        (args.max_tokens, "--max-tokens"), (args.prefix_tokens, "--prefix-tokens"),
                        (args.repeats, "--repeats")):
        if value < 1:
            raise ValueError(f"{name} must be at least 1")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    console = Console(width=max(Console().width, 140))
    console.print(f"machine: {vllm_compare.cpu_description()}", soft_wrap=True)
    workload = kv_sharing.Workload(args.prefixes, args.questions, args.prefix_tokens, args.max_tokens, args.seed)
    settings = kv_sharing.WorkerSettings(args.model, args.threads, args.dtype, args.kv_cache_memory,
                                         args.shards_in_flight, args.redis_url)
    console.print(f"{workload.num_rows} chat rows: {args.prefixes} system prompts of {args.prefix_tokens}+ tokens x "
                  f"{args.questions} questions, shuffled, {args.max_tokens} tokens each (greedy, EOS ignored), "
                  f"shards of {args.shard_size}; 2 workers x {args.threads} thread(s), {args.shards_in_flight} "
                  f"shard(s) in flight each, dtype {args.dtype}", soft_wrap=True)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    pairs = kv_sharing.compare(tokenizer, workload, settings, args.shard_size, args.repeats)
    table = Table("KV sharing", "prefill computed", "loaded (Redis)", "own prefix cache", "prompt tokens", "seconds",
                  "tok/s", "completion tok/s", "workers", "stored", title="bench kv-sharing")
    for run in (run for pair in pairs for run in pair):
        own = run.cached_tokens - run.tokens_loaded
        table.add_row(run.label, f"{run.computed_prefill_tokens:,}", f"{run.tokens_loaded:,}", f"{own:,}",
                      f"{run.prompt_tokens:,}", f"{run.seconds:.1f}", f"{run.tokens_per_second:.1f}",
                      f"{run.completion_tokens_per_second:.1f}", str(run.workers_used),
                      f"{run.stored_mib:.0f} MiB" if run.label.split()[0] == "with" else "-")
    console.print(table)
    without, with_sharing = ([pair[side] for pair in pairs] for side in (0, 1))
    identical = all(run.outputs == without[0].outputs for run in without + with_sharing)
    computed = [median(run.computed_prefill_tokens for run in side) for side in (without, with_sharing)]
    rates = [median(run.tokens_per_second for run in side) for side in (without, with_sharing)]
    which = "medians" if args.repeats > 1 else "one run each"
    console.print(f"with KV sharing ({which}): {100 * (1 - computed[1] / max(computed[0], 1)):.0f}% fewer prefill "
                  f"tokens computed, {rates[1] / rates[0]:.2f}x the tok/s (prompt + completion tokens / job "
                  f"seconds); {sum(run.store_errors for run in with_sharing)} store errors; "
                  f"outputs {'identical' if identical else 'DIFFER'}", soft_wrap=True)
    return 0 if identical else 1
