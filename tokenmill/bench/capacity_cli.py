"""`tokenmill bench capacity`: its arguments and its run."""

from __future__ import annotations

import argparse

from tokenmill.bench.tables import capacity_table


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "capacity", help="requests that fit in a KV budget: contiguous reservation vs paged blocks",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fill a KV budget with requests at their full length, through the engine's block pool: once "
                    "reserving the whole context per request (contiguous), once in blocks (paged). Requests cycle "
                    "through --requests sampled lengths: a fixed prompt plus a Pareto-distributed output.\n"
                    "Default: Llama-3-8B in bf16 (131,072 bytes of KV per token), 70 GiB of KV (an 80 GiB card).")
    parser.add_argument("--requests", type=int, default=100, help="sampled request lengths (default: 100)")
    parser.add_argument("--mean-output", type=float, default=150, help="mean output length (default: 150)")
    parser.add_argument("--max-output", type=int, default=4096, help="output length cap (default: 4096)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default: 128)")
    parser.add_argument("--context", type=int, default=4096, help="max context per request (default: 4096)")
    parser.add_argument("--block-size", type=int, default=16, help="paged block size in tokens (default: 16)")
    parser.add_argument("--kv-gib", type=float, default=70.0, help="KV budget in GiB (default: 70)")
    parser.add_argument("--kv-bytes", type=int, help="KV budget in bytes (overrides --kv-gib)")
    parser.add_argument("--model-shape", default="llama-3-8b",
                        help="model whose KV bytes per token set the scale (llama-3-8b, llama-3-70b, smollm2-135m)")
    parser.add_argument("--bytes-per-token", type=int, help="KV bytes per token (overrides --model-shape)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.set_defaults(handler=run_capacity)


def run_capacity(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tokenmill.bench import capacity

    if args.bytes_per_token is None and args.model_shape not in capacity.MODEL_SHAPES:
        raise ValueError(f"unknown --model-shape {args.model_shape!r}; known: {sorted(capacity.MODEL_SHAPES)}")
    per_token = args.bytes_per_token or capacity.bytes_per_token(args.model_shape)
    budget_bytes = args.kv_bytes if args.kv_bytes is not None else int(args.kv_gib * 2**30)
    budget_tokens = budget_bytes // per_token
    outputs = capacity.pareto_lengths(args.requests, args.mean_output, min(args.max_output, args.context
                                                                           - args.prompt_tokens), args.seed)
    contiguous, paged = capacity.compare(budget_tokens, args.context, args.block_size,
                                         [args.prompt_tokens + n for n in outputs])
    console = Console(width=max(Console().width, 140))
    console.print(f"KV budget: {budget_bytes / 2**30:.1f} GiB at {per_token:,} bytes/token = {budget_tokens:,} tokens; "
                  f"{args.requests} sampled requests: prompt {args.prompt_tokens} + output mean "
                  f"{sum(outputs) / len(outputs):.0f} (max {max(outputs)}), context {args.context}")
    console.print(capacity_table(contiguous, paged))
    console.print(f"paged fits {paged.requests / max(contiguous.requests, 1):.1f}x the requests; its waste per request "
                  f"is {paged.waste_per_request:.1f} tokens, under one {args.block_size}-token block")
    return 0
