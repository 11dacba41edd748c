"""Embedding and generation workers in one stack: a worker of all-minilm-l6-v2 joins the running stack (its own
queue, beside the smollm2 workers), and an embedding job sent via Kafka completes with every custom_id once."""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pytest

from tests.fixtures_services import REPO
from tests.jobs.jobhelpers import assert_each_id_once, write_parquet
from tests.service.conftest import stop_process_group, submit_file, wait_for_job, wait_for_workers
from tokenmill.bench.sentences import held_out_sentences

pytestmark = pytest.mark.real_model
MODEL = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def embedding_worker(stack):
    env = {**stack.env, "PYTHONPATH": str(REPO)}
    env.pop("TOKENMILL_ENGINE_FACTORY", None)  # the plain engine factory
    process = subprocess.Popen([sys.executable, "-m", "tokenmill", "worker", "--name", "embed1", "--model", MODEL,
                                "--threads", "1", "--state-dir", str(stack.dir)], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_workers(stack, 3)
        yield process
    finally:
        stop_process_group(process, timeout=30)


def test_an_embedding_job_via_kafka_runs_on_the_embedding_worker(stack, sessions, embedding_worker, tmp_path):
    ids = [f"e-{i:03d}" for i in range(120)]
    path = write_parquet(tmp_path / "sentences.parquet", {"custom_id": ids, "text": held_out_sentences(120, seed=5)})
    job_id = submit_file(stack, path, "--model", MODEL, "--task", "embed", "--shard-size", "40", "--openai-output")
    job = wait_for_job(sessions, job_id, timeout=300)
    assert job["status"] == "completed", job["error"]
    results, errors, manifest = assert_each_id_once(stack.store(job["output_uri"]), ids)
    assert not errors and manifest["counts"]["completed"] == 120
    assert all(len(r["embedding"]) == 384 for r in results)
    part = stack.store(job["output_uri"]).list("part-")[0]
    from storage.formats import read_part

    assert read_part(stack.store(job["output_uri"]), part).schema.field("embedding").type == pa.list_(pa.float32(),
                                                                                                     384)
