"""`tokenmill run | jobs | status | cancel | db`: batch jobs in process, with their state in SQL."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.options import (
    DATABASE_HELP,
    add_engine_options,
    add_lora_modules_option,
    add_sampling_options,
    add_served_model_name_option,
    add_task_options,
    engine_settings,
    lora_modules,
    running_stack_env,
    sample_input,
    sampling_kwargs,
    stack_dir_option,
)

if TYPE_CHECKING:
    from engine.settings import EngineSettings

STACK_DATABASE_HELP = ("SQLAlchemy database URL (default: $TOKENMILL_DATABASE_URL, else the database of the stack "
                       "running from --state-dir, else SQLite at $TOKENMILL_DATA/tokenmill.db)")
RUN_DESCRIPTION = """\
Run a batch job in this process: validate the input, split it into shards of rows, generate a completion
for every row and write the results under --output as part-NNNNN.parquet files, errors.jsonl and, last,
manifest.json. The job's state is kept in the database, so running the same command again (same input,
same output) resumes the job where it stopped and never repeats a finished shard.

INPUT is a Parquet file (custom_id plus prompt or messages, optional per-row max_tokens, temperature,
top_p, top_k, seed, stop, logprobs, top_logprobs, response_format as JSON text) or an OpenAI Batch JSONL
file, as a path, file:// or s3:// URI. Without INPUT the bundled sample of 40 chat prompts runs.

Constrained JSON for every row (each output parses and validates against the schema):
  tokenmill run reviews.parquet --json-schema label.json --openai-output

LoRA adapters: rows pick one by their `model` (the base model's rows name it, or nothing):
  tokenmill run rows.jsonl --lora-modules sql=./sql-lora chat=s3://adapters/chat --openai-output

Embeddings: with an embedding model, a Parquet input's `text` column (--task embed) or OpenAI JSONL rows with
url /v1/embeddings become part files of custom_id, embedding (float32 vectors) and prompt_tokens:
  tokenmill run sentences.parquet --task embed --model all-minilm-l6-v2 --openai-output"""


def job_batch_invariant(engine_setting: bool | str) -> bool | None:
    """The job's own setting from the engine's: "auto" leaves it to the engine (None)."""
    return None if engine_setting == "auto" else engine_setting


def register(commands: argparse._SubParsersAction) -> None:
    _register_run(commands)
    _register_jobs(commands)
    _register_status(commands)
    _register_cancel(commands)
    _register_db(commands)


def _friendly(handler):
    """Known operational errors print as one line (exit 2) instead of a traceback."""
    def wrapper(args: argparse.Namespace) -> int:
        import logging
        import sys

        if not logging.getLogger().isEnabledFor(logging.DEBUG):  # alembic logs at INFO, even on import
            logging.getLogger("alembic").setLevel(logging.WARNING)
        from ingest.job_request import JobRequestError
        from storage.migrate import SchemaOutOfDate
        from storage.repository import JobNotFound
        from workers.inprocess import JobBusy

        try:
            return handler(args)
        except JobNotFound as error:
            print(f"error: {error} in {_database(args)}", file=sys.stderr)
            return 2
        except (JobBusy, SchemaOutOfDate, JobRequestError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2

    return wrapper


def _add_database_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", metavar="URL", help=DATABASE_HELP)


def _add_stack_database_options(parser: argparse.ArgumentParser) -> None:
    """For commands on existing jobs: like the service's commands, they find a running stack's database."""
    parser.add_argument("--database-url", metavar="URL", help=STACK_DATABASE_HELP)
    stack_dir_option(parser)


def _url(args: argparse.Namespace) -> str:
    """The database a command on existing jobs reads: --database-url, $TOKENMILL_DATABASE_URL, the running
    stack's (from its state directory), else the embedded SQLite file."""
    from storage import db

    if given := getattr(args, "database_url", None) or os.environ.get(db.DATABASE_URL_ENV):
        return given
    return running_stack_env(args).get(db.DATABASE_URL_ENV) or db.resolve_url()  # the process env untouched


def _database(args: argparse.Namespace) -> str:
    from storage import db

    return f"database {db.describe(_url(args))}"


def _register_run(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("run", help="run a batch job in process (resumes it when run again)",
                                 description=RUN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", nargs="?", metavar="INPUT", help="input file or URI (default: the bundled sample)")
    parser.add_argument("--output", "-o", metavar="DIR_OR_S3_URI",
                        help="where results go (default: ./tokenmill-output/<input name>)")
    parser.add_argument("--shard-size", type=int, default=None, metavar="ROWS",
                        help="rows per shard, the unit of progress and of resuming; every unfinished shard's rows "
                             "feed one engine stream, so small shards keep the batch full (default: 500)")
    parser.add_argument("--openai-output", action="store_true",
                        help="also write batch_output.jsonl in the OpenAI Batch output format")
    add_task_options(parser)
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve engine and job metrics for Prometheus at http://127.0.0.1:PORT/metrics")
    _add_database_option(parser)
    limits = parser.add_argument_group("input limits (checked against the Parquet footer before reading)")
    limits.add_argument("--max-input-rows", type=int, metavar="N", help="most rows a job may have (default: 1000000)")
    limits.add_argument("--max-input-bytes", type=int, metavar="BYTES",
                        help="largest uncompressed Parquet data or JSONL file (default: 8 GiB)")
    s3 = parser.add_argument_group("S3 (default: the standard AWS settings: AWS_ENDPOINT_URL, AWS_REGION, "
                                   "AWS_ACCESS_KEY_ID, ~/.aws/...)")
    s3.add_argument("--s3-endpoint-url", metavar="URL", help="S3-compatible endpoint, e.g. http://127.0.0.1:8333")
    s3.add_argument("--s3-region", metavar="REGION", help="S3 region")
    s3.add_argument("--s3-profile", metavar="NAME", help="AWS profile whose credentials to use")
    add_sampling_options(parser, max_tokens=64)
    add_engine_options(parser, lora="adapters")
    add_served_model_name_option(parser)
    add_lora_modules_option(parser, "LoRA adapters rows may name as their `model` (an OpenAI row's body, a Parquet "
                                    "`model` column): NAME=DIR_OR_URI, a PEFT directory or an s3:// prefix (fetched "
                                    "once into $TOKENMILL_DATA/lora-cache); several, or the option repeated (vLLM's "
                                    "syntax; also {\"name\": ..., \"path\": ...}). Turns --enable-lora on; a row "
                                    "naming an adapter that cannot be served fails with invalid_adapter (docs/lora.md)")
    _note_model_given(parser)
    parser.set_defaults(handler=_friendly(run))


class _StoreModel(argparse._StoreAction):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.model_given = True


def _note_model_given(parser: argparse.ArgumentParser) -> None:
    """`args.model_given`: whether --model was on the command line (else an input's rows may choose it)."""
    for action in parser._actions:
        if action.dest == "model":
            action.__class__ = _StoreModel
    parser.set_defaults(model_given=False)


def _register_jobs(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("jobs", help="list jobs, newest first",
                                 description="List jobs with their status, progress and tokens, newest first.")
    parser.add_argument("--status", help="only jobs with this status (e.g. in_progress, failed)")
    parser.add_argument("--limit", type=int, default=50, help="how many jobs to show (default: 50)")
    _add_stack_database_options(parser)
    parser.set_defaults(handler=_friendly(list_jobs))


def _register_status(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("status", help="show one job and its shards",
                                 description="Show a job's state, counts, tokens and timings, and its shards.")
    parser.add_argument("job", metavar="JOB", help="job id (a unique prefix is enough)")
    parser.add_argument("--json", action="store_true", help="print the job row and its shards as JSON")
    _add_stack_database_options(parser)
    parser.set_defaults(handler=_friendly(show_status))


def _register_cancel(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("cancel", help="cancel a job (finished shards are kept)",
                                 description="Cancel a job. A running `tokenmill run` notices within a second, "
                                             "stops at its next engine step and ends the job `cancelled`, keeping "
                                             "the shards it finished; running the same command again resumes it.")
    parser.add_argument("job", metavar="JOB", help="job id (a unique prefix is enough)")
    _add_stack_database_options(parser)
    parser.set_defaults(handler=_friendly(cancel))


def _register_db(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("db", help="create or migrate the job database",
                                 description="Alembic migrations of the job database (SQLite or PostgreSQL). "
                                             "`tokenmill run` upgrades the embedded SQLite database by itself.")
    actions = parser.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    upgrade = actions.add_parser("upgrade", help="migrate to the latest schema (or to REVISION)")
    upgrade.add_argument("revision", nargs="?", default="head", help="target revision (default: head)")
    downgrade = actions.add_parser("downgrade", help="migrate back to REVISION ('base' drops everything)")
    downgrade.add_argument("revision", help="target revision, e.g. -1 or base")
    current = actions.add_parser("current", help="show the database's revision")
    for action, handler in ((upgrade, db_upgrade), (downgrade, db_downgrade), (current, db_current)):
        _add_stack_database_options(action)
        action.set_defaults(handler=_friendly(handler))


# ---- handlers --------------------------------------------------------------------------------------

def default_output(input_uri: str | None) -> str:
    name = Path(input_uri.rstrip("/")).stem if input_uri else "sample"
    return str(Path("tokenmill-output") / name)


def _sessions(url: str):
    from storage import db, migrate

    migrate.ensure_schema(url)
    return db.session_factory(db.make_engine(url))


def _limits(args: argparse.Namespace):
    from storage.formats import Limits

    return Limits.from_env(max_rows=args.max_input_rows, max_uncompressed_bytes=args.max_input_bytes,
                           max_file_bytes=args.max_input_bytes)


def _new_job(args: argparse.Namespace):
    from ingest.job_request import validate_request
    from storage.job_settings import DEFAULT_SHARD_SIZE, LOCAL
    from storage.objectstore import S3Options

    limits = _limits(args)

    engine = engine_settings(args).to_json()  # a job's settings are stored: no KV secret (load_engine adds it)
    request = validate_request(dict(input_uri=args.input or sample_input(),
                                    output_uri=args.output or default_output(args.input), model=args.model,
                                    sampling=sampling_kwargs(args), engine=engine,
                                    speculative_config=engine.get("speculative_config"),
                                    batch_invariant=job_batch_invariant(engine["batch_invariant"]),
                                    shard_size=args.shard_size or DEFAULT_SHARD_SIZE,
                                    openai_output=args.openai_output,
                                    served_model_names=args.served_model_name, lora_modules=lora_modules(args),
                                    task=args.task,
                                    truncate_inputs=args.truncate_inputs))
    return request.to_job(executor=LOCAL, limits=limits,
                          s3=S3Options(args.s3_endpoint_url, args.s3_region, args.s3_profile))


def _load_engine(settings: EngineSettings):
    from workers.worker_engine import load_engine

    return load_engine(settings)


def _serving_metrics(port: int, sessions):
    """An engine loader that also serves the engine's and the jobs' metrics (the loader runs once per job)."""
    from engine.prometheus import new_registry, start_metrics_server
    from storage import db
    from workers.job_metrics import JobMetricsCollector
    from workers.worker_engine import load_engine

    registry = new_registry()
    registry.register(JobMetricsCollector(db.sql_query(sessions)))
    start_metrics_server(registry, port)
    def load(settings: EngineSettings):
        return load_engine(settings, registry)  # an embedding engine: job metrics only

    return load


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ingest.intake import submit
    from storage import db
    from tokenmill.progress import JobProgressBar
    from workers.inprocess import run_job

    console = Console(soft_wrap=True)
    url = db.resolve_url(args.database_url)
    sessions = _sessions(url)
    validated = _choose_model(args)
    try:
        submission = submit(sessions, _new_job(args))
    except BaseException:
        if validated is not None:
            validated.close()
        raise
    job = submission.job
    console.print(f"job [bold]{job.id}[/bold] ({submission.outcome}): {_where(job.input_uri)} -> "
                  f"{_where(job.output_uri)}", highlight=False)
    load_engine = _load_engine if args.metrics_port is None else _serving_metrics(args.metrics_port, sessions)
    try:
        with JobProgressBar(Console(stderr=True)) as progress:  # the run closes its engine service when it ends
            job = run_job(sessions, job.id, load_engine, progress, validated)
    finally:
        if validated is not None:
            validated.close()
    _print_summary(console, job, url if args.database_url else None)
    return 0 if job.status == "completed" else 1


def _choose_model(args: argparse.Namespace):
    """For an OpenAI JSONL input: rows that all name one bundled model run it when --model was not given; rows
    that all name models this run does not serve are refused here, before a model loads, naming them (rows of
    a mixed file that name another model fail alone with model_not_found). The file is validated in the same
    read, which the job's validating step takes over (`workers.job_steps.ValidatedInput`; None: not read)."""
    from engine.model_loader import BUNDLED_MODELS
    from ingest.job_request import JobRequestError
    from ingest.row_checks import choose_model
    from storage.formats import JSONL_SUFFIXES
    from storage.formats.jsonl import models_named
    from storage.objectstore import S3Options, normalize_uri, open_file_store
    from workers.job_steps import read_input

    if not args.input:
        return None
    uri, s3 = normalize_uri(args.input), S3Options(args.s3_endpoint_url, args.s3_region, args.s3_profile)
    try:
        store, key = open_file_store(uri, s3)
        if not key.endswith(JSONL_SUFFIXES):
            with store.open(key) as source:
                if source.read(1) != b"{":
                    return None
        validated = read_input(uri, s3, _limits(args), args.task)
    except (OSError, ValueError):  # not there, not readable: the job's validation says so
        return None
    reader = validated.reader
    if reader is None or reader.format != "jsonl":
        validated.close()
        return None
    named = reader.models
    if named is None:  # not valid (the job fails validating with why): its models, in a read of their own
        try:
            with store.open(key) as source:
                named = models_named(source)
        except (OSError, ValueError):
            return validated
    aliases = {*(args.served_model_name or []), *lora_modules(args)}
    args.model, refused = choose_model(named, args.model, args.model_given, aliases, BUNDLED_MODELS, args.input)
    if refused:
        validated.close()
        raise JobRequestError(refused)
    return validated


def database_option(url: str | None) -> str:
    """` --database-url URL` for a hint when the command was given one (a password stays hidden: `***`)."""
    import shlex

    from sqlalchemy.engine import make_url

    if url is None:
        return ""
    return f" --database-url {shlex.quote(make_url(url).render_as_string(hide_password=True))}"


def _print_summary(console, job, given_url: str | None) -> None:
    from storage import db

    url = given_url or db.resolve_url()
    color = {"completed": "green", "failed": "red"}.get(job.status, "yellow")
    console.print(f"job {job.id} [bold {color}]{job.status}[/bold {color}]: {job.requests_total} rows, "
                  f"{job.requests_completed} completed, {job.requests_failed} failed; "
                  f"{job.prompt_tokens} prompt + {job.completion_tokens} generated tokens")
    if job.error:
        console.print(f"[red]error:[/red] {job.error}", highlight=False)
    console.print(f"outputs:  {_where(job.output_uri)}", highlight=False)
    console.print(f"database: {db.describe(url)}  (try: tokenmill status {job.id[:8]}{database_option(url)}, or "
                  f"SQL: SELECT * FROM job_status)", highlight=False)


def _where(uri: str, relative: bool = False) -> str:
    """A local path for file:// URIs (relative to the current folder when under it and asked), else the URI."""
    import os

    if not uri.startswith("file://"):
        return uri
    path = uri[len("file://"):]
    if relative and Path(path).is_relative_to(Path.cwd()):
        return os.path.relpath(path)
    return path


def list_jobs(args: argparse.Namespace) -> int:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from storage import db
    from storage import repository as repo

    url = _url(args)
    sessions = _sessions(url)
    with sessions() as session:
        jobs = repo.list_jobs(session, limit=args.limit, status=args.status)
    table = Table(box=box.SIMPLE_HEAD, caption=f"database: {db.describe(url)}", caption_justify="left")
    for name in ("id", "status", "rows done", "failed", "tokens", "created"):
        table.add_column(name, no_wrap=True)
    table.add_column("output", overflow="fold", ratio=1)
    for job in jobs:
        table.add_row(job.id[:8], job.status, f"{job.requests_completed + job.requests_failed}/{job.requests_total}",
                      str(job.requests_failed), str(job.completion_tokens),
                      job.created_at.strftime("%m-%d %H:%M"), _where(job.output_uri, relative=True))
    Console().print(table if jobs else f"no jobs yet in {db.describe(url)}: start one with `tokenmill run`",
                    highlight=False)
    return 0


def _row_dict(row) -> dict:
    from datetime import datetime

    from pydantic import BaseModel
    from sqlalchemy import inspect

    def plain(value):
        if isinstance(value, datetime):
            return value.isoformat()
        return value.model_dump(mode="json") if isinstance(value, BaseModel) else value

    return {attr.key: plain(getattr(row, attr.key)) for attr in inspect(row).mapper.column_attrs}


def show_status(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from storage import db
    from storage import repository as repo

    url = _url(args)
    sessions = _sessions(url)
    with sessions() as session:
        job = repo.find_job(session, args.job)
        shards = repo.shards(session, job.id)
    if args.json:
        print(json.dumps({"job": _row_dict(job), "shards": [_row_dict(s) for s in shards]}, indent=2))
        return 0
    console = Console()
    details = Table(show_header=False, box=None)
    for key, value in _row_dict(job).items():
        if value not in (None, "", {}):
            details.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
    console.print(details)
    table = Table("shard", "rows", "status", "attempts", "ok", "failed", "tokens out", "finished")
    for s in shards:
        table.add_row(str(s.index), f"{s.row_start}-{s.row_end - 1}", s.status, str(s.attempts),
                      str(s.rows_completed), str(s.rows_failed), str(s.completion_tokens),
                      s.finished_at.strftime("%H:%M:%S") if s.finished_at else "")
    console.print(table)
    console.print(f"database: {db.describe(url)}", highlight=False)
    return 0


def cancel(args: argparse.Namespace) -> int:
    from ingest.config import ServiceConfig
    from storage import db
    from workers import events
    from workers.inprocess import cancel_job

    url = _url(args)  # a running stack's settings first, so its events are published
    sessions = _sessions(url)
    events.install(ServiceConfig.from_env(), sessions)  # a no-op outside the service
    job = cancel_job(sessions, args.job)
    note = "; the running process stops at its next step" if job.status == "cancelling" else ""
    print(f"job {job.id} {job.status}{note} (database: {db.describe(url)})")
    return 0


def db_upgrade(args: argparse.Namespace) -> int:
    from storage import db, migrate

    url = _url(args)
    migrate.upgrade(url, args.revision)
    print(f"{db.describe(url)}: at revision {migrate.current_revision(url)}")
    return 0


def db_downgrade(args: argparse.Namespace) -> int:
    from storage import db, migrate

    url = _url(args)
    migrate.downgrade(url, args.revision)
    print(f"{db.describe(url)}: at revision {migrate.current_revision(url) or 'base (empty)'}")
    return 0


def db_current(args: argparse.Namespace) -> int:
    from storage import db, migrate

    url = _url(args)
    current, head = migrate.current_revision(url), migrate.head_revision()
    state = "up to date" if current == head else f"head is {head}: run `tokenmill db upgrade`"
    print(f"{db.describe(url)}: at revision {current or 'base (empty)'} ({state})")
    return 0
