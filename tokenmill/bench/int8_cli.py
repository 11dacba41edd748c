"""`tokenmill bench int8`: its arguments and its run."""

from __future__ import annotations

import argparse

MEASURED = ("Measured on an Intel Xeon with AMX, 2 cores, 2 threads, torch 2.13.0+cpu (two runs; docs/performance.md, "
            "\"int8 GEMMs\"): a decode step's best int8 GEMM alone 0.91-1.04x the bfloat16 engine at 16 rows, "
            "1.35-1.39x at 64, 1.26-1.86x overall; W8A8 in full 0.49-0.50x overall. int8 does not pay here: "
            "0.50x < 1.7x, so no W8A8.")


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "int8", help="int8 GEMMs (AMX-int8 / VNNI) against the engine's bfloat16 ones at the model's shapes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Times, at the model's fused GEMM shapes (QKV, O, gate/up, down, LM head) and each --rows, "
                    "interleaved and best of --repeats:\n"
                    "- bfloat16: the engine's prepacked linear and F.linear;\n"
                    "- int8 GEMMs alone: torch._int_mm and oneDNN's qlinear_pointwise (where this torch has it);\n"
                    "- W8A8 in full (vLLM compressed-tensors' scheme: dynamic per-token activations, per-channel "
                    "weights): quantize + int8 GEMM + dequantize to bfloat16;\n"
                    "- quantized::linear_dynamic (per-tensor activations), for reference.\n"
                    "Then the decode-step ratio (each layer shape once per layer, and the LM head) and the rule "
                    "of issue #44: W8A8 is worth building only if its total is >= 1.7x the bfloat16 engine.\n\n"
                    + MEASURED)
    parser.add_argument("--model", default="smollm2-135m", help="model name or directory (default: smollm2-135m)")
    parser.add_argument("--rows", default="16,64,256,1024", help="row counts, comma-separated (default: "
                                                                 "16,64,256,1024)")
    parser.add_argument("--repeats", type=int, default=10, help="timed samples per path, the best kept (default: 10)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.set_defaults(handler=run_int8)


def run_int8(args: argparse.Namespace) -> int:
    import json

    import torch
    from rich.console import Console

    from engine.model_loader import resolve_model
    from tokenmill.bench import int8
    from tokenmill.bench.peak import native
    from tokenmill.bench.vllm_compare import cpu_description

    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 170))
    console.print(f"machine: {cpu_description()}; {args.threads} threads")
    if not native("bfloat16"):
        console.print("skipped: this CPU has no native bfloat16 (avx512_bf16 or AMX), the baseline int8 must beat")
        return 0
    with open(resolve_model(args.model) / "config.json") as f:
        shapes = int8.model_shapes(json.load(f))
    rows = tuple(int(r) for r in args.rows.split(",") if r.strip())
    skipped: dict[str, str] = {}
    timings = int8.measure(shapes, rows, args.repeats, skipped=skipped)
    for path, reason in skipped.items():
        console.print(f"{path} skipped: {reason}")
    console.print(int8.int8_table(timings))
    console.print(int8.decode_table(timings))
    gemm, total = int8.decode_ratios(timings, int8.GEMMS), int8.decode_ratios(timings, int8.TOTALS)
    console.print(f"{int8.conclusion(total['overall'])} (the int8 GEMM alone: {gemm['overall']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_description(), "threads": args.threads, "skipped": skipped,
                       "timings": [{"shape": t.shape.__dict__, "rows": t.rows, "seconds": t.seconds,
                                    "rates": {path: t.rate(path) for path in t.seconds}} for t in timings],
                       "decode_gemm": {str(k): v for k, v in gemm.items()},
                       "decode_total": {str(k): v for k, v in total.items()}}, f, indent=2)
    return 0
