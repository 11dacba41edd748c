"""`tokenmill bench roofline`: its arguments and its run."""

from __future__ import annotations

import argparse

from tokenmill.bench.throughput_cli import add_workload_options

DEFAULT_PROMPTS = 16


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "roofline", help="a workload's floor on this machine (GEMMs at peak, weights and KV read at stream "
                         "bandwidth) per phase, and the measured time as a share of it",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measures this machine's limits, then runs a workload through tokenmill's engine and records "
                    "every step (prompt and decode tokens, sampled rows, KV tokens read, its time):\n"
                    "- the GEMM peak: the fastest FLOP rate `bench peak` measures here (its limit's step of the "
                    "model's own matmuls, each of its shapes, or a square 2048 matmul);\n"
                    "- the stream bandwidth: STREAM's copy, scale, add and triad over float64 arrays 4x the CPU "
                    "caches, best of 10, on torch's threads.\n"
                    "Each step's floor is max(GEMM FLOPs / peak, (weights + KV bytes read) / bandwidth). The table "
                    "gives, per phase (prefill, decode, total), each part's seconds, the floor, the measured "
                    "seconds and the floor as a percentage of them.")
    add_workload_options(
        parser, sharegpt_help="vLLM's benchmark data, sampled as `bench throughput` samples it",
        prompts_default=DEFAULT_PROMPTS,
        prompts_help=f"requests in the workload (default: {DEFAULT_PROMPTS}, about a minute in all on 2 cores; "
                     "`bench throughput` runs 64 mixed or 200 ShareGPT)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the model's dtype (default: float32; bfloat16 needs avx512_bf16 or AMX)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                        help="the engine's KV cache: auto (the model's dtype) or fp8 (1 byte an element) "
                             "(default: auto)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--peak-rows", default="16,64,256",
                        help="batch sizes `bench peak` times the model's matmul step at; the peak is the fastest "
                             "(default: %(default)s)")
    parser.add_argument("--stream-mib", type=int,
                        help="MiB of each STREAM array (default: 4x the CPU caches, at least 64)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.set_defaults(handler=run_roofline)


def run_roofline(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    import torch
    from rich.console import Console
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model
    from tokenmill.bench import peak, roofline
    from tokenmill.bench.sharegpt import sharegpt_workload
    from tokenmill.bench.vllm_compare import cpu_description
    from tokenmill.bench.workload import mixed_chat_workload

    if args.num_prompts < 1 or args.min_tokens < 1 or args.max_tokens < args.min_tokens:
        raise ValueError("--num-prompts and --min-tokens must be at least 1, --max-tokens at least --min-tokens")
    rows = tuple(int(r) for r in args.peak_rows.split(",") if r.strip())
    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 150))
    console.print(f"machine: {cpu_description()}; {args.threads} threads")
    if not peak.native(args.dtype):
        console.print(f"{args.dtype}: this CPU has no native {args.dtype} (avx512_bf16 or AMX); torch emulates it, "
                      "so `bench peak` sets no useful limit: run --dtype float32")
        return 1
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if args.dataset == "sharegpt":
        workload = sharegpt_workload(tokenizer, args.num_prompts)
    else:
        workload = mixed_chat_workload(tokenizer, args.num_prompts, args.min_tokens, args.max_tokens)
    console.print(f"workload ({args.dataset}): {len(workload.prompts)} chat prompts ({workload.prompt_tokens:,} "
                  f"prompt tokens), {workload.useful_tokens:,} forced output tokens, {args.dtype}, KV cache "
                  f"{args.kv_cache_dtype}")
    stream = roofline.stream_bandwidth(args.stream_mib << 20 if args.stream_mib else None)
    console.print(roofline.stream_line(stream))
    measured = peak.measure(model_dir, args.dtype, rows)
    peak_flops, where = roofline.gemm_peak(measured)
    console.print(f"GEMM peak: {peak_flops / 1e9:.1f} GFLOP/s ({args.dtype}, {where}: the fastest `bench peak` "
                  f"measured; its limit: {measured.limit:.0f} tok/s at {measured.limit_rows} rows x "
                  f"{measured.flops_per_token / 1e9:.3f} GFLOP a token, "
                  f"{measured.limit * measured.flops_per_token / 1e9:.1f} GFLOP/s)")
    model = roofline.roofline_for(model_dir, args.dtype, args.kv_cache_dtype, peak_flops, stream.best)
    console.print(f"running tokenmill ({args.dtype}, KV cache {args.kv_cache_dtype}) ...")
    run = roofline.record_run(str(model_dir), workload, args.dtype, num_threads=args.threads,
                              kv_cache_dtype=args.kv_cache_dtype)
    model, raised = model.raised_to(run.steps)
    for line in raised:
        console.print(f"{line}: the limits measured above were low (a busy machine?)")
    phases = roofline.phase_floors(run.steps, model, run.wall_seconds)
    title = (f"roofline: {args.dataset}, {run.num_prompts} prompts, {run.output_tokens:,} output tokens, "
             f"{args.dtype}, KV cache {args.kv_cache_dtype}")
    console.print(roofline.roofline_table(phases, model, title))
    total = phases[-1]
    console.print(f"tokenmill: {run.output_tokens / run.wall_seconds:.1f} useful tok/s, {100 * total.share:.1f}% of "
                  f"the floor ({total.floor_s:.2f} s of {run.wall_seconds:.2f} s; weights "
                  f"{(model.layer_weight_bytes + model.head_weight_bytes) / 1e6:.0f} MB a step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_description(), "threads": args.threads, "dataset": args.dataset,
                       "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                       "stream": {"array_bytes": stream.array_bytes, "bytes_per_s": stream.rates,
                                  "best": stream.best},
                       "peak": {"flops_per_s": peak_flops, "where": where, "limit_tok_s": measured.limit,
                                "limit_rows": measured.limit_rows, "square_gflops": measured.square_gflops},
                       "roofline": dataclasses.asdict(model), "raised": raised,
                       "phases": [{**dataclasses.asdict(p), "share": p.share} for p in phases],
                       "wall_seconds": run.wall_seconds, "output_tokens": run.output_tokens,
                       "steps": [dataclasses.asdict(s) for s in run.steps]}, f, indent=2)
    return 0
