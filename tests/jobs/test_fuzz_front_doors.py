"""A fuzz test of the way in (hypothesis): random and mutated job specs, Kafka values (null, not UTF-8, deep
nesting, huge integers, wrong types) and inbox keys go through the consumer's and the watcher's handling, on
SQLite and local folders. Each one becomes a job or a recorded rejection with its error; no exception
escapes; every job reads and writes only under the allow-list, and nothing appears outside it.
The same on the real stack (tansu, SeaweedFS, PostgreSQL) is in tests/service/test_fuzz_stack.py."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from ingest.intake import Intake
from ingest.job_request import JobRequestError, NewJob
from ingest.kafka_consumer import JobConsumer
from ingest.policy import FrontDoorPolicy
from ingest.s3_watcher import InboxEntry, InboxWatcher
from storage.models import Job, RejectedMessage
from storage.objectstore import S3Options, UnsafeURI, is_under

EXAMPLES = 10_000
BATCH = 10  # values per hypothesis example: its per-example cost is most of the time
BUCKET = "s3://fuzz-bucket"
FIELDS = ["input_uri", "rows", "output_uri", "model", "sampling", "engine", "speculative_config", "shard_size",
          "priority", "openai_output", "idempotency_key", "job_id", "cache_salt"]
HUGE = [2**31, -2**31 - 1, 2**63, 2**64, -1, 0, 10**30, 1.5, float("inf")]


@dataclass
class Record:
    topic: str
    partition: int
    offset: int
    value: bytes | None
    key: bytes | None = None


def json_values(max_leaves: int = 12):
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                       st.text(max_size=12), st.sampled_from(HUGE))
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=8), inner, max_size=3), max_leaves=max_leaves)


def uris(allowed: Path, outside: Path):
    return st.one_of(
        st.sampled_from([f"{outside}/x", f"file://{outside}/in.parquet", "/etc/passwd", f"{allowed}/../x",
                         f"{BUCKET}/inbox/../x", f"{BUCKET}//x", "s3://other-bucket/in.parquet", f"{BUCKET}/a\x00b",
                         f"{BUCKET}/" + "k" * 1100, "s3://", "http://h/x", "", f"file://{allowed}/\t"]),
        st.text(max_size=30).map(lambda t: f"{allowed}/{t}"),
        st.text(max_size=30).map(lambda t: f"{BUCKET}/results/{t}"),
        st.text(max_size=30))


def specs(allowed: Path | str, outside: Path | str, base: dict | None = None):
    """Valid specs (base) with random fields replaced, added or removed."""
    base = base or {"rows": [{"custom_id": "a", "prompt": "Hi"}], "output_uri": f"{allowed}/out",
                    "sampling": {"max_tokens": 2}}
    interesting = {
        "input_uri": uris(allowed, outside), "output_uri": uris(allowed, outside),
        "model": st.sampled_from(["smollm2-135m", "/root/.cache/tokenmill/models/smollm2-135m", "../x", "x" * 600,
                                  "unknown-model"]),
        "sampling": st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                                                     "n", "beam"]), st.one_of(json_values(4), st.sampled_from(HUGE)),
                                    max_size=3),
        "speculative_config": st.fixed_dictionaries({"method": st.sampled_from(["ngram", "draft", "self", "x"])},
                                                    optional={"model": uris(allowed, outside),
                                                              "prompt_lookup_max": st.sampled_from(HUGE),
                                                              "num_speculative_tokens": st.sampled_from(HUGE)}),
        "shard_size": st.sampled_from(HUGE), "priority": st.sampled_from(HUGE),
        "rows": st.lists(st.dictionaries(st.sampled_from(["custom_id", "prompt", "messages", "top_k"]),
                                         json_values(4), max_size=3), max_size=3),
    }
    replaced = st.dictionaries(st.sampled_from([*FIELDS, "unknown"]),
                               st.one_of(json_values(), *[st.deferred(lambda f=f: interesting[f])
                                                          for f in interesting]), max_size=3)
    return st.tuples(replaced, st.lists(st.sampled_from(FIELDS), max_size=2)).map(
        lambda change: {k: v for k, v in {**base, **change[0]}.items() if k not in change[1]})


def valid_specs(allowed: Path | str):
    """Specs that should become jobs: small valid variations."""
    return st.fixed_dictionaries(
        {"rows": st.lists(st.fixed_dictionaries({"custom_id": st.text(min_size=1, max_size=8),
                                                 "prompt": st.text(min_size=1, max_size=20)}), min_size=1, max_size=3),
         "output_uri": st.text(alphabet="abcxyz-_0123", min_size=1, max_size=20).map(lambda t: f"{allowed}/{t}")},
        optional={"sampling": st.fixed_dictionaries({"max_tokens": st.integers(1, 64)},
                                                    optional={"temperature": st.floats(0, 2),
                                                              "top_k": st.integers(0, 100),
                                                              "seed": st.integers(0, 2**63 - 1)}),
                  "priority": st.integers(-2**31 + 1, 2**31 - 1), "shard_size": st.integers(1, 10**6),
                  "cache_salt": st.text(min_size=1, max_size=20), "openai_output": st.booleans()})


def kafka_values(allowed: Path | str, outside: Path | str, base: dict | None = None):
    def dumps(document) -> bytes:
        return json.dumps(document, allow_nan=True).encode("utf-8", "surrogatepass")

    return st.one_of(
        st.none(), st.binary(max_size=40), json_values().map(dumps), specs(allowed, outside, base).map(dumps),
        valid_specs(allowed).map(dumps),
        specs(allowed, outside, base).map(dumps).map(lambda b: b[:len(b) // 2]),  # cut short
        st.integers(1, 3000).map(lambda n: b'{"rows": ' + b"[" * n + b"]" * n + b"}"),  # nested deep
        st.binary(min_size=1, max_size=8).map(lambda b: b'{"output_uri": "\xff' + b + b'"}'),  # not UTF-8
        st.integers(2**63, 2**200).map(lambda n: b'{"rows": [{"custom_id": "a", "prompt": "b"}], "output_uri": "x",'
                                                 b' "priority": ' + str(n).encode() + b"}"))


def batches(values):
    """BATCH (Kafka value, message key) pairs per example."""
    return st.lists(st.tuples(values, st.one_of(st.none(), st.binary(max_size=16))), min_size=BATCH, max_size=BATCH)


@pytest.fixture
def fuzz_intake(sqlite_sessions, tmp_path: Path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    policy = FrontDoorPolicy(inputs=(f"file://{allowed}", f"{BUCKET}/inbox"),
                             outputs=(f"file://{allowed}", f"{BUCKET}/results"), cache_isolation="source")
    intake = Intake(sqlite_sessions, S3Options(endpoint_url="http://127.0.0.1:9"), lambda job_id: None,
                    inline_uri=str(allowed / "inline"), policy=policy)
    return intake, allowed, outside


def check_jobs_inside(intake: Intake, policy: FrontDoorPolicy) -> int:
    with intake.sessions() as session:
        jobs = list(session.scalars(select(Job)))
    for job in jobs:
        assert any(is_under(job.input_uri, p) for p in policy.inputs), job.input_uri
        assert any(is_under(job.output_uri, p) for p in policy.outputs), job.output_uri
        assert len(job.idempotency_key) <= 255 and job.settings.cache_salt
    return len(jobs)


def test_random_kafka_values_are_each_a_job_inside_the_allow_list_or_refused(fuzz_intake) -> None:
    """The 10,000 through the consumer's own `job_of` (what `handle` stores): parsing, validation, the
    allow-lists and inline rows, short of the database (the 500 below go through `handle` whole)."""
    intake, allowed, outside = fuzz_intake
    consumer = JobConsumer(intake, "unused:9092", "jobs", "group", max_bytes=64 << 10)
    counts = {"job": 0, "refused": 0}
    offsets = iter(range(10**9))

    def job_of(value: bytes | None, key: bytes | None) -> NewJob | None:
        try:
            return consumer.job_of(Record("jobs", 0, next(offsets), value, key))
        except JobRequestError as error:
            assert str(error)
            return None

    @settings(max_examples=EXAMPLES // BATCH, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(messages=batches(kafka_values(allowed, outside)))
    def check(messages: list[tuple[bytes | None, bytes | None]]) -> None:
        for value, key in messages:
            new = job_of(value, key)  # raises nothing but assertion errors
            counts["job" if new else "refused"] += 1
            if new is not None:
                assert any(is_under(new.input_uri, p) for p in intake.policy.inputs), new.input_uri
                assert any(is_under(new.output_uri, p) for p in intake.policy.outputs), new.output_uri
                assert len(new.idempotency_key) <= 255 and new.settings.cache_salt and new.model == "smollm2-135m"

    started = time.monotonic()
    check()
    assert sum(counts.values()) == EXAMPLES and counts["job"] > EXAMPLES // 10 and counts["refused"] > EXAMPLES // 2, \
        counts
    print(f"{EXAMPLES} Kafka values: {counts}, {time.monotonic() - started:.0f} s")


def test_random_kafka_values_through_the_consumer_become_a_job_or_a_rejection(fuzz_intake) -> None:
    intake, allowed, outside = fuzz_intake
    consumer = JobConsumer(intake, "unused:9092", "jobs", "group", max_bytes=64 << 10)
    offsets = iter(range(10**9))
    outcomes: dict[int, str] = {}  # offset -> the job id, or "rejected"

    @settings(max_examples=EXAMPLES // 20 // BATCH, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(messages=batches(kafka_values(allowed, outside)))
    def handle(messages: list[tuple[bytes | None, bytes | None]]) -> None:
        for value, key in messages:
            offset = next(offsets)
            outcome = consumer.handle(Record("jobs", 0, offset, value, key))  # raises nothing
            assert outcome == "rejected" or len(outcome) == 36
            outcomes[offset] = outcome

    handle()
    seen = next(offsets)
    with intake.sessions() as session:
        errors = list(session.scalars(select(RejectedMessage.error)))
        rejected_at = set(session.scalars(select(RejectedMessage.offset)))
        recorded = {row.source_ref for row in session.scalars(select(Job))}
        job_ids = set(session.scalars(select(Job.id)))
    jobs = check_jobs_inside(intake, intake.policy)
    accepted = sum(outcome != "rejected" for outcome in outcomes.values())  # equal specs are one job
    assert seen == EXAMPLES // 20 == len(outcomes) and accepted > 10 and jobs and all(errors), (len(errors), jobs)
    # no message vanished: each one is a rejection recorded at its offset, or a job that exists
    assert rejected_at == {offset for offset, outcome in outcomes.items() if outcome == "rejected"}
    assert {outcome for outcome in outcomes.values() if outcome != "rejected"} == job_ids
    assert not any("cannot become a job" in e for e in errors), "every refusal is a JobRequestError naming the problem"
    assert len(recorded) == jobs
    assert not any(outside.rglob("*")), "nothing written outside the allow-list"


def test_random_inbox_keys_and_sidecars_become_a_job_or_a_recorded_error(fuzz_intake) -> None:
    intake, allowed, outside = fuzz_intake
    watcher = InboxWatcher(intake, f"{BUCKET}/inbox", f"{BUCKET}/results", max_bytes=64 << 10)
    keys = st.one_of(st.text(max_size=300), st.text(alphabet="ab./\x00\t", max_size=20),
                     st.integers(200, 1100).map(lambda n: "k" * n))
    def sidecar_of(spec: dict) -> bytes:
        kept = {k: v for k, v in spec.items() if k not in ("rows", "input_uri")}
        return json.dumps(kept, allow_nan=True).encode("utf-8", "surrogatepass")

    sidecars = st.one_of(st.just(b"{}"), specs(allowed, outside).map(sidecar_of))
    made = []

    @settings(max_examples=EXAMPLES // 20 // BATCH, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(objects=st.lists(st.tuples(keys, sidecars, st.text(alphabet="0123456789abcdef", min_size=1, max_size=40)),
                            min_size=BATCH, max_size=BATCH))
    def take(objects: list[tuple[str, bytes, str]]) -> None:
        for name, sidecar, etag in objects:
            entry = InboxEntry(f"inbox/{name}", etag, datetime.now(UTC) - timedelta(minutes=1))
            try:
                made.append(watcher.accept(entry, sidecar).job)
            except (JobRequestError, UnsafeURI):
                pass

    take()
    assert check_jobs_inside(intake, intake.policy) >= 10 and made
