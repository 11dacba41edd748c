"""`tokenmill bench latency`: its arguments (the engine options among them) and its run."""

from __future__ import annotations

import argparse

from tokenmill.bench.tables import latency_table
from tokenmill.options import add_engine_options, engine_kwargs


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "latency", help="time to first token and inter-token latency at batch 1, with percentiles",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Requests run one at a time (batch 1), each timed at every engine step: time to first token, "
                    "inter-token latency (gaps between the steps that gave tokens), time per output token and end "
                    "to end, as mean/p50/p90/p99. Prompts are random token ids of --prompt-tokens, distinct per "
                    "request; outputs are forced to --output-tokens (EOS ignored).")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens (default: 128)")
    parser.add_argument("--output-tokens", type=int, default=128, help="generated tokens per request (default: 128)")
    parser.add_argument("--requests", type=int, default=10, help="timed requests (default: 10)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed requests first (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="prompt sampling seed (default: 0)")
    parser.add_argument("--json", metavar="FILE", help="also write the summary and every request's timings as JSON")
    add_engine_options(parser)
    parser.set_defaults(handler=run_latency)


def run_latency(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from engine import EngineConfig, LLMEngine
    from tokenmill.bench import latency

    if args.output_tokens < 2 or args.prompt_tokens < 1 or args.requests < 1:
        raise ValueError("--output-tokens must be at least 2, --prompt-tokens and --requests at least 1")
    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args)))
    console = Console(width=max(Console().width, 120))
    console.print(f"batch 1: {args.requests} requests of {args.prompt_tokens} prompt + {args.output_tokens} output "
                  f"tokens ({args.warmup} warm-up), {engine.config.dtype}, {args.threads or 'default'} threads")
    timings = latency.measure(engine, args.prompt_tokens, args.output_tokens, args.requests, args.warmup, args.seed)
    console.print(latency_table(latency.summarize(timings)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(latency.to_json(timings), f, indent=2)
    return 0
