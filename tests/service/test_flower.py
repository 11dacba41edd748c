"""Flower on the stack: basic auth on, its API lists the workers and the tasks of a finished job, and the
tasks send progress events (with their job id) that Flower and any event consumer see."""

from __future__ import annotations

import ast
import base64
import json
import threading
import urllib.error
import urllib.request

import pytest

from tests.jobs.jobhelpers import prompt_rows, write_parquet
from tests.service.conftest import submit_file, wait_for_job, wait_until

pytestmark = pytest.mark.real_model


def get(url: str, user: str | None = None, password: str | None = None) -> tuple[int, object]:
    request = urllib.request.Request(url)
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, None


def test_flower_needs_credentials(stack) -> None:
    flower = stack.state["flower"]
    assert get(f"{flower['url']}/api/workers")[0] == 401
    assert get(f"{flower['url']}/api/workers", flower["user"], "wrong")[0] == 401


def test_flower_lists_the_workers_and_the_tasks_of_a_finished_job(stack, kafka_job) -> None:
    flower = stack.state["flower"]
    credentials = (flower["user"], flower["password"])
    status, workers = get(f"{flower['url']}/api/workers?refresh=1", *credentials)
    assert status == 200
    assert {name.partition("@")[0] for name in workers} >= {"worker1", "worker2"}

    status, tasks = get(f"{flower['url']}/api/tasks", *credentials)
    assert status == 200
    of_job = [t for t in tasks.values() if ast.literal_eval(t["args"] or "()")[:1] == (kafka_job.id,)]
    names = sorted(t["name"] for t in of_job)
    assert names == ["tokenmill.finalize_job", "tokenmill.plan_job"] + ["tokenmill.run_shard"] * 4
    assert all(t["state"] == "SUCCESS" for t in of_job)
    assert {t["worker"].partition("@")[0] for t in of_job if t["name"] == "tokenmill.run_shard"} == {
        "worker1", "worker2"}


def test_shard_tasks_report_their_progress_with_the_job_id(stack, sessions, tmp_path) -> None:
    from celery import Celery

    app = Celery(broker=stack.state["env"]["TOKENMILL_BROKER_URL"])
    events: list[dict] = []
    with app.connection() as connection:
        receiver = app.events.Receiver(connection, handlers={"task-progress": events.append})
        listening = threading.Thread(target=receiver.capture, kwargs={"limit": None, "timeout": None}, daemon=True)
        listening.start()
        try:
            job_id = submit_file(stack, write_parquet(tmp_path / "in.parquet", prompt_rows(4, "progress")),
                                 "--max-tokens", "12")
            assert wait_for_job(sessions, job_id)["status"] == "completed"
            wait_until(lambda: any(e.get("shard_id") and e["job_id"] == job_id for e in events), "a progress event")
        finally:
            receiver.should_stop = True
            listening.join(timeout=10)
    app.close()
    of_job = [e for e in events if e["job_id"] == job_id]
    assert {e.get("phase") for e in of_job} >= {"validating input", "writing errors and manifest"}
    assert max(e["rows_done"] for e in of_job if e["shard_id"]) > 0
