"""#56: the running API driven from its own OpenAPI schema by Schemathesis, with two tenants' keys. Tenant acme
owns an upload (holding a marker string) and a batch; every generated request is sent as tenant other: none
answers 5xx, every answer fits the schema where the schema documents it, and no answer holds an id or a byte of
acme's. `make test` sends about 300 requests; the full run (5,000):

    TOKENMILL_API_FUZZ_REQUESTS=5000 .venv/bin/pytest -q tests/jobs/test_api_fuzz.py
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from tests.jobs.test_openai_api import chat_line, client, jsonl, running_api

REQUESTS = int(os.environ.get("TOKENMILL_API_FUZZ_REQUESTS", "300"))
MARKER = "acme-private-3f9a1c"  # a byte string only acme's upload holds


@pytest.fixture
def parked(sessions, tmp_path):
    with running_api(sessions, str(tmp_path / "bucket"), None, dispatch=lambda job_id: None) as running:
        yield running


def test_generated_requests_get_no_5xx_fit_the_schema_and_see_nothing_of_another_tenant(parked) -> None:
    base_url, key, other_key, _ = parked
    acme = client(base_url, key)
    upload = acme.files.create(file=("mine.jsonl", jsonl([chat_line("acme-row", content=MARKER)])), purpose="batch")
    batch = acme.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    secrets = {upload.id, batch.id, MARKER, "mine.jsonl"}

    request = urllib.request.Request(f"{base_url.removesuffix('/v1')}/openapi.json",
                                     headers={"Authorization": f"Bearer {other_key}"})
    spec = json.loads(urllib.request.urlopen(request, timeout=10).read())
    schema = schemathesis.openapi.from_dict(spec)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8, [op.label for op in operations]
    headers = {"Authorization": f"Bearer {other_key}"}
    root = base_url.removesuffix("/v1")
    sent, problems, statuses = [], [], Counter()
    started = time.monotonic()

    theirs = client(base_url, other_key).files.create(file=("theirs.jsonl", jsonl([chat_line("r")])), purpose="batch")
    ids = [upload.id, batch.id, theirs.id]  # acme's (never to be found by other) and other's own

    def aimed(case, pick: str | None, valid_purpose: bool):
        """Some cases aim at real ids (acme's or other's); half give valid values where most values are refused."""
        if pick is not None:
            for name in ("file_id", "batch_id"):
                if name in (case.path_parameters or {}):
                    case.path_parameters[name] = pick
            if isinstance(case.body, dict) and "input_file_id" in case.body:
                case.body["input_file_id"] = pick
        if valid_purpose and isinstance(case.body, dict):
            for name, value in (("purpose", "batch"), ("endpoint", "/v1/chat/completions"),
                                ("completion_window", "24h")):
                if name in case.body:
                    case.body[name] = value
        return case

    def fuzzer(operation):
        @given(case=operation.as_strategy(), pick=st.sampled_from([None, *ids]), valid_purpose=st.booleans())
        @settings(max_examples=-(-REQUESTS // len(operations)), deadline=None, database=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck), derandomize=True)
        def fuzz(case, pick, valid_purpose) -> None:
            case = aimed(case, pick, valid_purpose)
            response = case.call(base_url=root, headers=headers, timeout=30)
            sent.append(operation.label)
            statuses[f"{operation.label} {response.status_code}"] += 1
            try:
                case.validate_response(response, checks=[not_a_server_error, response_schema_conformance,
                                                         content_type_conformance], headers=headers)
            except Exception as failure:
                problems.append(f"{operation.label}: {type(failure).__name__}: {str(failure)[:300]}")
            asked = f"{case.path_parameters} {case.query} {case.body}"  # an id echoed back in a 404 is no leak
            if leaked := [secret for secret in secrets if secret in response.text and secret not in asked]:
                problems.append(f"{operation.label} as tenant other shows acme's {leaked}")

        return fuzz

    for operation in sorted(operations, key=lambda op: op.method.upper() == "DELETE"):  # other's file goes last
        fuzzer(operation)()

    print(f"{len(sent)} requests in {time.monotonic() - started:.0f} s, {len(problems)} problems:",
          dict(sorted(statuses.items())))
    assert len(sent) >= 0.9 * REQUESTS, len(sent)
    assert {label.split()[0] for label in sent} >= {"GET", "POST", "DELETE"}
    assert not problems, "\n".join(sorted(set(problems))[:20])
    assert acme.files.retrieve(upload.id).id == upload.id and acme.batches.retrieve(batch.id).id == batch.id
    assert any(f"{status}".endswith(" 200") for status in statuses if "{file_id}" in status)  # other's own id
