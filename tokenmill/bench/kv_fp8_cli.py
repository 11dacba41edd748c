"""`tokenmill bench kv-fp8`: its arguments and its run."""

from __future__ import annotations

import argparse


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "kv-fp8", help="FP8 KV cache: blocks in the same memory, greedy agreement, decode kernel time",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The FP8 (e4m3) KV cache against the model's dtype, in one run, under the CPU model and flags:\n"
                    "a. KV blocks at the same --kv-cache-memory: bfloat16 and float32 models, each with its own "
                    "dtype's cache and with FP8;\n"
                    "b. held-out prompts (seeded sentences nothing was tuned on, as chat prompts): the share whose "
                    "first --tokens greedy tokens equal the model-dtype cache's, and the mean |logprob| gap of "
                    "those reference tokens with the FP8 cache, teacher-forced; and for scale, the share where "
                    "the bfloat16 model's tokens equal the float32 model's;\n"
                    "c. the C paged decode kernel's time over FP8 blocks against blocks of the queries' dtype "
                    "(many sequences, a few hundred tokens of context each, blocks scattered over the pool).\n"
                    "Done-when targets: (a) >= 1.9x the blocks of bfloat16, (b) >= 75%% of prompts keep their "
                    "first 16 tokens.")
    parser.add_argument("--model", default="smollm2-135m", help="model name or directory (default: smollm2-135m)")
    parser.add_argument("--dtypes", default="bfloat16,float32",
                        help="model dtypes, comma-separated (default: bfloat16,float32)")
    parser.add_argument("--num-prompts", type=int, default=64, help="held-out prompts in (b) (default: 64)")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens compared per prompt (default: 16)")
    parser.add_argument("--seed", type=int, default=20260301, help="the held-out prompts' seed (default: 20260301)")
    parser.add_argument("--kv-cache-memory", type=float, default=0.25, metavar="GIB",
                        help="KV memory of every engine (default: 0.25)")
    parser.add_argument("--seqs", type=int, default=64, help="sequences per kernel call in (c) (default: 64)")
    parser.add_argument("--context", type=int, default=384, help="tokens of context per sequence in (c) "
                                                                  "(default: 384)")
    parser.add_argument("--repeats", type=int, default=50, help="kernel calls timed per row of (c) (default: 50)")
    parser.add_argument("--parts", default="a,b,c", help="comma-separated subset of a,b,c (default: all)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.set_defaults(handler=run_kv_fp8)


def held_out_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    from tokenmill.bench.sentences import held_out_sentences
    from tokenmill.bench.workload import chat_ids

    asks = ("Continue this story in a few sentences:", "Summarise in one sentence:", "Rewrite more formally:",
            "What happens next?")
    return [chat_ids(tokenizer, f"{asks[i % len(asks)]} {text}")
            for i, text in enumerate(held_out_sentences(count, seed=seed, max_sentences=4))]


def run_kv_fp8(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    import torch
    from rich.console import Console
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model
    from tokenmill.bench import kv_fp8
    from tokenmill.bench.peak import native_dtypes
    from tokenmill.bench.vllm_compare import cpu_description

    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 150))
    console.print(f"machine: {cpu_description()}; {args.threads} threads")
    parts = {p.strip() for p in args.parts.split(",")}
    dtypes = native_dtypes([d.strip() for d in args.dtypes.split(",") if d.strip()], console)
    model_dir = resolve_model(args.model)
    memory = int(args.kv_cache_memory * 2**30)
    capacities, agreements, kernels = [], [], []
    if "a" in parts or "b" in parts:
        prompts = held_out_prompts(AutoTokenizer.from_pretrained(model_dir), args.num_prompts, args.seed)
        max_len = max(map(len, prompts)) + args.tokens + 16
        for dtype in dtypes:
            if "b" in parts:
                result, caps = kv_fp8.agreement(model_dir, prompts, dtype, args.tokens, args.threads, memory, max_len)
                agreements.append(result)
                capacities += caps
                console.print(f"{dtype}: {result.same_prefix}/{result.prompts} prompts keep their first "
                              f"{args.tokens} tokens; mean |logprob gap| {result.mean_gap:.4f}")
            else:
                for cache in ("auto", "fp8"):
                    capacities.append(kv_fp8.capacity(kv_fp8.engine(model_dir, dtype, cache, args.threads, memory,
                                                                    max_len), dtype, cache))
        if "a" in parts:
            console.print(kv_fp8.capacity_table(capacities))
        if "b" in parts:
            console.print(kv_fp8.agreement_table(agreements))
            if (floor := kv_fp8.same_prefixes(agreements)) is not None:
                console.print(f"for scale, without FP8: the bfloat16 model's first {args.tokens} greedy tokens equal "
                              f"the float32 model's on {floor}/{len(prompts)} prompts ({floor / len(prompts):.0%})")
    if "c" in parts:
        kernels = kv_fp8.time_decode_kernels(args.seqs, args.context, args.repeats)
        console.print(kv_fp8.kernel_table(kernels, args.seqs, args.context))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_description(), "capacity": [dataclasses.asdict(c) for c in capacities],
                       "agreement": [dataclasses.asdict(a) for a in agreements],
                       "bfloat16_equals_float32": kv_fp8.same_prefixes(agreements),
                       "kernel": [{**dataclasses.asdict(k), "gb_per_s": k.gb_per_s} for k in kernels]}, f, indent=2)
    return 0
