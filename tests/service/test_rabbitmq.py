"""The broker is Redis by default and RabbitMQ by URL: a worker on RabbitMQ (control queue only, so no model)
validates, plans and finalizes jobs of the stack's database."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pyarrow as pa
import pytest
from celery import Celery

from ingest.intake import submit
from storage.job_settings import CELERY
from tests.fixtures_services import REPO
from tests.jobs.jobhelpers import new_job, write_parquet
from tests.service.conftest import stop_process_group, wait_for_job, wait_until

RABBIT_URL = os.environ.get("TOKENMILL_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


@pytest.fixture
def rabbit(stack, tmp_path) -> Iterator[tuple[Celery, str]]:
    """A worker consuming its own control queue on RabbitMQ; (a client app, that queue's name)."""
    prefix, name = f"test-{uuid.uuid4().hex[:8]}-", f"rabbit-{uuid.uuid4().hex[:6]}"
    env = {**stack.env, "TOKENMILL_BROKER_URL": RABBIT_URL, "TOKENMILL_QUEUE_PREFIX": prefix}
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen([sys.executable, "-m", "tokenmill", "worker", "--name", name, "--queues",
                                   f"{prefix}control"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    app = Celery(broker=RABBIT_URL)
    app.conf.task_queue_max_priority = 9  # as the workers declare their queues (workers.celery_app)
    try:
        node = f"{name}@{socket.gethostname()}"
        wait_until(lambda: app.control.ping(destination=[node], timeout=1.0), "the RabbitMQ worker", 60, every=0.5)
        yield app, f"{prefix}control"
    finally:
        stop_process_group(worker, 20)
        with app.connection_for_write() as connection:
            connection.default_channel.queue_delete(f"{prefix}control")
        app.close()


def test_a_worker_on_rabbitmq_runs_the_control_tasks(stack, sessions, rabbit, tmp_path) -> None:
    app, queue = rabbit
    empty = write_parquet(tmp_path / "empty.parquet", {"custom_id": [], "prompt": []},
                          schema=pa.schema([("custom_id", pa.string()), ("prompt", pa.string())]))
    stack.store(f"{stack.bucket}/rabbit").put_file("empty.parquet", empty)
    tag = uuid.uuid4().hex[:8]
    specs = {"missing": f"{stack.bucket}/rabbit/missing.parquet", "empty": f"{stack.bucket}/rabbit/empty.parquet"}
    jobs = {what: submit(sessions, new_job(uri, f"{stack.bucket}/rabbit-out/{what}-{tag}", "smollm2-135m",
                                           s3=stack.s3, executor=CELERY)).job.id for what, uri in specs.items()}
    for job_id in jobs.values():
        app.send_task("tokenmill.plan_job", args=[job_id], queue=queue)
    missing, empty_job = (wait_for_job(sessions, jobs[what], timeout=60) for what in ("missing", "empty"))
    assert missing["status"] == "failed" and "missing.parquet does not exist" in missing["error"]
    assert empty_job["status"] == "completed", empty_job["error"]
    assert stack.store(empty_job["output_uri"]).exists("manifest.json")
