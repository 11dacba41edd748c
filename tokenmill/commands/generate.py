"""`tokenmill generate`: run prompts through the engine in process and print completions."""

from __future__ import annotations

import argparse
from importlib import resources

from tokenmill.options import add_engine_options, add_sampling_options, engine_kwargs, sampling_kwargs


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "generate", help="complete prompts in process and print them with throughput",
        description="Generate completions for prompts given on the command line, in a file (one per line), "
                    "or, with neither, for the bundled sample of 40 chat prompts. Prompts are rendered with the "
                    "model's chat template unless --raw is given.")
    parser.add_argument("prompts", nargs="*", help="prompts (default: the bundled sample)")
    parser.add_argument("--file", help="read prompts from this file, one per line")
    parser.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    parser.add_argument("--cache-salt", metavar="TEXT",
                        help="share prefix-cache blocks only with requests of this salt (default: none)")
    add_sampling_options(parser, max_tokens=64, temperature=0.0)
    add_engine_options(parser)
    parser.set_defaults(handler=run)


def sample_prompts() -> list[str]:
    text = resources.files("tokenmill").joinpath("data/sample_prompts.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def run(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console

    from engine import LLM
    from ingest.sampling import sampling_params

    if args.file:
        with open(args.file) as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    else:
        prompts = args.prompts or sample_prompts()
    console = Console()
    llm = LLM(**engine_kwargs(args))
    params = sampling_params(sampling_kwargs(args), {})
    started = time.perf_counter()
    if args.raw:
        outputs = llm.generate(prompts, params, use_tqdm=True, cache_salt=args.cache_salt)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - started
    for prompt, out in zip(prompts, outputs, strict=True):
        console.rule(style="dim")
        console.print(f"[bold]{prompt}[/bold]", highlight=False)
        if out.error:
            console.print(f"[red]error: {out.error}[/red]")
        else:
            console.print(out.outputs[0].text, highlight=False, markup=False)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    console.rule(style="dim")
    console.print(f"{len(outputs)} requests, {prompt_tokens} prompt + {generated} generated tokens in {elapsed:.1f} s: "
                  f"[bold]{generated / elapsed:.1f} generated tok/s[/bold]")
    return 0
