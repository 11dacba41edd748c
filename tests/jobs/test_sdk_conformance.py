"""Issue #57 section 3: `tokenmill.conformance`, the checks of `tokenmill api conformance`, run with the official
`openai` and `anthropic` SDKs against an API served in this process (jobs on the session's real model), with a
second server of the bundled embedding model beside it (same database and bucket) for `/v1/embeddings`: every
check passes and the checks cover every batch call of both APIs."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from datetime import timedelta

import uvicorn
from rich.console import Console

from ingest.anthropic_api.routes import job_id_of
from ingest.openai_api import create_app
from storage import repository as repo
from storage.job_settings import LOCAL
from storage.models import utcnow
from tests.fixtures_services import free_port_block
from tests.jobs.test_openai_api import MODEL, running_api
from tokenmill.commands.api import api_service
from tokenmill.conformance import ANTHROPIC, ANTHROPIC_CHECKS, OPENAI, OPENAI_CHECKS, PASS, run_conformance
from workers.inprocess import LocalExecutor

EMBEDDER = "all-minilm-l6-v2"


@contextlib.contextmanager
def embedding_api(sessions, bucket: str):
    """The base URL of a second API serving the bundled embedding model on the same database and bucket."""
    from engine import EngineConfig
    from engine.embedding_engine import EmbeddingEngine

    executor = LocalExecutor(sessions, {}, engine=EmbeddingEngine(EngineConfig(model=EMBEDDER, num_threads=2)))
    service = api_service(sessions, bucket, executor.dispatch, LOCAL, EMBEDDER, [], shard_size=2)
    port = free_port_block(1)
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the embedding API did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)
        executor.close()


def test_the_official_sdks_pass_every_check(sessions, tmp_path, llm_engine) -> None:
    def expire_batch(batch_id: str) -> None:  # its deadline passes: the in-process executor expires it
        with sessions.begin() as session:
            repo.get_job(session, job_id_of(batch_id) or batch_id).expires_at = utcnow() - timedelta(seconds=1)

    printed, bucket = io.StringIO(), str(tmp_path / "bucket")
    with running_api(sessions, bucket, llm_engine) as (base_url, key, other_key, _), \
            embedding_api(sessions, bucket) as embedding_url:
        results = run_conformance(base_url, base_url.removesuffix("/v1"), key, other_key, model=MODEL,
                                  embedding_model=EMBEDDER, embedding_base_url=embedding_url, long_tokens=512,
                                  expire=expire_batch, timeout_s=60, console=Console(file=printed, width=200))
    table = printed.getvalue()
    assert [r.name for r in results if r.api == OPENAI] == list(OPENAI_CHECKS), table
    assert [r.name for r in results if r.api == ANTHROPIC] == list(ANTHROPIC_CHECKS), table
    assert all(r.status == PASS for r in results), table
