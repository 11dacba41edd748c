"""The OpenAI Batch API that `tokenmill stack up` starts, judged by the official SDK with no arguments but the
environment `tokenmill stack env --show-secrets` exports: files, a batch run by the stack's workers, its
content, a refused line, a cancel with its finished rows, and the errors (a wrong key, another tenant's batch)."""

from __future__ import annotations

import json
import shlex

import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.jobs.test_openai_api import MODEL, TERMINAL, chat_line, submit, wait_for

pytestmark = pytest.mark.real_model


def exported(stack) -> dict[str, str]:
    lines = stack.cli("stack", "env", "--show-secrets").stdout.splitlines()
    return dict(shlex.split(line.removeprefix("export "))[0].split("=", 1) for line in lines
                if line.startswith("export OPENAI_"))


def test_the_sdk_runs_a_batch_on_the_stack_and_cancels_another(stack, monkeypatch) -> None:
    for name, value in exported(stack).items():
        monkeypatch.setenv(name, value)
    sdk = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from `stack env --show-secrets`
    refused = submit(sdk, [chat_line("ok"), chat_line("foreign", "gpt-5")])
    assert refused.status == "failed" and [(e.line, e.code) for e in refused.errors.data] == [(2, "model_not_found")]
    batch = submit(sdk, [chat_line("ok", temperature=0, max_tokens=4), chat_line("bad", temperature=-1)])
    batch = wait_for(sdk, batch.id, TERMINAL, timeout_s=240)
    assert batch.status == "completed", batch.errors
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    [line] = [json.loads(text) for text in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert ChatCompletion.model_validate(line["response"]["body"]).model == MODEL
    [error] = [json.loads(text) for text in sdk.files.content(batch.error_file_id).text.splitlines()]
    assert error["response"]["body"]["error"]["code"] == "invalid_parameter" and error["custom_id"] == "bad"

    long = submit(sdk, [chat_line(f"long-{i}", max_tokens=256, min_tokens=256, seed=i) for i in range(8)])
    wait_for(sdk, long.id, {"in_progress", *TERMINAL}, timeout_s=120)
    sdk.batches.cancel(long.id)
    long = wait_for(sdk, long.id, TERMINAL, timeout_s=120)
    assert long.status == "cancelled" and long.request_counts.completed < 8
    finished = sdk.files.content(long.output_file_id).text.splitlines() if long.output_file_id else []
    unrun = [json.loads(text) for text in sdk.files.content(long.error_file_id).text.splitlines()]
    assert len(finished) == long.request_counts.completed and len(unrun) == long.request_counts.failed
    assert len(finished) + len(unrun) == 8 and {line["error"]["code"] for line in unrun} == {"batch_cancelled"}

    other_key = stack.cli("api", "key", "create", "--tenant", "other").stdout.strip()
    other = openai.OpenAI(api_key=other_key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="tm-wrong", max_retries=0).batches.list()
