"""`tokenmill bench lora`: its arguments and its run."""

from __future__ import annotations

import argparse

from tokenmill.bench.throughput_cli import add_against_options


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "lora", help="multi-LoRA throughput: the base model alone vs adapters mixed over the requests",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Useful generated tokens per second on the mixed chat workload of `bench throughput` (N chat "
                    "prompts, each forced to a length in [min, max], EOS ignored), on the base model alone and with "
                    "--num-adapters LoRA adapters of --rank on all seven projections (made with peft, seeded; kept "
                    "under the tokenmill cache) mixed over the requests round-robin, every adapter resident "
                    "(max_loras = --num-adapters). Systems: tokenmill and, with --against vllm, vLLM's CPU build "
                    "(LLM(enable_lora=True), a LoRARequest per prompt), per dtype, in one run. Prints tok/s, the "
                    "adapters' share of the same engine's base throughput and tokenmill over vLLM, under the CPU "
                    "model and flags.")
    parser.add_argument("--model", default="smollm2-135m", help="model name or directory (default: smollm2-135m)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests in the workload (default: 64)")
    parser.add_argument("--min-tokens", type=int, default=16, help="shortest forced output (default: 16)")
    parser.add_argument("--max-tokens", type=int, default=192, help="longest forced output (default: 192)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated (default: float32,bfloat16; bfloat16 is skipped on a CPU without "
                             "avx512_bf16 or AMX)")
    parser.add_argument("--num-adapters", type=int, default=8, help="adapters mixed over the requests (default: 8)")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank, also max_lora_rank (default: 16)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads for every system (default: 2)")
    parser.add_argument("--adapters-dir", metavar="DIR",
                        help="where the adapters are made, once (default: bench-lora-adapters/MODEL-rankR under the "
                             "tokenmill cache)")
    add_against_options(parser, batch1=False)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.set_defaults(handler=run_lora)


def run_lora(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    import torch
    from rich.console import Console
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model
    from tokenmill.bench import lora
    from tokenmill.bench.lora_adapters import ALL_PROJECTIONS, make_adapters
    from tokenmill.bench.peak import native_dtypes
    from tokenmill.bench.throughput_cli import against_vllm
    from tokenmill.bench.vllm_compare import cpu_description
    from tokenmill.bench.workload import mixed_chat_workload

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for dtype in dtypes:
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"unsupported dtype {dtype!r}; choose from float32, bfloat16")
    if args.num_adapters < 1 or args.rank < 1:
        raise ValueError("--num-adapters and --rank must be at least 1")
    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 160))
    machine = cpu_description()
    console.print(f"machine: {machine}; {args.threads} threads")
    vllm = against_vllm(args, console)
    dtypes = native_dtypes(dtypes, console)
    if not dtypes:
        return 0
    model_dir = resolve_model(args.model)
    workload = mixed_chat_workload(AutoTokenizer.from_pretrained(model_dir), args.num_prompts, args.min_tokens,
                                   args.max_tokens)
    adapters = make_adapters(args.adapters_dir or lora.adapters_home(args.model, args.rank), args.num_adapters,
                             rank=args.rank, model=args.model)
    console.print(f"workload: {len(workload.prompts)} chat prompts ({workload.prompt_tokens} prompt tokens), "
                  f"{workload.useful_tokens} forced output tokens ({args.min_tokens}-{args.max_tokens} each); "
                  f"{len(adapters)} adapters of rank {args.rank} on {len(ALL_PROJECTIONS)} projections, "
                  f"round-robin over the requests, in {adapters[0].parent}")
    options = dict(threads=args.threads, max_loras=args.num_adapters, max_lora_rank=args.rank)
    results: list[lora.LoraResult] = []

    def done(result: lora.LoraResult) -> lora.LoraResult:
        results.append(result)
        rate = f"{result.tokens_per_second:.1f} tok/s" if result.seconds else result.note
        console.print(f"{result.system} ({result.dtype}): {rate}")
        return result

    for dtype in dtypes:
        ours = [done(lora.tokenmill_run(model_dir, workload, dtype, chosen, **options)) for chosen in ([], adapters)]
        if vllm is None:
            continue
        console.print(f"running vLLM ({dtype}) in {vllm.parents[1]} ...")
        theirs = [done(lora.vllm_run(vllm, model_dir, workload, dtype, chosen, **options)) for chosen in ([], adapters)]
        for a, b in zip(ours, theirs, strict=True):
            same = lora.agreement(a, b)
            if same:
                console.print(f"{dtype}: {same} outputs identical between {a.system} and {b.system} (greedy)")
    title = (f"multi-LoRA throughput (useful generated tokens per second): {len(workload.prompts)} chat prompts, "
             f"{len(adapters)} adapters of rank {args.rank} (max_loras {args.num_adapters}, max_lora_rank {args.rank})")
    console.print(lora.lora_table(results, title))
    if args.json:
        rows = [{**{k: v for k, v in dataclasses.asdict(r).items() if k != "output_token_ids"},
                 "tokens_per_second": r.tokens_per_second} for r in results]
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "threads": args.threads, "results": rows}, f, indent=2)
    return 0
