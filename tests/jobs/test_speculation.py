"""A job's own speculative decoding: set in its spec, applied to the worker's engine for its shards,
counted per shard and reported in the manifest. A job's batch-invariant setting travels the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingest.intake import submit
from ingest.job_request import JobRequestError, parse_request
from storage.objectstore import open_store
from tests.jobs.jobhelpers import assert_each_id_once, new_job, write_parquet
from tokenmill.bench.workload import PASSAGES
from workers.inprocess import run_job

# a probe every step: drafts whatever the adaptive control measures (on a slow or busy machine it may find that
# no k pays, and this test is about the counts, not the choice)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "probe_every": 1}


@pytest.mark.real_model
def test_manifest_reports_the_acceptance_of_the_jobs_speculation(sessions, engine_provider, llm_engine,
                                                                  tmp_path: Path) -> None:
    ids = [f"copy-{i}" for i in range(4)]
    prompts = [f"Copy this passage exactly:\n{PASSAGES[i]}\nCopy:\n{PASSAGES[i][:40]}" for i in range(4)]
    path = write_parquet(tmp_path / "in.parquet", {"custom_id": ids, "prompt": prompts})
    spec = new_job(str(path), str(tmp_path / "out"), "smollm2-135m", sampling={"max_tokens": 24, "temperature": 0},
                   shard_size=2, speculative_config=NGRAM)
    job = run_job(sessions, submit(sessions, spec).job.id, engine_provider)
    assert job.status == "completed", job.error
    _, _, manifest = assert_each_id_once(open_store(str(tmp_path / "out")), ids)
    report = manifest["speculative_decoding"]
    assert report["draft_tokens"] == job.spec_draft_tokens > 0
    assert 0 < report["accepted_tokens"] == job.spec_accepted_tokens <= report["draft_tokens"]
    assert report["acceptance_rate"] == pytest.approx(report["accepted_tokens"] / report["draft_tokens"], abs=1e-4)
    assert manifest["settings"]["speculative_config"] == NGRAM
    assert llm_engine.spec is not None and llm_engine.spec.config.method == "ngram"
    llm_engine.set_speculative_config(None)  # back to the engine's own setting (none) for other tests
    assert llm_engine.spec is None


def test_a_job_spec_with_a_bad_speculative_config_is_refused():
    with pytest.raises(JobRequestError, match="method must be one of"):
        parse_request('{"input_uri": "s3://b/in.parquet", "output_uri": "s3://b/out", '
                      '"speculative_config": {"method": "magic"}}')
    request = parse_request('{"input_uri": "s3://b/in.parquet", "output_uri": "s3://b/out", '
                            '"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}')
    assert request.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}


def test_a_job_spec_carries_batch_invariant_to_its_settings():
    spec = '{"input_uri": "s3://b/in.parquet", "output_uri": "s3://b/out"%s}'
    with pytest.raises(JobRequestError, match="batch_invariant"):
        parse_request(spec % ', "batch_invariant": "yes"')
    assert parse_request(spec % "").to_job(executor="celery").settings.batch_invariant is None  # the engine's own
    settings = parse_request(spec % ', "batch_invariant": true').to_job(executor="celery").settings
    assert settings.batch_invariant is True
    assert settings.to_json()["batch_invariant"] is True
