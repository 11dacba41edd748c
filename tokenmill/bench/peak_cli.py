"""`tokenmill bench peak`: its arguments and its run."""

from __future__ import annotations

import argparse


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "peak", help="the model's GEMM shapes timed on this machine, and the tok/s limit they set",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Times F.linear at the model's own shapes (fused QKV, O, fused gate/up, down, LM head) at "
                    "16, 64 and 256 rows, and a square 2048 matmul, in each dtype. The limit is the most tokens "
                    "per second a decode step of these matmuls alone reaches: no engine gets there (attention, "
                    "norms and sampling come on top). `bench throughput` prints each system's share of it.")
    parser.add_argument("--model", default="smollm2-135m", help="model name or directory (default: smollm2-135m)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated (default: float32,bfloat16; bfloat16 is skipped on a CPU without "
                             "avx512_bf16 or AMX, where torch emulates it)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.set_defaults(handler=run_peak)


def run_peak(args: argparse.Namespace) -> int:
    import json

    import torch
    from rich.console import Console

    from engine.model_loader import resolve_model
    from tokenmill.bench import peak, vllm_compare
    from tokenmill.bench import throughput as tp

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for dtype in dtypes:
        if dtype not in tp.DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose from {sorted(tp.DTYPES)}")
    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 120))
    console.print(f"machine: {vllm_compare.cpu_description()}, {args.threads} threads")
    model_dir = resolve_model(args.model)
    peaks = [peak.measure(model_dir, dtype) for dtype in peak.native_dtypes(dtypes, console)]
    console.print(peak.peak_table(peaks))
    console.print(peak.limit_table(peaks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**p.__dict__, "limit": p.limit} for p in peaks], f, indent=2)
    return 0
