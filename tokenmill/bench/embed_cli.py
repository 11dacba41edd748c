"""`tokenmill bench embed`: its arguments and its run."""

from __future__ import annotations

import argparse


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "embed", help="embedding throughput: tokenmill vs sentence-transformers vs vLLM",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="N held-out sentences of mixed length (a seeded phrase grammar, 8 to about 260 tokens; inputs "
                    "over the model's max_seq_length are truncated by every system) embedded by tokenmill (in "
                    "float32 on CPUs with AMX also with --float32-matmul-precision high), by "
                    "sentence-transformers' encode at its default batch size and at its best batch size (a sweep "
                    "on a sample), and by vLLM's CPU build (from its own venv, `make vllm-venv`; 'not installed' "
                    "without it), per dtype, in one run. Prints sentences/s and tokens/s side by side, tokenmill's "
                    "speed over the best other system, and each system's worst cosine against tokenmill's "
                    "vectors, under the CPU model and flags.")
    parser.add_argument("--model", default="all-minilm-l6-v2", help="embedding model (default: all-minilm-l6-v2)")
    parser.add_argument("--num-sentences", type=int, default=10_000, help="sentences embedded (default: 10000)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated (default: float32,bfloat16; bfloat16 is skipped on a CPU without "
                             "avx512_bf16 or AMX, where every system emulates it at a sixth of float32's speed)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads for every system (default: 2)")
    parser.add_argument("--batch-tokens", type=int, default=2048,
                        help="tokenmill's token budget of one packed batch (default: 2048)")
    parser.add_argument("--vllm-venv", help="vLLM's virtualenv (default: $TOKENMILL_VLLM_VENV or .vllm-venv)")
    parser.add_argument("--no-matmul-high", action="store_true",
                        help="skip the second tokenmill float32 row, run with --float32-matmul-precision high (float32 "
                             "GEMMs as three bfloat16 products on AMX tiles; only on CPUs with AMX)")
    parser.add_argument("--seed", type=int, default=20260201, help="sentence generator seed (default: 20260201)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.set_defaults(handler=run_embed)


def run_embed(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    import torch
    from rich.console import Console

    from engine.model_loader import resolve_model
    from tokenmill.bench import embed
    from tokenmill.bench.peak import native_dtypes
    from tokenmill.bench.sentences import held_out_sentences
    from tokenmill.bench.vllm_compare import cpu_description

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for dtype in dtypes:
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"unsupported dtype {dtype!r}; choose from float32, bfloat16")
    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 150))
    console.print(f"machine: {cpu_description()}; {args.threads} threads")
    model_dir = resolve_model(args.model)
    dtypes = native_dtypes(dtypes, console)
    if not dtypes:
        return 0
    texts = held_out_sentences(args.num_sentences, seed=args.seed)
    results = []
    def done(*new) -> None:
        for result in new:
            results.append(result)
            rate = f"{result.sentences_per_s:.1f} sentences/s" if result.seconds else result.note
            console.print(f"{result.system} {result.dtype}: {rate}")

    for dtype in dtypes:
        ours_results, st_results, vectors = embed.run_in_fresh_process(
            args.model, model_dir, texts, dtype, args.threads, args.batch_tokens, not args.no_matmul_high)
        ours = ours_results[0]
        done(*ours_results, *st_results)
        vllm, vllm_vectors = embed.run_vllm(model_dir, texts, dtype, args.threads, ours.tokens, args.vllm_venv)
        if vllm_vectors is not None:
            vllm.min_cosine = embed.min_cosine(vectors, vllm_vectors)
        done(vllm)
    title = (f"embedding throughput: {len(texts)} held-out sentences of mixed length, {ours.tokens} tokens, "
             f"model {args.model}")
    console.print(embed.embed_table(results, title))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_description(), "results": [dataclasses.asdict(r) for r in results]}, f,
                      indent=2)
    return 0
