"""`tokenmill bench swap`: its arguments and its run."""

from __future__ import annotations

import argparse


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "swap", help="swap vs recompute preemption: long prompts in a KV pool too small for them",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="N distinct long prompts (lengths uniform in [--min-prompt, --max-prompt] tokens, no shared "
                    "prefix), each forced to --max-tokens greedy tokens (EOS ignored), sent at once to an engine "
                    "whose KV pool holds about --resident of them at full length, so running sequences are "
                    "preempted again and again. One engine per --modes entry: recompute (drop the victim's KV and "
                    "prefill it again), swap (copy it to host memory and back) and auto (swap victims with at "
                    "least 256 computed tokens). Prints seconds, generated tok/s, preemptions, recomputed tokens, "
                    "blocks swapped and whether the tokens equal recompute's, under the CPU model and flags.")
    parser.add_argument("--model", default="smollm2-135m", help="model name or directory (default: smollm2-135m)")
    parser.add_argument("--num-prompts", type=int, default=8, help="requests (default: 8)")
    parser.add_argument("--min-prompt", type=int, default=800, help="shortest prompt in tokens (default: 800)")
    parser.add_argument("--max-prompt", type=int, default=1500, help="longest prompt in tokens (default: 1500)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default: 64)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="step token budget: prompts are admitted by 512-token chunks, so several prefill at "
                             "once and outgrow the pool (default: 512)")
    parser.add_argument("--resident", type=float, default=2.0,
                        help="requests the KV pool holds at full length (default: 2)")
    parser.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks (overrides --resident)")
    parser.add_argument("--modes", default="recompute,swap",
                        help="comma-separated subset of recompute,swap,auto (default: recompute,swap)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
                        help="weights and KV dtype (default: float32, where greedy tokens compare exactly)")
    parser.add_argument("--swap-space", type=float, default=4, metavar="GIB", help="host swap space (default: 4)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="turn prefix caching on (default: off; on, a recomputed victim re-admitted before its "
                             "freed blocks are reused finds them cached and recomputes little)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="prompt lengths' seed (default: 0)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.set_defaults(handler=run_swap)


def run_swap(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    import torch
    from rich.console import Console
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model
    from tokenmill.bench import swap
    from tokenmill.bench.vllm_compare import cpu_description

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(swap.MODES))
    if unknown or not modes:
        raise ValueError(f"unknown --modes {unknown or modes}; choose from {', '.join(swap.MODES)}")
    if not 1 <= args.min_prompt <= args.max_prompt:
        raise ValueError("need 1 <= --min-prompt <= --max-prompt")
    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 150))
    machine = cpu_description()
    console.print(f"machine: {machine}; {args.threads} threads")
    model_dir = resolve_model(args.model)
    prompts = swap.long_prompts(AutoTokenizer.from_pretrained(model_dir), args.num_prompts, args.min_prompt,
                                args.max_prompt, args.seed)
    blocks = args.num_kv_blocks or swap.pool_blocks(prompts, args.max_tokens, args.resident)
    console.print(f"workload: {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
                  f"({sum(map(len, prompts)):,} in all), {args.max_tokens} tokens each; KV pool {blocks} blocks of "
                  f"16 tokens ({blocks * 16:,} tokens); {args.dtype}; prefix caching "
                  f"{'on' if args.prefix_caching else 'off'}; step budget {args.max_num_batched_tokens} tokens")
    results = []
    for mode in modes:
        result = swap.run_mode(model_dir, prompts, args.max_tokens, mode, blocks, args.dtype, args.threads,
                               args.swap_space, args.prefix_caching, args.max_num_batched_tokens)
        console.print(f"{mode}: {result.seconds:.1f} s, {result.tokens_per_second:.1f} tok/s, "
                      f"{result.preemptions} preemptions")
        results.append(result)
    console.print(swap.swap_table(results, f"swap vs recompute preemption: {len(prompts)} long prompts, "
                                           f"{blocks}-block KV pool"))
    if args.json:
        rows = [{**{k: v for k, v in dataclasses.asdict(r).items() if k != "output_token_ids"},
                 "tokens_per_second": r.tokens_per_second} for r in results]
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "threads": args.threads, "num_kv_blocks": blocks, "results": rows}, f,
                      indent=2)
    return 0
