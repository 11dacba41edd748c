"""`tokenmill submit | schedule | stack | worker | consumer | watcher`: the distributed service.

Commands that talk to a running stack find it through the environment (`eval "$(tokenmill stack env)"`) or,
for anything the environment leaves unset, through the stack's state directory (default
`$TOKENMILL_DATA/stack`, i.e. ~/.local/share/tokenmill/stack).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from tokenmill.options import (
    add_engine_options,
    add_kv_sharing_options,
    add_lora_modules_option,
    add_sampling_options,
    add_task_options,
    default_state_dir,
    engine_settings,
    lora_modules,
    sample_input,
    sampling_kwargs,
    stack_dir_option,
    use_stack,
)

STACK_DESCRIPTION = """\
Start or stop the whole service on 127.0.0.1: Redis (Celery broker), tansu (Kafka), SeaweedFS (S3), the job
database (PostgreSQL), N Celery workers, beat, Flower, the Kafka consumer and the S3 watcher. `up` prints
each component's address; `down` stops every process it started and checks that the ports are free."""
SUBMIT_DESCRIPTION = """\
Send a job to the running service and print its id. --via kafka puts the job spec on the job topic;
--via s3 drops the input (and a NAME.job.json sidecar with the settings) into the S3 inbox. A local file is
uploaded to the service's bucket first. Follow the job with `tokenmill status JOB` or in SQL (job_status)."""

ENGINE_FACTORY_ENV = "TOKENMILL_ENGINE_FACTORY"  # --engine-factory's default (the stack's workers inherit it)
WORKER_ROLE_ENV = "TOKENMILL_WORKER_CHILD"  # set by `tokenmill worker` for each node it runs: engine, control


def register(commands: argparse._SubParsersAction) -> None:
    _register_submit(commands)
    _register_schedule(commands)
    _register_stack(commands)
    _register_worker(commands)
    _register_consumer(commands)
    _register_watcher(commands)


def _database_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", metavar="URL", help="job database (default: $TOKENMILL_DATABASE_URL, "
                                                              "else the running stack's)")


def _friendly(handler):
    """Operational errors (a stack that cannot start, a broker or S3 not reachable) print as one line, exit 2."""
    def wrapper(args: argparse.Namespace) -> int:
        import logging

        if not logging.getLogger().isEnabledFor(logging.DEBUG):  # both log every connection at INFO
            for noisy in ("kafka", "alembic"):
                logging.getLogger(noisy).setLevel(logging.WARNING)
        use_stack(args)
        from botocore.exceptions import BotoCoreError, ClientError
        from kafka.errors import KafkaError

        from ingest.job_request import JobRequestError
        from tokenmill.stack.local_stack import StackError

        try:
            return handler(args)
        except Exception as error:
            if not isinstance(error, KafkaError | BotoCoreError | ClientError | StackError | JobRequestError):
                raise
            print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
            return 2

    return wrapper


# ---- registration -------------------------------------------------------------------------------------

def _register_submit(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("submit", help="send a job to the service via Kafka or the S3 inbox",
                                 description=SUBMIT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", nargs="?", metavar="FILE_OR_URI",
                        help="a Parquet or OpenAI Batch JSONL file, or an s3:// URI (default: the bundled sample)")
    parser.add_argument("--via", choices=("kafka", "s3"), default="kafka", help="front door (default: kafka)")
    parser.add_argument("--output", "-o", metavar="S3_URI", help="where results go (default: <bucket>/outputs/JOB)")
    parser.add_argument("--model", default="smollm2-135m", help="model (picks the workers' queue)")
    parser.add_argument("--shard-size", type=int, default=500, metavar="ROWS", help="rows per shard (default: 500)")
    parser.add_argument("--priority", type=int, default=0,
                        help="job priority: its rows' engine request priority is the negated value, so a higher "
                             "one is admitted first under --scheduling-policy priority (default: 0)")
    parser.add_argument("--openai-output", action="store_true", help="also write batch_output.jsonl")
    add_task_options(parser)
    parser.add_argument("--cache-salt", metavar="TEXT",
                        help="share prefix-cache blocks only with jobs of the same salt (the service folds in the "
                             "job's source too: TOKENMILL_CACHE_ISOLATION, see the README's Security section)")
    add_lora_modules_option(parser, "LoRA adapters the job's rows may name as their `model` (vLLM's syntax; "
                                    "several, or the option repeated): a PEFT directory, uploaded to the service's "
                                    "bucket first (<bucket>/adapters/NAME-<content hash>/), or an s3:// prefix. "
                                    "The workers fetch each once and cache it; rows naming none of them or the "
                                    "--model fail with model_not_found (docs/lora.md)")
    parser.add_argument("--wait", action="store_true", help="wait until the job ends and print its status")
    parser.add_argument("--timeout", type=float, default=1800, metavar="S", help="how long --wait waits")
    add_sampling_options(parser, max_tokens=64)
    stack_dir_option(parser)
    parser.set_defaults(handler=_friendly(submit))


def _register_schedule(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("schedule", help="nightly runs fired by Celery beat: add, list, remove",
                                 description="Recurring jobs: at each cron time (UTC) beat makes one job per "
                                             "schedule and date from the input and output patterns, whose "
                                             "{date} placeholder becomes that date (YYYY-MM-DD, or "
                                             "{date:%%Y/%%m/%%d}).")
    actions = parser.add_subparsers(dest="schedule_command", metavar="ACTION", required=True)
    add = actions.add_parser("add", help="add a schedule")
    add.add_argument("name", metavar="NAME")
    add.add_argument("--cron", required=True, help='five cron fields in UTC, e.g. "0 2 * * *" (02:00 daily)')
    add.add_argument("--input", required=True, metavar="PATTERN", help="e.g. s3://bucket/daily/{date}/in.parquet")
    add.add_argument("--output", required=True, metavar="PATTERN", help="e.g. s3://bucket/daily-out/{date}")
    add.add_argument("--model", default="smollm2-135m")
    add.add_argument("--shard-size", type=int, default=500, metavar="ROWS")
    add.add_argument("--priority", type=int, default=0)
    add_sampling_options(add, max_tokens=64)
    listing = actions.add_parser("list", help="list schedules and their latest run")
    remove = actions.add_parser("remove", help="remove a schedule (its jobs stay)")
    remove.add_argument("name", metavar="NAME")
    for action, handler in ((add, schedule_add), (listing, schedule_list), (remove, schedule_remove)):
        _database_option(action)
        stack_dir_option(action)
        action.set_defaults(handler=_friendly(handler))


def _register_stack(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("stack", help="start or stop the whole local service",
                                 description=STACK_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="stack_command", metavar="ACTION", required=True)
    start = actions.add_parser("up", help="start every component and print their addresses")
    start.add_argument("--workers", type=int, default=1, metavar="N",
                       help="Celery workers (default: 1; 0 starts none: run `tokenmill worker` yourself)")
    start.add_argument("--port-base", type=int, metavar="PORT",
                       help="Kafka on PORT, Redis +1, Flower +2, the OpenAI Batch API +3, a private PostgreSQL +4, "
                            "S3 +10..+17 (default: 9092, 6380, 5555, 8000, 5433, 8333)")
    start.add_argument("--database-url", metavar="URL",
                       help="job database, as an administrator who creates it (if missing) and the service's own "
                            "role <database>_service, which the stack then uses (default: PostgreSQL on 127.0.0.1 "
                            "as postgres, database tokenmill)")
    start.add_argument("--postgres", choices=("server", "private"), default="server",
                       help="server: the PostgreSQL server --database-url names (default); private: a cluster of the "
                            "stack's own (initdb, pg_ctl; needs the PostgreSQL server binaries), which `stack down` "
                            "stops and deletes, and which ops/soak_faults.py may restart and pause")
    start.add_argument("--model", default="smollm2-135m", help="the model the workers load")
    add_lora_modules_option(start, "LoRA adapters every worker serves to every job (`tokenmill worker "
                                   "--lora-modules`): NAME=DIR_OR_URI, a PEFT directory or an s3:// prefix")
    start.add_argument("--threads", type=int, metavar="N", help="CPU threads per worker (default: cores / N)")
    start.add_argument("--kv-cache-memory", type=float, default=0.5, metavar="GIB",
                       help="KV pool per worker in GiB (default: 0.5)")
    start.add_argument("--shards-in-flight", type=int, metavar="K",
                       help="shards each worker runs at once in its engine (default: `tokenmill worker`'s, from "
                            "its --max-num-seqs and --shard-rows)")
    start.add_argument("--kv-store-memory", type=int, metavar="MIB",
                       help="maxmemory of the stack's KV Redis (KV sharing, disaggregated workers), which then "
                            "evicts the least recently used blocks (default: 512)")
    start.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                       help="extra environment for every component, e.g. TOKENMILL_SWEEP_INTERVAL_S=5 (default 30), "
                            "TOKENMILL_SWEEP_GRACE_S=60 (how long lost work waits before the sweep resends it; "
                            "default 600), TOKENMILL_MAX_SHARD_ATTEMPTS=3, TOKENMILL_MAX_SPEC_BYTES (largest job "
                            "message or sidecar; default 1 MiB), TOKENMILL_ALLOWED_INPUT_PREFIXES and "
                            "TOKENMILL_ALLOWED_OUTPUT_PREFIXES (comma-separated URI prefixes the front doors' jobs "
                            "may read and write; default the stack's bucket; never the OpenAI API's files/ and "
                            "results/), TOKENMILL_CACHE_ISOLATION "
                            "(source, job or spec; default source)")
    stop = actions.add_parser("down", help="stop every component and check the ports are free")
    env = actions.add_parser("env", help="print `export` lines that point a shell at the stack",
                             description="Print `export` lines for the stack's variables. The database URL (it "
                                         "holds the service role's password), the S3 keys and Flower's login are "
                                         "left out unless --show-secrets; tokenmill commands read them from the "
                                         "state directory anyway.")
    env.add_argument("--show-secrets", action="store_true",
                     help="also print the variables holding secrets (e.g. for psql, curl, aws)")
    for action, handler in ((start, stack_up), (stop, stack_down), (env, stack_env)):
        stack_dir_option(action)
        action.set_defaults(handler=_friendly(handler))


def _register_worker(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("worker", help="a Celery worker holding one loaded engine",
                                 description="A Celery worker: one process that loads the model once and holds up "
                                             "to K shards of the model's queue in flight in that engine, K tasks in a "
                                             "pool of threads, shards of any job sharing the engine. Beside it a "
                                             "second Celery node, NAME-control, runs the control queue's tasks "
                                             "(validation and planning, finalizing, the sweep) in threads of its "
                                             "own, so they never wait for a shard. Either node that ends unasked "
                                             "(a row that crashes the engine, a lost broker) is started again; "
                                             "both end with this command.")
    parser.add_argument("--name", default="worker", help="node name; the host is appended (default: worker)")
    parser.add_argument("--queues", metavar="Q1,Q2", help="queues to consume (default: the model's and control)")
    parser.add_argument("--control-threads", type=int, default=2, metavar="N",
                        help="threads of the control node, which runs the control queue's tasks beside the shards "
                             "(default: 2; 0: no control node, control tasks share the K shard threads)")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve this worker's Prometheus metrics at http://127.0.0.1:PORT/metrics")
    parser.add_argument("--kv-role", choices=("producer", "consumer"),
                        help="disaggregated prefill and decode: a producer takes the model's prefill queue, saves "
                             "each shard's prompt KV to Redis and hands the shard to the decode queue; a consumer "
                             "takes the model's queue and loads that KV. Jobs go to producers first where "
                             "TOKENMILL_KV_DISAGGREGATION names their model (docs/kv-connector.md) (default: "
                             "neither, a plain worker)")
    parser.add_argument("--engine-factory", metavar="MODULE:FUNCTION",
                        help="the function that builds this worker's engine from its settings (an "
                             "engine.settings.EngineSettings) instead of the real one: a test's or a benchmark's "
                             f"engine (default: ${ENGINE_FACTORY_ENV}, else the real engine)")
    _shards_in_flight_options(parser)
    add_engine_options(parser, lora="single-rank",  # a worker's shards of several jobs: by their job's priority
                       defaults={"scheduling_policy": "priority"})
    add_kv_sharing_options(parser)
    add_lora_modules_option(parser, "LoRA adapters this worker serves to every job of its model, beside the "
                                    "adapters a job brings (whose name wins): NAME=DIR_OR_URI, a PEFT directory "
                                    "or an s3:// prefix, fetched once into $TOKENMILL_DATA/lora-cache; several, or "
                                    "the option repeated (vLLM's syntax). Give every worker of a model the same: "
                                    "jobs go to a model's queue, whatever adapters their rows name (docs/lora.md)")
    stack_dir_option(parser)
    parser.set_defaults(handler=_friendly(worker))


def _shards_in_flight_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards-in-flight", type=int, metavar="K",
                        help="shards one worker runs at once in its engine (default: ceil(min(--max-num-seqs, "
                             "--num-kv-blocks) / --shard-rows) + 1, enough to fill a batch plus the next shard)")
    parser.add_argument("--shard-rows", type=int, default=500, metavar="ROWS",
                        help="typical rows per shard, for the default K (default: 500, the default --shard-size)")


def _register_consumer(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("consumer", help="consume job specs from the Kafka job topic",
                                 description="Turn messages on the job topic into jobs (at-least-once: the job is "
                                             "recorded before the offset is committed; bad messages are kept in "
                                             "rejected_messages).")
    stack_dir_option(parser)
    parser.set_defaults(handler=_friendly(consumer))


def _register_watcher(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("watcher", help="turn new files in the S3 inbox into jobs",
                                 description="Watch the S3 inbox (default: <bucket>/inbox) and make a job of every "
                                             "new object, once per key and ETag; NAME.job.json next to NAME.parquet "
                                             "carries its settings.")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between scans")
    parser.add_argument("--settle", type=float, default=2.0, metavar="S",
                        help="objects younger than this wait for the next scan (default: 2)")
    stack_dir_option(parser)
    parser.set_defaults(handler=_friendly(watcher))


# ---- the service's settings ---------------------------------------------------------------------------

def _service_config():
    from ingest.config import ServiceConfig

    return ServiceConfig.from_env()


def _sessions():
    from storage import db, migrate

    url = db.resolve_url()
    migrate.ensure_schema(url)
    return db.session_factory(db.make_engine(url))


# ---- handlers -----------------------------------------------------------------------------------------

def submit(args: argparse.Namespace) -> int:
    from ingest.submit import submit_job

    config = _service_config()
    adapters = _published_adapters(lora_modules(args), config)
    sent = submit_job(args.input or sample_input(), args.via, config, args.output, model=args.model,
                      sampling=sampling_kwargs(args), shard_size=args.shard_size, priority=args.priority,
                      openai_output=args.openai_output, cache_salt=args.cache_salt, **_embedding_fields(args),
                      **({"lora_modules": adapters} if adapters else {}))
    print(f"job {sent.job_id}: {sent.input_uri} -> {sent.output_uri} (sent to {sent.sent_to})", file=sys.stderr)
    print(sent.job_id, flush=True)
    if args.wait:
        return _wait(sent.job_id, args.timeout)
    return 0


def _published_adapters(modules: dict[str, str], config) -> dict[str, str]:
    """The job's adapters as s3:// URIs: local directories uploaded to the service's bucket first."""
    from storage.objectstore import normalize_uri
    from workers.adapters import publish_adapter

    uris = {name: normalize_uri(path) for name, path in modules.items()}
    if any(not uri.startswith("s3://") for uri in uris.values()) and not config.bucket_uri:
        raise ValueError("no service bucket to upload local adapters to: start the stack or set TOKENMILL_BUCKET_URI")
    return {name: uri if uri.startswith("s3://") else
            publish_adapter(uri[len("file://"):], name, config.in_bucket("adapters"), config.s3)
            for name, uri in uris.items()}


def _embedding_fields(args: argparse.Namespace) -> dict:
    """An embedding job's fields; none for a generation job (its spec stays as before)."""
    return {**({"task": "embed"} if args.task == "embed" else {}),
            **({"truncate_inputs": True} if args.truncate_inputs else {})}


def _wait(job_id: str, timeout_s: float) -> int:
    import time

    from storage.models import Job
    from storage.states import is_terminal

    sessions, deadline, status = _sessions(), time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        with sessions() as session:
            job = session.get(Job, job_id)
            if job is not None and job.status != status:
                status = job.status
                print(f"job {job_id}: {status}", file=sys.stderr)
            if job is not None and is_terminal(job.status):
                if job.error:
                    print(f"error: {job.error}", file=sys.stderr)
                return 0 if job.status == "completed" else 1
        time.sleep(1.0)
    print(f"job {job_id} is still {status or 'not created'} after {timeout_s:.0f} s", file=sys.stderr)
    return 1


def schedule_add(args: argparse.Namespace) -> int:
    from ingest.schedules import add_schedule

    settings = {"sampling": sampling_kwargs(args), "shard_size": args.shard_size, "priority": args.priority}
    schedule = add_schedule(_sessions(), args.name, args.cron, args.input, args.output, args.model, settings)
    print(f"schedule {schedule.name}: {schedule.cron} (UTC): {schedule.input_pattern} -> {schedule.output_pattern}")
    return 0


def schedule_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ingest.schedules import list_schedules

    rows = list_schedules(_sessions())
    table = Table("name", "cron (UTC)", "model", "input", "output", "last date", "last job")
    for schedule, run in rows:
        table.add_row(schedule.name, schedule.cron, schedule.model, schedule.input_pattern,
                      schedule.output_pattern, str(run.run_date) if run else "", (run.job_id or "")[:8] if run else "")
    Console().print(table if rows else "no schedules yet: add one with `tokenmill schedule add`")
    return 0


def schedule_remove(args: argparse.Namespace) -> int:
    from ingest.schedules import remove_schedule

    remove_schedule(_sessions(), args.name)
    print(f"schedule {args.name} removed")
    return 0


def stack_up(args: argparse.Namespace) -> int:
    from tokenmill.stack import local_stack

    if args.workers < 0:
        raise local_stack.StackError(f"--workers must be 0 or more, got {args.workers}")
    workers = args.workers
    if args.postgres == "private" and args.database_url:
        raise local_stack.StackError("--database-url names a server, --postgres private runs one of the stack's "
                                     "own: pass one of them")
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(workers, 1))
    extra_env = dict(item.split("=", 1) for item in args.env)
    worker_args = ["--threads", str(threads), "--kv-cache-memory", str(args.kv_cache_memory),
                   *(["--shards-in-flight", str(args.shards_in_flight)] if args.shards_in_flight else []),
                   *_lora_module_args(lora_modules(args))]
    settings = local_stack.StackSettings(args.state_dir or default_state_dir(), workers, args.port_base,
                                         args.database_url or local_stack.DEFAULT_DATABASE, args.model, worker_args,
                                         extra_env, args.postgres,
                                         args.kv_store_memory or local_stack.KV_STORE_MEMORY_MIB)
    state = local_stack.up(settings)
    print(f"tokenmill stack is up (state: {settings.state_dir})")
    print(local_stack.describe(state, settings.state_dir))
    return 0


def _lora_module_args(modules: dict[str, str]) -> list[str]:
    """--lora-modules for the workers, local directories as absolute file:// URIs (the workers run in the state
    directory)."""
    from storage.objectstore import normalize_uri

    items = [f"{name}={normalize_uri(path)}" for name, path in modules.items()]
    return ["--lora-modules", *items] if items else []


def stack_down(args: argparse.Namespace) -> int:
    state_dir = args.state_dir or default_state_dir()
    from tokenmill.stack import local_stack

    problems = local_stack.down(state_dir)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if not problems:
        print(f"tokenmill stack is down (state: {state_dir}); every process stopped, every port free")
    return 1 if problems else 0


def stack_env(args: argparse.Namespace) -> int:
    from tokenmill.stack import local_stack

    print(local_stack.env_script(args.state_dir or default_state_dir(), show_secrets=args.show_secrets), end="")
    return 0


def worker(args: argparse.Namespace) -> int:
    import socket

    from workers.disagg import role_engine_settings

    role = os.environ.get(WORKER_ROLE_ENV)
    engine, adapters = engine_settings(args), worker_lora_modules(args)  # bad settings stop it before any node starts
    engine = role_engine_settings(engine, args.kv_role, _service_config())
    if not role:
        nodes = worker_nodes(args, _service_config())
        return _supervise({role: [sys.executable, "-m", "tokenmill", *args.argv] for role in nodes})
    from workers.celery_app import TasksProcess, app, config, start
    from workers.disagg import shard_queue
    from workers.worker_engine import WorkerEngine, WorkerProcess, engine_factory

    # the node's tasks run in this process (a threads pool): its Celery app is handed the engine, typed, and the
    # function that builds it
    spec = WorkerEngine(args.model, engine.replace(model=args.model), adapters, args.kv_role)
    factory = engine_factory(args.engine_factory or os.environ.get(ENGINE_FACTORY_ENV))
    start(TasksProcess(config, WorkerProcess(spec, factory)))

    # another role (TOKENMILL_WORKER_CHILD=1: run without its supervisor): one node takes every queue
    node = worker_nodes(args, config).get(role) or WorkerNode(_worker_queues(args, config), None, args.name)
    if shard_queue(config, args.model, args.kv_role) in node.queues:
        os.environ["TOKENMILL_WORKER_PRELOAD"] = "1"  # its pool process loads the model before taking tasks
        if args.metrics_port:
            os.environ["TOKENMILL_METRICS_PORT"] = str(args.metrics_port)
    app.worker_main(["worker", "--pool", "threads", "--concurrency", str(node.threads or shards_in_flight(args)),
                     "--queues", ",".join(node.queues), "--hostname", f"{node.name}@{socket.gethostname()}",
                     "--task-events", "--prefetch-multiplier", "1", "--loglevel", "INFO", "--without-gossip",
                     "--without-mingle"])
    return 0


def worker_lora_modules(args: argparse.Namespace) -> dict[str, str]:
    """--lora-modules checked as a job's are (names; not the model's name): {name: file:// or s3:// URI}."""
    from ingest.job_request import validate_request

    modules = lora_modules(args)
    if not modules:
        return {}
    return validate_request({"input_uri": "file:///dev/null", "output_uri": "file:///dev/null",
                             "model": args.model, "lora_modules": modules}).lora_modules


@dataclass(frozen=True)
class WorkerNode:
    queues: list[str]
    threads: int | None  # None: K, the shards in flight
    name: str


def worker_nodes(args: argparse.Namespace, config) -> dict[str, WorkerNode]:
    """The Celery nodes of one `tokenmill worker`, by role: `engine` on the model queue(s), K threads over the
    engine; `control` on the control queue, --control-threads of its own, no engine (a thread pool takes whatever
    task comes next, so only a node of their own keeps plan, finalize and the sweep from waiting for a shard)."""
    from tokenmill.stack.local_stack import control_node_name

    control_queue = config.control_queue
    queues = _worker_queues(args, config)
    shard_queues = [q for q in queues if q != control_queue]
    if not shard_queues:  # a control worker: one node, under its own name
        return {"control": WorkerNode(queues, args.control_threads or None, args.name)}
    if len(shard_queues) == len(queues) or args.control_threads <= 0:
        return {"engine": WorkerNode(queues, None, args.name)}
    return {"engine": WorkerNode(shard_queues, None, args.name),  # first: PID 2 where the supervisor is PID 1
            "control": WorkerNode([control_queue], args.control_threads, control_node_name(args.name))}


def _worker_queues(args: argparse.Namespace, config) -> list[str]:
    from workers.disagg import shard_queue

    default = f"{shard_queue(config, args.model, getattr(args, 'kv_role', None))},{config.control_queue}"
    return [q for q in (args.queues or default).split(",") if q]


def shards_in_flight(args: argparse.Namespace) -> int:
    from workers.engine_loop import shards_in_flight as default

    return args.shards_in_flight or default(args.max_num_seqs, args.shard_rows, args.num_kv_blocks)


def _supervise(commands: dict[str, list[str]]) -> int:
    """Run each node in a child process of its own (same process group; TOKENMILL_WORKER_CHILD=ROLE) and start one
    again whenever it ends unasked (killed by a signal, as a prefork pool replaces its lost process, or exited),
    the others running on. SIGTERM or SIGINT here stops them all and returns; a node that cannot start at all stops
    the others too. A node also gets SIGTERM should this process die (killed alone): none outlives it."""
    import signal
    import subprocess
    import time

    stopping = False
    children: dict[int, tuple[str, subprocess.Popen, float]] = {}  # pid -> role, process, started
    quick_exits = dict.fromkeys(commands, 0)
    code = 0

    def stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(children):
            try:
                os.kill(pid, signum)  # not Popen.poll: it would reap the child the loop below waits for
            except ProcessLookupError:
                pass

    def start(role: str) -> None:
        child = subprocess.Popen(commands[role], env={**os.environ, WORKER_ROLE_ENV: role},
                                 preexec_fn=_end_with_parent(os.getpid()))
        children[child.pid] = (role, child, time.monotonic())

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for role in commands:
        start(role)
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid not in children:  # as PID 1 (a container) it also reaps orphans
            continue
        role, child, started = children.pop(pid)
        child.returncode = exit_code = os.waitstatus_to_exitcode(status)
        if stopping:
            code = code or exit_code
            continue
        quick = exit_code >= 0 and time.monotonic() - started < 30
        quick_exits[role] = quick_exits[role] + 1 if quick else 0
        if quick_exits[role] >= 5:  # it cannot start at all (bad settings): give up, the other nodes too
            code = exit_code
            stop(signal.SIGTERM, None)
            continue
        # a signal (a row that crashed the engine), or Celery giving up on its broker connection (after a Redis
        # restart its consumer can end with "Unrecoverable error"): either way the node is wanted back
        why = f"killed by signal {-exit_code}" if exit_code < 0 else f"exited with {exit_code}"
        print(f"tokenmill worker: its {role} node {why}; starting it again", file=sys.stderr, flush=True)
        time.sleep(1)
        if not stopping:
            start(role)
    return code


def _end_with_parent(parent: int):
    """For Popen's preexec_fn: the child gets SIGTERM when its parent dies (Linux PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    prctl = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None  # looked up before the fork

    def arm() -> None:
        if prctl is not None:
            prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before that
            os._exit(1)

    return arm


def _intake():
    from workers.tasks import intake

    return intake()  # over the tasks' session factory, which publishes job events where Kafka is configured


def consumer(args: argparse.Namespace) -> int:
    from ingest.kafka_consumer import JobConsumer, run_forever

    config = _service_config()
    if not config.kafka_bootstrap:
        raise ValueError("no Kafka broker: set TOKENMILL_KAFKA_BOOTSTRAP (or start the stack)")
    run_forever(JobConsumer(_intake(), config.kafka_bootstrap, config.jobs_topic, config.consumer_group,
                            max_bytes=config.max_spec_bytes))
    return 0


def watcher(args: argparse.Namespace) -> int:
    from ingest.s3_watcher import InboxWatcher

    config = _service_config()
    if not config.inbox_uri or not config.bucket_uri:
        raise ValueError("no S3 inbox: set TOKENMILL_BUCKET_URI (or TOKENMILL_INBOX_URI), or start the stack")
    InboxWatcher(_intake(), config.inbox_uri, config.outputs_uri, args.settle,
                 max_bytes=config.max_spec_bytes).run(interval_s=args.interval)
    return 0
