"""`tokenmill bench spec`: its arguments and its run."""

from __future__ import annotations

import argparse

from tokenmill.bench.tables import spec_table


def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "spec", help="speculative decoding: copying at batch 1, the mixed batch, a long-tail job",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Three scenarios, in one run, greedy:\n"
                    "a. one request at a time, answers that copy their prompt: tokenmill without and with "
                    "speculation, and Hugging Face greedy vs its prompt-lookup decoding;\n"
                    "b. the 64-request mixed chat workload of `bench throughput`: none vs adaptive speculation;\n"
                    "c. a job whose tail runs with few requests (many short answers, a few long copying ones);\n"
                    "s. one request at a time, ShareGPT prompts held out of `tokenmill spec train-head`'s training "
                    "(for --method medusa; not in the default set).")
    parser.add_argument("--model", default="smollm2-135m", help="model name or directory (default: smollm2-135m)")
    parser.add_argument("--method", default="ngram", choices=("ngram", "self", "draft", "medusa"),
                        help="proposer (default: ngram)")
    parser.add_argument("--draft-model", help="draft model for --method draft; head directory for --method medusa "
                                              "(default: the head `tokenmill spec train-head` cached for --model)")
    parser.add_argument("--heldout-prompts", type=int, default=8,
                        help="requests in scenario s (at most 16, default: 8)")
    parser.add_argument("--num-speculative-tokens", type=int, help="k (default: 5; medusa: 4, the trained heads)")
    parser.add_argument("--scenarios", default="a,b,c", help="comma-separated subset of a,b,c,s (default: a,b,c)")
    parser.add_argument("--copy-prompts", type=int, default=6, help="requests in scenario a (default: 6)")
    parser.add_argument("--copy-tokens", type=int, default=192, help="max tokens in scenarios a and c (default: 192)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests in scenario b (default: 64)")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face rows of scenario a")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="the model's dtype (default: auto, bfloat16 where the CPU has it natively; the trained "
                             "head's target is measured in float32)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="verify 1 + k rows summing as one decoded row does, so that greedy tokens stay "
                             "identical to plain decoding whatever the CPU's rounding (default: off, as LLM())")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.set_defaults(handler=run_spec)


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
    k = args.num_speculative_tokens or (4 if args.method == "medusa" else 5)
    config = {"method": args.method, "num_speculative_tokens": k}
    if args.draft_model:
        config["model"] = args.draft_model
    elif args.method == "medusa":
        from tokenmill.spec_head import head_dir_for

        config["model"] = str(head_dir_for(model_dir))
    scenarios = {s.strip() for s in args.scenarios.split(",")}
    engine_kwargs = {"num_threads": args.threads, "dtype": args.dtype, "batch_invariant": args.batch_invariant}
    results: list[spec.SpecResult] = []

    def compare(scenario: str, workload, one_at_a_time: bool, ignore_eos: bool) -> None:
        plain, plain_tokens = spec.tokenmill_spec(str(model_dir), workload, scenario, "tokenmill, no speculation",
                                                  None, one_at_a_time, ignore_eos, **engine_kwargs)
        sped, sped_tokens = spec.tokenmill_spec(str(model_dir), workload, scenario, f"tokenmill, {args.method}",
                                                config, one_at_a_time, ignore_eos, **engine_kwargs)
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
    if "s" in scenarios:
        from tokenmill.bench.sharegpt import sharegpt_workload
        from tokenmill.spec_head import HELD_OUT

        held_out = sharegpt_workload(tokenizer, min(args.heldout_prompts, HELD_OUT), seed=0)
        held_out.output_lens = [min(n, args.copy_tokens) for n in held_out.output_lens]
        compare("s", held_out, one_at_a_time=True, ignore_eos=False)
    if "c" in scenarios:
        compare("c", long_tail_workload(tokenizer, long_len=args.copy_tokens), one_at_a_time=False, ignore_eos=False)
    console.print(spec_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**r.__dict__, "tokens_per_second": r.tokens_per_second} for r in results], f, indent=2)
    return 0
