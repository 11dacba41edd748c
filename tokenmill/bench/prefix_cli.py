"""`tokenmill bench prefix`: its arguments and its run (the workloads are in workload.py, the systems in
throughput.py)."""

from __future__ import annotations

import argparse

from tokenmill.bench.tables import prefix_table
from tokenmill.bench.throughput_cli import add_against_options, against_vllm


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "prefix", help="prefix caching: shared system prompt, and interleaved templates under KV pressure",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Two workloads, in one run.\n"
                    "1. N requests share a long system prompt (about --prefix-tokens tokens) followed by a short "
                    "distinct question, each forced to --output-tokens tokens: Hugging Face static and continuous "
                    "batching, tokenmill with prefix caching off and on. Prints prefill tokens actually computed.\n"
                    "2. Rows of 4 templates interleaved (A B C D A B ...) with a KV pool of --pressure-blocks "
                    "blocks: tokenmill admitting first come first served vs prefix-aware admission.")
    parser.add_argument("--model", default="smollm2-135m", help="model name or directory (default: smollm2-135m)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests sharing the prefix (default: 64)")
    parser.add_argument("--prefix-tokens", type=int, default=600, help="shared system prompt length (default: 600)")
    parser.add_argument("--output-tokens", type=int, default=64, help="forced output tokens (default: 64)")
    parser.add_argument("--systems", default="hf-static,hf-continuous,tokenmill",
                        help="comma-separated subset of hf-static,hf-continuous,tokenmill")
    parser.add_argument("--per-template", type=int, default=16, help="rows per template in workload 2 (default: 16)")
    parser.add_argument("--pressure-blocks", type=int, default=96, help="KV blocks in workload 2 (default: 96)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    add_against_options(parser, batch1=False)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.set_defaults(handler=run_prefix)


def run_prefix(args: argparse.Namespace) -> int:
    import json
    import logging

    import torch
    from rich.console import Console
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model
    from tokenmill.bench import throughput as tp
    from tokenmill.bench import vllm_compare
    from tokenmill.bench.workload import interleaved_templates_workload, shared_prefix_workload

    torch.set_num_threads(args.threads)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    console = Console(width=max(Console().width, 150))
    console.print(f"machine: {vllm_compare.cpu_description()}")
    vllm = against_vllm(args, console)
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    systems = {s.strip() for s in args.systems.split(",") if s.strip()}
    shared = shared_prefix_workload(tokenizer, args.num_prompts, args.prefix_tokens, args.output_tokens)
    console.print(f"workload 1: {len(shared.prompts)} requests, {len(shared.prompts[0])} prompt tokens each "
                  f"(shared system prompt of ~{args.prefix_tokens}), {args.output_tokens} output tokens each")
    results: list[tp.Result] = []
    if "hf-static" in systems:
        results.append(tp.hf_static(model_dir, shared, "float32"))
    if "hf-continuous" in systems:
        results.append(tp.hf_continuous(model_dir, shared, "float32"))
    if "tokenmill" in systems:
        for caching in (False, True):
            label = f"tokenmill, prefix caching {'on' if caching else 'off'}"
            run = tp.tokenmill_run(str(model_dir), shared, "float32", label, num_threads=args.threads,
                                   enable_prefix_caching=caching)
            results.append(run.result)
    if vllm is not None:
        console.print(f"running vLLM (float32, prefix caching on) in {vllm.parents[1]} ...")
        results.append(vllm_compare.run_vllm(vllm, model_dir, shared, "float32", args.threads,
                                             vllm_compare.model_context(model_dir),
                                             "vLLM, prefix caching on").result)
    console.print(prefix_table(results, "workload 1: shared system prompt", "tokenmill, prefix caching off"))

    templates = interleaved_templates_workload(tokenizer, per_template=args.per_template,
                                               prefix_tokens=args.prefix_tokens * 2 // 3)
    console.print(f"workload 2: 4 templates x {args.per_template} rows interleaved, "
                  f"{len(templates.prompts[0])} prompt tokens each, KV pool of {args.pressure_blocks} blocks")
    grouped: list[tp.Result] = []
    for lookahead, label in ((1, "tokenmill, first come first served"), (32, "tokenmill, prefix-aware admission")):
        run = tp.tokenmill_run(str(model_dir), templates, "float32", label, num_threads=args.threads,
                               num_kv_blocks=args.pressure_blocks, admission_lookahead=lookahead)
        grouped.append(run.result)
    console.print(prefix_table(grouped, "workload 2: interleaved templates under KV pressure",
                               "tokenmill, first come first served"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**r.__dict__, "tokens_per_second": r.tokens_per_second} for r in results + grouped], f,
                      indent=2)
    return 0
