"""`tokenmill bench ...`: benchmarks that print tokenmill beside reference systems in one run."""

from __future__ import annotations

import argparse
import contextlib

from tokenmill.bench.tables import batch1_table, speedup, throughput_table
from tokenmill.options import add_engine_options, engine_kwargs

SYSTEMS = ("hf-static", "hf-continuous", "tokenmill", "floor")
OPTIONAL_SYSTEMS = ("tokenmill-invariant",)  # run only when named: tokenmill with batch_invariant=True


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("bench", help="benchmarks against reference systems",
                                 description="Benchmarks run every system in the same process, one after another, "
                                             "and print one table, so the numbers share a machine state.")
    benches = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    tp = benches.add_parser(
        "throughput", help="HF static vs HF continuous batching vs tokenmill on one workload",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Useful generated tokens per second on a mixed chat workload: N distinct chat prompts, each "
                    "forced to generate a fixed number of tokens drawn from [min, max] (EOS ignored).\n"
                    "Systems: Hugging Face static batching (padded batches), Hugging Face continuous batching "
                    "(init_continuous_batching), tokenmill, and the dense-matmul floor: the time of the model's "
                    "matrix multiplies alone at every step's batch size of tokenmill's schedule.")
    tp.add_argument("--model", default="smollm2-135m", help="model name or directory (default: smollm2-135m)")
    tp.add_argument("--num-prompts", type=int, default=64, help="requests in the workload (default: 64)")
    tp.add_argument("--min-tokens", type=int, default=16, help="shortest forced output (default: 16)")
    tp.add_argument("--max-tokens", type=int, default=192, help="longest forced output (default: 192)")
    tp.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default: float32,bfloat16)")
    tp.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated subset of {','.join(SYSTEMS + OPTIONAL_SYSTEMS)} "
                         f"(default: {','.join(SYSTEMS)})")
    tp.add_argument("--static-batch-size", type=int, default=16, help="HF static batch size (default: 16)")
    tp.add_argument("--threads", type=int, default=2, help="torch CPU threads for every system (default: 2)")
    tp.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                    help="also run tokenmill with its model sharded over N processes (sharing --threads between "
                         "them) beside TP=1, and print the share of step time in all-reduce (on CPU this measures "
                         "the overhead, not a speed-up) (default: 1)")
    add_against_options(tp)
    tp.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    tp.add_argument("--profile", action="store_true",
                    help="also print where tokenmill's step time goes: GEMMs, attention, norms/RoPE/activation, "
                         "sampling, other model ops, and the scheduler, batch building and Python (timers on the "
                         "engine's functions, for the tokenmill run)")
    tp.add_argument("--schema", nargs="?", const="builtin", metavar="FILE",
                    help="also run tokenmill with every request constrained to this JSON schema (without FILE: a "
                         "built-in list-of-records schema) and print the cost of the token masks")
    tp.add_argument("--plots", metavar="DIR", default="bench-out",
                    help="write PNG plots here: throughput_concurrency.png (a concurrency sweep of tokenmill under "
                         "the roofline) and latency_distributions.png (TTFT/TPOT of the tokenmill run) "
                         "(default: bench-out)")
    tp.add_argument("--no-plots", action="store_true", help="skip the concurrency sweep and the plots")
    tp.add_argument("--concurrency",
                    help="batch sizes of the concurrency sweep (default: 1,4,16,64, capped at --num-prompts)")
    tp.add_argument("--sweep-tokens", type=int,
                    help="prompt tokens and output tokens of each sweep request (default: 64, at most --max-tokens)")
    tp.set_defaults(handler=run_throughput)

    px = benches.add_parser(
        "prefix", help="prefix caching: shared system prompt, and interleaved templates under KV pressure",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Two workloads, in one run.\n"
                    "1. N requests share a long system prompt (about --prefix-tokens tokens) followed by a short "
                    "distinct question, each forced to --output-tokens tokens: Hugging Face static and continuous "
                    "batching, tokenmill with prefix caching off and on. Prints prefill tokens actually computed.\n"
                    "2. Rows of 4 templates interleaved (A B C D A B ...) with a KV pool of --pressure-blocks "
                    "blocks: tokenmill admitting first come first served vs prefix-aware admission.")
    px.add_argument("--model", default="smollm2-135m", help="model name or directory (default: smollm2-135m)")
    px.add_argument("--num-prompts", type=int, default=64, help="requests sharing the prefix (default: 64)")
    px.add_argument("--prefix-tokens", type=int, default=600, help="shared system prompt length (default: 600)")
    px.add_argument("--output-tokens", type=int, default=64, help="forced output tokens (default: 64)")
    px.add_argument("--systems", default="hf-static,hf-continuous,tokenmill",
                    help="comma-separated subset of hf-static,hf-continuous,tokenmill")
    px.add_argument("--per-template", type=int, default=16, help="rows per template in workload 2 (default: 16)")
    px.add_argument("--pressure-blocks", type=int, default=96, help="KV blocks in workload 2 (default: 96)")
    px.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    add_against_options(px, batch1=False)
    px.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    px.set_defaults(handler=run_prefix)

    sp = benches.add_parser(
        "spec", help="speculative decoding: copying at batch 1, the mixed batch, a long-tail job",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Three scenarios, in one run, greedy:\n"
                    "a. one request at a time, answers that copy their prompt: tokenmill without and with "
                    "speculation, and Hugging Face greedy vs its prompt-lookup decoding;\n"
                    "b. the 64-request mixed chat workload of `bench throughput`: none vs adaptive speculation;\n"
                    "c. a job whose tail runs with few requests (many short answers, a few long copying ones).")
    sp.add_argument("--model", default="smollm2-135m", help="model name or directory (default: smollm2-135m)")
    sp.add_argument("--method", default="ngram", choices=("ngram", "self", "draft"), help="proposer (default: ngram)")
    sp.add_argument("--draft-model", help="draft model for --method draft")
    sp.add_argument("--num-speculative-tokens", type=int, default=5, help="k (default: 5)")
    sp.add_argument("--scenarios", default="a,b,c", help="comma-separated subset of a,b,c (default: all)")
    sp.add_argument("--copy-prompts", type=int, default=6, help="requests in scenario a (default: 6)")
    sp.add_argument("--copy-tokens", type=int, default=192, help="max tokens in scenarios a and c (default: 192)")
    sp.add_argument("--num-prompts", type=int, default=64, help="requests in scenario b (default: 64)")
    sp.add_argument("--no-hf", action="store_true", help="skip the Hugging Face rows of scenario a")
    sp.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    sp.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    sp.set_defaults(handler=run_spec)

    pk = benches.add_parser(
        "peak", help="the model's GEMM shapes timed on this machine, and the tok/s limit they set",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Times F.linear at the model's own shapes (fused QKV, O, fused gate/up, down, LM head) at "
                    "16, 64 and 256 rows, and a square 2048 matmul, in each dtype. The limit is the most tokens "
                    "per second a decode step of these matmuls alone reaches: no engine gets there (attention, "
                    "norms and sampling come on top). `bench throughput` prints each system's share of it.")
    pk.add_argument("--model", default="smollm2-135m", help="model name or directory (default: smollm2-135m)")
    pk.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma-separated (default: float32,bfloat16; bfloat16 is skipped on a CPU without "
                         "avx512_bf16 or AMX, where torch emulates it)")
    pk.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    pk.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    pk.set_defaults(handler=run_peak)

    cap = benches.add_parser(
        "capacity", help="requests that fit in a KV budget: contiguous reservation vs paged blocks",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fill a KV budget with requests at their full length, through the engine's block pool: once "
                    "reserving the whole context per request (contiguous), once in blocks (paged). Requests cycle "
                    "through --requests sampled lengths: a fixed prompt plus a Pareto-distributed output.\n"
                    "Default: Llama-3-8B in bf16 (131,072 bytes of KV per token), 70 GiB of KV (an 80 GiB card).")
    cap.add_argument("--requests", type=int, default=100, help="sampled request lengths (default: 100)")
    cap.add_argument("--mean-output", type=float, default=150, help="mean output length (default: 150)")
    cap.add_argument("--max-output", type=int, default=4096, help="output length cap (default: 4096)")
    cap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default: 128)")
    cap.add_argument("--context", type=int, default=4096, help="max context per request (default: 4096)")
    cap.add_argument("--block-size", type=int, default=16, help="paged block size in tokens (default: 16)")
    cap.add_argument("--kv-gib", type=float, default=70.0, help="KV budget in GiB (default: 70)")
    cap.add_argument("--kv-bytes", type=int, help="KV budget in bytes (overrides --kv-gib)")
    cap.add_argument("--model-shape", default="llama-3-8b",
                     help="model whose KV bytes per token set the scale (llama-3-8b, llama-3-70b, smollm2-135m)")
    cap.add_argument("--bytes-per-token", type=int, help="KV bytes per token (overrides --model-shape)")
    cap.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    cap.set_defaults(handler=run_capacity)

    lt = benches.add_parser(
        "latency", help="time to first token and inter-token latency at batch 1, with percentiles",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Requests run one at a time (batch 1), each timed at every engine step: time to first token, "
                    "inter-token latency (gaps between the steps that gave tokens), time per output token and end "
                    "to end, as mean/p50/p90/p99. Prompts are random token ids of --prompt-tokens, distinct per "
                    "request; outputs are forced to --output-tokens (EOS ignored).")
    lt.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens (default: 128)")
    lt.add_argument("--output-tokens", type=int, default=128, help="generated tokens per request (default: 128)")
    lt.add_argument("--requests", type=int, default=10, help="timed requests (default: 10)")
    lt.add_argument("--warmup", type=int, default=1, help="untimed requests first (default: 1)")
    lt.add_argument("--seed", type=int, default=0, help="prompt sampling seed (default: 0)")
    lt.add_argument("--json", metavar="FILE", help="also write the summary and every request's timings as JSON")
    add_engine_options(lt)
    lt.set_defaults(handler=run_latency)

    em = benches.add_parser(
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
    em.add_argument("--model", default="all-minilm-l6-v2", help="embedding model (default: all-minilm-l6-v2)")
    em.add_argument("--num-sentences", type=int, default=10_000, help="sentences embedded (default: 10000)")
    em.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma-separated (default: float32,bfloat16; bfloat16 is skipped on a CPU without "
                         "avx512_bf16 or AMX, where every system emulates it at a sixth of float32's speed)")
    em.add_argument("--threads", type=int, default=2, help="torch CPU threads for every system (default: 2)")
    em.add_argument("--batch-tokens", type=int, default=2048,
                    help="tokenmill's token budget of one packed batch (default: 2048)")
    em.add_argument("--vllm-venv", help="vLLM's virtualenv (default: $TOKENMILL_VLLM_VENV or .vllm-venv)")
    em.add_argument("--no-matmul-high", action="store_true",
                    help="skip the second tokenmill float32 row, run with --float32-matmul-precision high (float32 "
                         "GEMMs as three bfloat16 products on AMX tiles; only on CPUs with AMX)")
    em.add_argument("--seed", type=int, default=20260201, help="sentence generator seed (default: 20260201)")
    em.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    em.set_defaults(handler=run_embed)

    jb = benches.add_parser(
        "jobs", help="a job cut into small shards against the same rows as one shard (tokenmill run's path)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The mixed chat workload (as `bench throughput`: distinct chat prompts, each forced to a fixed "
                    "output length in [min, max], EOS ignored, greedy) as OpenAI Batch JSONL rows, run as a job "
                    "of one shard and as a job of --shard-size shards through the local job runner on one engine "
                    "(SQLite and a local folder in a temporary directory). Prints completion tok/s of both, the "
                    "ratio (target: at least 90%) and whether the outputs are identical.")
    jb.add_argument("--num-rows", type=int, default=64, help="rows in the job (default: 64)")
    jb.add_argument("--shard-size", type=int, default=16, help="rows per shard of the sharded run (default: 16)")
    jb.add_argument("--min-tokens", type=int, default=16, help="shortest forced output (default: 16)")
    jb.add_argument("--max-tokens", type=int, default=192, help="longest forced output (default: 192)")
    add_engine_options(jb)
    jb.set_defaults(handler=run_jobs)


def run_embed(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    import torch
    from rich.console import Console

    from engine.model_loader import resolve_model
    from tokenmill.bench import embed
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


def native_dtypes(dtypes: list[str], console) -> list[str]:
    """The dtypes this CPU runs natively; a line for each one skipped (bfloat16 without avx512_bf16 or AMX)."""
    from tokenmill.bench import peak

    for dtype in [d for d in dtypes if not peak.native(d)]:
        console.print(f"{dtype} skipped: this CPU has no native {dtype} (avx512_bf16 or AMX)")
    return [d for d in dtypes if peak.native(d)]


def add_against_options(parser: argparse.ArgumentParser, batch1: bool = True) -> None:
    parser.add_argument("--against", default="", metavar="SYSTEMS",
                        help="external engines to run on the same token ids and output lengths: vllm (its CPU "
                             "build, from its own virtualenv, in a subprocess; build it with `make vllm-venv`)")
    parser.add_argument("--vllm-venv", help="vLLM's virtualenv (default: $TOKENMILL_VLLM_VENV or .vllm-venv)")
    if not batch1:
        return
    parser.add_argument("--batch1-tokens", type=int, default=128,
                        help="output tokens of the batch-1 time-per-output-token measurement (default: 128; "
                             "0 skips it)")


def against_vllm(args: argparse.Namespace, console):
    """vLLM's interpreter when `--against vllm` asked for it and it is installed; else None, saying why."""
    from tokenmill.bench import vllm_compare

    wanted = {s.strip() for s in args.against.split(",") if s.strip()}
    if wanted - {"vllm"}:
        raise ValueError(f"unknown --against system(s) {sorted(wanted - {'vllm'})}; choose from vllm")
    if "vllm" not in wanted:
        return None
    python = vllm_compare.vllm_python(args.vllm_venv)
    if python is None:
        console.print(f"[yellow]{vllm_compare.INSTALL_HINT}; running the other systems[/yellow]")
    return python


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
    import json
    import logging

    import torch
    from rich.console import Console
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model
    from tokenmill.bench import peak, vllm_compare
    from tokenmill.bench import throughput as tp
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
    batches = [] if args.no_plots else sweep_batches(args)
    torch.set_num_threads(args.threads)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    console = Console(width=max(Console().width, 175))
    console.print(f"machine: {vllm_compare.cpu_description()}")
    vllm = against_vllm(args, console)
    model_dir = resolve_model(args.model)
    workload = mixed_chat_workload(AutoTokenizer.from_pretrained(model_dir), args.num_prompts, args.min_tokens,
                                   args.max_tokens)
    console.print(f"workload: {len(workload.prompts)} chat prompts ({workload.prompt_tokens} prompt tokens), "
                  f"{workload.useful_tokens} forced output tokens ({args.min_tokens}-{args.max_tokens} each), "
                  f"{args.threads} threads")
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
    console.print(throughput_table(results, limits))
    if batch1:
        console.print(batch1_table(batch1, args.batch1_tokens))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**r.__dict__, "tokens_per_second": r.tokens_per_second} for r in results], f, indent=2)
    if batches:
        write_throughput_plots(args, model_dir, dtypes, batches, latencies, console)
    return 0


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
    peaks = [peak.measure(model_dir, dtype) for dtype in native_dtypes(dtypes, console)]
    console.print(peak.peak_table(peaks))
    console.print(peak.limit_table(peaks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**p.__dict__, "limit": p.limit} for p in peaks], f, indent=2)
    return 0


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


def run_latency(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from engine import EngineConfig, LLMEngine
    from tokenmill.bench import latency

    if args.output_tokens < 2 or args.prompt_tokens < 1 or args.requests < 1:
        raise ValueError("--output-tokens must be at least 2, --prompt-tokens and --requests at least 1")
    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args)))
    console = Console(width=max(Console().width, 120))
    console.print(f"batch 1: {args.requests} requests of {args.prompt_tokens} prompt + {args.output_tokens} output "
                  f"tokens ({args.warmup} warm-up), {engine.config.dtype}, {args.threads or 'default'} threads")
    timings = latency.measure(engine, args.prompt_tokens, args.output_tokens, args.requests, args.warmup, args.seed)
    console.print(latency_table(latency.summarize(timings)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(latency.to_json(timings), f, indent=2)
    return 0


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


def run_spec(args: argparse.Namespace) -> int:
    import json

    import torch
    from rich.console import Console
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model
    from tokenmill.bench import spec
    from tokenmill.bench.workload import copy_workload, long_tail_workload, mixed_chat_workload

    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 150))
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.draft_model:
        config["model"] = args.draft_model
    scenarios = {s.strip() for s in args.scenarios.split(",")}
    results: list[spec.SpecResult] = []

    def compare(scenario: str, workload, one_at_a_time: bool, ignore_eos: bool) -> None:
        plain, plain_tokens = spec.tokenmill_spec(str(model_dir), workload, scenario, "tokenmill, no speculation",
                                                  None, one_at_a_time, ignore_eos, num_threads=args.threads)
        sped, sped_tokens = spec.tokenmill_spec(str(model_dir), workload, scenario, f"tokenmill, {args.method}",
                                                config, one_at_a_time, ignore_eos, num_threads=args.threads)
        same = sum(a == b for a, b in zip(plain_tokens, sped_tokens, strict=True))
        console.print(f"scenario {scenario}: {same}/{len(plain_tokens)} outputs identical with and without speculation")
        results.extend([plain, sped])

    if "a" in scenarios:
        copies = copy_workload(tokenizer, args.copy_prompts, args.copy_tokens)
        compare("a", copies, one_at_a_time=True, ignore_eos=False)
        if not args.no_hf:
            results.append(spec.hf_one_at_a_time(model_dir, copies, "a", None))
            results.append(spec.hf_one_at_a_time(model_dir, copies, "a", 10))
    if "b" in scenarios:
        compare("b", mixed_chat_workload(tokenizer, args.num_prompts), one_at_a_time=False, ignore_eos=True)
    if "c" in scenarios:
        compare("c", long_tail_workload(tokenizer, long_len=args.copy_tokens), one_at_a_time=False, ignore_eos=False)
    console.print(spec_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**r.__dict__, "tokens_per_second": r.tokens_per_second} for r in results], f, indent=2)
    return 0


def run_capacity(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

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
    table = Table("allocation", "requests at once", "KV used (tokens)", "KV reserved (tokens)", "wasted KV",
                  "waste per request (tokens)", title="capacity")
    for row in (contiguous, paged):
        share = row.wasted_tokens / row.reserved_tokens if row.reserved_tokens else 0.0
        table.add_row(row.scheme, f"{row.requests:,}", f"{row.used_tokens:,}", f"{row.reserved_tokens:,}",
                      f"{row.wasted_tokens:,} ({100 * share:.0f}%)", f"{row.waste_per_request:.1f}")
    console.print(table)
    console.print(f"paged fits {paged.requests / max(contiguous.requests, 1):.1f}x the requests; its waste per request "
                  f"is {paged.waste_per_request:.1f} tokens, under one {args.block_size}-token block")
    return 0


def run_jobs(args: argparse.Namespace) -> int:
    import logging

    from rich.console import Console
    from rich.table import Table

    from engine import EngineConfig, LLMEngine
    from tokenmill.bench import jobs, vllm_compare

    if args.num_rows < 1 or not 1 <= args.shard_size <= args.num_rows:
        raise ValueError("--num-rows must be at least 1 and --shard-size between 1 and --num-rows")
    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args)))
    for name in ("tokenmill.jobs", "alembic"):  # a line per shard and per migration would bury the table
        logging.getLogger(name).setLevel(logging.WARNING)
    console = Console(width=max(Console().width, 120))
    console.print(f"machine: {vllm_compare.cpu_description()}")
    dtype = str(engine.runner.dtype).removeprefix("torch.")
    console.print(f"{args.num_rows} chat rows, outputs of {args.min_tokens}-{args.max_tokens} tokens (EOS ignored), "
                  f"greedy, {dtype}, {args.threads or 'default'} threads, max_num_seqs {engine.config.max_num_seqs}")
    whole, sharded = jobs.compare(engine, args.num_rows, args.shard_size, args.min_tokens, args.max_tokens)
    table = Table("run", "shards", "seconds", "completion tokens", "completion tok/s", title="bench jobs")
    for run in (whole, sharded):
        table.add_row(run.label, str(run.shards), f"{run.seconds:.1f}", f"{run.completion_tokens:,}",
                      f"{run.tokens_per_second:.1f}")
    console.print(table)
    ratio = sharded.tokens_per_second / whole.tokens_per_second
    identical = whole.outputs == sharded.outputs
    console.print(f"shards of {args.shard_size}: {100 * ratio:.0f}% of one shard's completion tok/s (target >= 90%); "
                  f"outputs {'identical' if identical else 'DIFFER'}")
    return 0 if identical else 1


def spec_table(results):
    from rich.table import Table

    table = Table("scenario", "system", "seconds", "tokens", "tok/s", "acceptance", "speedup",
                  title="speculative decoding (speedup: against the same system without speculation)")
    baselines = {}
    for r in results:
        if "no speculation" in r.system or r.system == "HF greedy":
            baselines[(r.scenario, r.system.split(",")[0].split(" ")[0])] = r
    for r in results:
        base = baselines.get((r.scenario, r.system.split(",")[0].split(" ")[0]))
        acceptance = "-" if r.acceptance is None else f"{100 * r.acceptance:.0f}%"
        table.add_row(r.scenario, r.system, f"{r.seconds:.1f}", str(r.tokens), f"{r.tokens_per_second:.1f}",
                      acceptance, speedup(r, base))
    return table


def prefix_table(results, title: str, baseline_system: str):
    from rich.table import Table

    by_system = {r.system: r for r in results}
    names = [baseline_system, "HF static batching", "HF continuous batching", "vLLM, prefix caching on"]
    headers = ["x baseline", "x HF static", "x HF continuous", "x vLLM"][:4 if names[3] in by_system else 3]
    table = Table("system", "prefill tokens computed", "preemptions", "seconds", "useful tok/s", *headers,
                  title=f"{title} (baseline: {baseline_system})")
    for r in results:
        fmt = lambda value: "-" if value is None else f"{value:,}"
        references = [by_system.get(name) for name in names[:len(headers)]]
        table.add_row(r.system, fmt(r.prefill_tokens), fmt(r.preemptions), f"{r.seconds:.1f}",
                      f"{r.tokens_per_second:.1f}", *(speedup(r, ref) for ref in references))
    return table


def concurrency_table(sweeps):
    from rich.table import Table

    table = Table("dtype", "batch", "tokenmill decode tok/s", "dense matmuls alone tok/s", "compute roof tok/s",
                  "memory roof tok/s", "% of roofline", title="decode throughput against concurrency")
    for dtype, points in sweeps.items():
        for p in points:
            table.add_row(dtype, str(p.batch), f"{p.decode_tokens_per_s:.1f}", f"{p.matmul_tokens_per_s:.1f}",
                          f"{p.compute_roof:.0f}", f"{p.memory_roof:.0f}",
                          f"{100 * p.decode_tokens_per_s / p.roof:.0f}%")
    return table


def latency_table(summary):
    from rich.table import Table

    table = Table("metric", "mean ms", "p50 ms", "p90 ms", "p99 ms", title="latency at batch 1")
    for name, p in summary.items():
        table.add_row(name, *(f"{1000 * value:.1f}" for value in (p.mean, p.p50, p.p90, p.p99)))
    return table
