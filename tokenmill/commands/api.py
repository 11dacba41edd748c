"""`tokenmill api`: the OpenAI Batch REST API (files, batches) and Anthropic's Message Batches API as a front
door; `tokenmill api key ...`: their keys."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from tokenmill.options import (
    DATABASE_HELP,
    add_engine_options,
    add_served_model_name_option,
    engine_settings,
    stack_dir_option,
    use_stack,
)

API_DESCRIPTION = """\
Serve two batch APIs on one port, so code written for either runs here unchanged:

- OpenAI's Batch API: POST/GET/DELETE /v1/files, /v1/files/{id}/content, POST/GET /v1/batches,
  /v1/batches/{id}/cancel (the `openai` SDK);
- Anthropic's Message Batches API: POST/GET /v1/messages/batches, GET/DELETE /v1/messages/batches/{id},
  /v1/messages/batches/{id}/cancel and /results (the `anthropic` SDK).

  tokenmill api key create --tenant me            # prints a key, once; both APIs take it
  export OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=<the key>
  export ANTHROPIC_BASE_URL=http://127.0.0.1:8000 ANTHROPIC_API_KEY=<the key>
  tokenmill api                                   # then OpenAI() and Anthropic() find it

A tenant sees only its own batches, and each API only its own. Batches of both are jobs (see `tokenmill
jobs`, `tokenmill status ID`; a message batch msgbatch_<hex> is the job with that UUID). Alone it uses the
configured database and bucket (SQLite and a folder under $TOKENMILL_DATA by default) and runs the jobs in this
process; with a Celery broker configured (`tokenmill stack up` starts it so) the stack's workers run them."""
DEFAULT_PORT = 8000


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("api", help="serve OpenAI's Batch API and Anthropic's Message Batches API; "
                                             "manage their keys",
                                 description=API_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    parser.add_argument("--bucket", metavar="DIR_OR_S3_URI",
                        help="where uploaded files and results go (default: $TOKENMILL_BUCKET_URI, else "
                             "$TOKENMILL_DATA/bucket)")
    parser.add_argument("--executor", choices=("local", "celery"),
                        help="who runs the batches: this process (local) or the Celery workers (default: celery "
                             "when $TOKENMILL_BROKER_URL is set, else local)")
    limits = parser.add_argument_group("limits (per tenant; a refused request names the flag)")
    limits.add_argument("--max-upload-bytes", type=int, default=None, metavar="BYTES",
                        help="largest file a client may upload (default: 200 MiB, OpenAI's)")
    limits.add_argument("--max-batch-rows", type=int, default=None, metavar="ROWS",
                        help="most requests in one OpenAI batch (default: 50,000, OpenAI's)")
    limits.add_argument("--max-message-batch-requests", type=int, default=None, metavar="N",
                        help="most requests in one Anthropic message batch (default: 100,000, Anthropic's)")
    limits.add_argument("--max-message-batch-bytes", type=int, default=None, metavar="BYTES",
                        help="largest body of POST /v1/messages/batches (default: 256 MiB, Anthropic's 256 MB)")
    limits.add_argument("--max-tenant-bytes", type=int, default=None, metavar="BYTES",
                        help="most bytes of files a tenant may store (default: 100 GiB)")
    limits.add_argument("--max-batches-in-progress", type=int, default=None, metavar="N",
                        help="most batches of a tenant not yet ended, of both APIs (default: 100)")
    limits.add_argument("--max-enqueued-tokens", type=int, default=None, metavar="TOKENS",
                        help="most prompt tokens (estimated: bytes / 4) of a tenant's batches not yet ended, per "
                             "model, of both APIs; 0: no limit (default: $TOKENMILL_MAX_ENQUEUED_TOKENS, else "
                             "2,000,000)")
    limits.add_argument("--max-request-bytes", type=int, default=None, metavar="BYTES",
                        help="largest body of any request but an upload or a message batch, refused before its "
                             "key is checked (default: 1 MiB)")
    limits.add_argument("--file-expiry", type=int, default=None, metavar="SECONDS",
                        help="lifetime of an upload that gives no expires_after; 0: never expires (default: 30 "
                             "days, OpenAI's); expired files are deleted every minute")
    limits.add_argument("--max-completion-window", default=None, metavar="WINDOW",
                        help="accept completion windows other than OpenAI's 24h, up to this one (e.g. 7d; "
                             "default: only 24h)")
    parser.add_argument("--no-openapi", dest="openapi", action="store_false",
                        help="do not serve /openapi.json (served behind a key by default)")
    parser.add_argument("--shard-size", type=int, default=None, metavar="ROWS",
                        help="rows per shard of a batch's job (default: 500)")
    add_served_model_name_option(parser)
    _common_options(parser)
    add_engine_options(parser)
    parser.set_defaults(handler=serve)
    actions = parser.add_subparsers(dest="api_command", metavar="ACTION")
    keys = actions.add_parser("key", help="create, list or revoke API keys",
                              description="API keys are stored hashed in the job database, each acting for one "
                                          "tenant in both APIs (OpenAI's `Authorization: Bearer`, Anthropic's "
                                          "`x-api-key`): a tenant sees only its own files and batches.")
    key_actions = keys.add_subparsers(dest="key_command", metavar="ACTION", required=True)
    create = key_actions.add_parser("create", help="make a key for a tenant and print it (shown only once)")
    create.add_argument("--tenant", required=True, help="who the key acts for")
    create.add_argument("--name", help="a note to tell keys apart")
    listing = key_actions.add_parser("list", help="list keys (their first characters only)")
    listing.add_argument("--tenant", help="only this tenant's keys")
    revoke = key_actions.add_parser("revoke", help="revoke a key by its id (from `key list`)")
    revoke.add_argument("key_id", type=int, metavar="ID")
    for action, handler in ((create, key_create), (listing, key_list), (revoke, key_revoke)):
        _common_options(action)
        action.set_defaults(handler=handler)
    conformance = actions.add_parser(
        "conformance", help="check a running API with the official openai and anthropic SDKs",
        description="Drive a running tokenmill API with the official `openai` and `anthropic` SDKs: every batch "
                    "call of both APIs, a cancel mid-run, an expiry, a request failing in the run, another "
                    "tenant's key getting 404 on every id, and no SDK retry loops. Prints a table of the checks; "
                    "exits 1 if any failed. Its files and message batches are deleted at the end.")
    conformance.add_argument("--base-url", required=True, metavar="URL",
                             help=f"the server, e.g. http://127.0.0.1:{DEFAULT_PORT} (a trailing /v1 is ignored)")
    conformance.add_argument("--key", required=True, help="a key of one tenant")
    conformance.add_argument("--other-key", required=True, help="a key of another tenant")
    conformance.add_argument("--model", default="smollm2-135m", help="a model name the server serves "
                                                                      "(default: smollm2-135m)")
    conformance.add_argument("--embedding-model", metavar="NAME",
                             help="check /v1/embeddings lines with this model (default: skipped)")
    conformance.add_argument("--embedding-base-url", metavar="URL",
                             help="the server of --embedding-model, if another (its keys must be the same)")
    conformance.add_argument("--long-tokens", type=int, default=1024, metavar="N",
                             help="max_tokens of the requests that a cancel or an expiry stops (default: 1024); "
                                  "raise it if they finish first")
    conformance.add_argument("--expiry-window", type=int, default=5, metavar="SECONDS",
                             help="completion_window of the batch that must expire (default: 5; needs the server's "
                                  "--max-completion-window, else the check is skipped)")
    conformance.add_argument("--timeout", type=float, default=120, metavar="SECONDS",
                             help="longest wait for a batch to end (default: 120)")
    conformance.set_defaults(handler=run_conformance_command)


def _common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", metavar="URL", help=DATABASE_HELP)
    stack_dir_option(parser)


def _sessions(args: argparse.Namespace):
    import logging

    if not logging.getLogger().isEnabledFor(logging.DEBUG):  # alembic logs at INFO, even on import
        logging.getLogger("alembic").setLevel(logging.WARNING)
    from storage import db, migrate

    use_stack(args)
    url = db.resolve_url(args.database_url)
    migrate.ensure_schema(url)
    return db.session_factory(db.make_engine(url)), url


def key_create(args: argparse.Namespace) -> int:
    from storage import db
    from storage.api_keys import create_key

    sessions, url = _sessions(args)
    with sessions.begin() as session:
        token = create_key(session, args.tenant, args.name)
    print(token)
    print(f"a key for tenant {args.tenant!r} in {db.describe(url)}; it is shown only now:\n"
          f"  export OPENAI_API_KEY={token} OPENAI_BASE_URL=http://127.0.0.1:{DEFAULT_PORT}/v1\n"
          f"  export ANTHROPIC_API_KEY={token} ANTHROPIC_BASE_URL=http://127.0.0.1:{DEFAULT_PORT}", file=sys.stderr)
    return 0


def key_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from storage import db
    from storage.api_keys import list_keys

    sessions, url = _sessions(args)
    with sessions() as session:
        keys = list_keys(session, args.tenant)
    table = Table("id", "tenant", "name", "key", "created", "revoked", title=f"API keys in {db.describe(url)}")
    for key in keys:
        table.add_row(str(key.id), key.tenant, key.name or "", f"{key.key_prefix}...",
                      key.created_at.strftime("%Y-%m-%d %H:%M"),
                      key.revoked_at.strftime("%Y-%m-%d %H:%M") if key.revoked_at else "")
    Console().print(table)
    return 0


def key_revoke(args: argparse.Namespace) -> int:
    from storage.api_keys import revoke_key

    sessions, _ = _sessions(args)
    with sessions.begin() as session:
        if not revoke_key(session, args.key_id):
            print(f"error: no live key with id {args.key_id}", file=sys.stderr)
            return 2
    print(f"key {args.key_id} revoked")
    return 0


def run_conformance_command(args: argparse.Namespace) -> int:
    import logging

    from tokenmill.conformance import FAIL, run_conformance

    if not logging.getLogger().isEnabledFor(logging.DEBUG):  # not a line per HTTP request
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
    root = args.base_url.rstrip("/").removesuffix("/v1")
    embedding_root = args.embedding_base_url and args.embedding_base_url.rstrip("/").removesuffix("/v1")
    results = run_conformance(f"{root}/v1", root, args.key, args.other_key, model=args.model,
                              embedding_model=args.embedding_model,
                              embedding_base_url=embedding_root and f"{embedding_root}/v1",
                              long_tokens=args.long_tokens, expiry_window_s=args.expiry_window,
                              timeout_s=args.timeout)
    return 1 if any(result.status == FAIL for result in results) else 0


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ingest.config import ServiceConfig
    from ingest.openai_api import create_app
    from storage import db
    from storage.job_settings import CELERY, LOCAL
    from storage.models import JobSource

    sessions, url = _sessions(args)
    executor = args.executor or (CELERY if os.environ.get("TOKENMILL_BROKER_URL") else LOCAL)
    if executor == CELERY:
        from workers import events
        from workers.tasks import dispatch_job

        events.install(ServiceConfig.from_env(), sessions)  # the API's own changes (a cancel) publish too
        dispatch = dispatch_job
    else:
        from workers.inprocess import LocalExecutor

        local = LocalExecutor(sessions, engine_settings(args))
        local.resume(JobSource.API.value)
        dispatch = local.dispatch
    service = api_service(sessions, args.bucket, dispatch, executor, args.model, args.served_model_name,
                          max_upload_bytes=args.max_upload_bytes, shard_size=args.shard_size,
                          max_batch_rows=args.max_batch_rows, max_tenant_bytes=args.max_tenant_bytes,
                          max_message_batch_requests=args.max_message_batch_requests,
                          max_message_batch_bytes=args.max_message_batch_bytes,
                          max_batches_in_progress=args.max_batches_in_progress,
                          max_enqueued_tokens=args.max_enqueued_tokens,
                          max_request_bytes=args.max_request_bytes, max_completion_window=args.max_completion_window,
                          file_expiry_s=args.file_expiry, openapi=args.openapi)
    print(f"OpenAI Batch API on http://{args.host}:{args.port}/v1, Anthropic Message Batches API on "
          f"http://{args.host}:{args.port}/v1/messages/batches (database {db.describe(url)}, bucket "
          f"{service.bucket_uri}; batches run {'here' if executor == LOCAL else 'on the Celery workers'})",
          file=sys.stderr, flush=True)
    uvicorn.run(create_app(service), host=args.host, port=args.port, log_level="warning")
    return 0


def api_service(sessions, bucket: str | None, dispatch: Callable[[str], None], executor: str, model: str,
                served_model_names: list[str], **limits: int | None):
    """The API's service: its bucket (default: the configured one, else a folder), the intake that makes its
    jobs and hands them to `dispatch`, and the cancel of the workers."""
    from ingest.config import ServiceConfig
    from ingest.intake import Intake
    from ingest.openai_api import ApiService
    from ingest.policy import FrontDoorPolicy, api_bucket
    from workers.inprocess import cancel_job

    config = ServiceConfig.from_env()
    bucket = api_bucket(bucket or config.bucket_uri).rstrip("/")
    intake = Intake(sessions, config.s3, dispatch, policy=FrontDoorPolicy.from_env(bucket))
    return ApiService(sessions, bucket, intake, lambda job_id: cancel_job(sessions, job_id), model,
                      served_model_names, executor, **{k: v for k, v in limits.items() if v is not None})
