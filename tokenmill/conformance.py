"""Conformance of a running tokenmill API, judged by the official `openai` and `anthropic` SDKs (issue #57): every
batch call of each API, a cancel mid-run, an expiry, a request that fails inside the run, another tenant's key
getting 404 on every id, and the SDKs' retries never looping (each call sends one HTTP request).

`run_conformance` drives both APIs, prints a table of its checks and returns them; `tokenmill api conformance`
runs it against a deployment. It leaves nothing behind: its files and message batches are deleted at the end."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

PASS, FAIL, SKIP = "pass", "fail", "skip"
OPENAI, ANTHROPIC = "openai", "anthropic"
TERMINAL = {"completed", "failed", "cancelled", "expired"}
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")

# The checks each API must have; a run returns each once, in this order.
OPENAI_CHECKS = ("files.create", "files.retrieve", "files.content", "files.list",
                 *(f"batches.create {endpoint}" for endpoint in ENDPOINTS), "batches.retrieve",
                 *(f"{endpoint} lines" for endpoint in ENDPOINTS), "a request failing in the run", "batches.list",
                 "batches.cancel of an ended batch", "batches.cancel mid-run", "expiry", "another tenant gets 404",
                 "files.delete", "no SDK retries")
ANTHROPIC_CHECKS = ("messages.batches.create", "messages.batches.retrieve", "messages.batches.results",
                    "a request failing in the run", "messages.batches.list (paged)", "messages.batches.cancel mid-run",
                    "expiry", "another tenant gets 404", "messages.batches.delete", "no SDK retries")

COLOR = "Name a color."
ESSAY = "Write a very long essay on the history of Rome, in twenty parts."


@dataclass
class CheckResult:
    api: str
    name: str
    status: str  # pass, fail or skip
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASS


class Skipped(Exception):
    """The server cannot be judged on this check (the note says why)."""


class CheckFailed(AssertionError):
    pass


def need(condition: Any, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


class Wire:
    """Counts the HTTP requests an SDK client sends, retries included (an httpx request hook)."""

    def __init__(self) -> None:
        self.sent = 0

    def __call__(self, _request) -> None:
        self.sent += 1


@dataclass
class Calls:
    """Every SDK call made through `call`, with the HTTP requests it sent: `http_requests` (one, but two for the
    Anthropic SDK's results, which reads the batch's `results_url` first), else the SDK retried."""

    wire: Wire
    counted: int = 0
    retried: list[str] = field(default_factory=list)

    def call(self, label: str, fn: Callable, *args, http_requests: int = 1, **kwargs):
        before = self.wire.sent
        try:
            return fn(*args, **kwargs)
        finally:
            self.counted += 1
            if (sent := self.wire.sent - before) != http_requests:
                self.retried.append(f"{label}: {sent} requests, not {http_requests}")

    def refused(self, label: str, status: int, fn: Callable, *args, **kwargs):
        """The API error of a call that must be answered `status`."""
        try:
            self.call(label, fn, *args, **kwargs)
        except Exception as error:
            code = getattr(error, "status_code", None)
            need(code == status, f"{label}: {status} expected, got {code or type(error).__name__}: {error}")
            return error
        raise CheckFailed(f"{label}: {status} expected, the call succeeded")

    def verdict(self) -> str:
        need(self.counted, "no calls were made")
        need(not self.retried, "; ".join(self.retried[:5]))
        return f"{self.counted} calls, none retried (max_retries=2)"


class Checks:
    """Runs named checks in order; an exception fails a check, `Skipped` skips it."""

    def __init__(self, api: str) -> None:
        self.api, self.results = api, []

    def run(self, name: str, check: Callable[[], str | None]) -> None:
        try:
            result = CheckResult(self.api, name, PASS, check() or "")
        except Skipped as note:
            result = CheckResult(self.api, name, SKIP, str(note))
        except Exception as error:
            text = str(error).replace("\n", " ")
            result = CheckResult(self.api, name, FAIL, f"{type(error).__name__}: {text[:300]}")
        self.results.append(result)


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def waiting(timeout_s: float, what: str, poll_s: float = 0.2) -> Iterator[None]:
    """Yields until the caller breaks out; CheckFailed after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        yield
        need(time.monotonic() < deadline, f"{what} after {timeout_s:.0f} s")
        time.sleep(poll_s)


# ---- OpenAI ------------------------------------------------------------------------------------------------------

class OpenAIConformance:
    def __init__(self, base_url: str, key: str, other_key: str, model: str, embedding_model: str | None,
                 embedding_base_url: str | None, long_tokens: int, expire: Callable[[str], None] | None,
                 expiry_window_s: int, timeout_s: float) -> None:
        import openai

        self.openai, self.model, self.long_tokens = openai, model, long_tokens
        self.expire, self.expiry_window_s, self.timeout_s = expire, expiry_window_s, timeout_s
        self.calls = Calls(Wire())
        self.sdk = self._client(base_url, key, self.calls.wire)
        self.other = self._client(base_url, other_key, self.calls.wire)
        self.embedding_model = embedding_model
        self.embedder = self._client(embedding_base_url or base_url, key, self.calls.wire)
        self.upload = None
        self.batches: dict[str, Any] = {}  # endpoint -> its batch, once created
        self.ended: dict[str, Any] = {}
        self.files: dict[str, Any] = {}  # every file id made -> the client that made it
        self.batch_ids: list[str] = []

    def _client(self, base_url: str, key: str, wire: Wire):
        return self.openai.OpenAI(base_url=base_url, api_key=key, max_retries=2, timeout=60,
                                  http_client=self.openai.DefaultHttpxClient(event_hooks={"request": [wire]}))

    def checks(self) -> list[tuple[str, Callable]]:
        return [("files.create", self.files_create), ("files.retrieve", self.files_retrieve),
                ("files.content", self.files_content), ("files.list", self.files_list),
                *((f"batches.create {endpoint}", lambda e=endpoint: self.batches_create(e)) for endpoint in ENDPOINTS),
                ("batches.retrieve", self.batches_retrieve),
                ("/v1/chat/completions lines", self.chat_lines), ("/v1/completions lines", self.completion_lines),
                ("/v1/responses lines", self.response_lines), ("/v1/embeddings lines", self.embedding_lines),
                ("a request failing in the run", self.failing_request), ("batches.list", self.batches_list),
                ("batches.cancel of an ended batch", self.cancel_ended),
                ("batches.cancel mid-run", self.cancel_mid_run),
                ("expiry", self.expiry), ("another tenant gets 404", self.other_tenant),
                ("files.delete", self.files_delete), ("no SDK retries", self.calls.verdict)]

    # -- requests

    def line(self, custom_id: str, endpoint: str, max_tokens: int = 4, prompt: str = COLOR, **body) -> dict:
        if endpoint == "/v1/chat/completions":
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, **body}
        elif endpoint == "/v1/completions":
            body = {"prompt": prompt, "max_tokens": max_tokens, **body}
        elif endpoint == "/v1/responses":
            body = {"input": prompt, "instructions": "Answer in one word.", "max_output_tokens": max_tokens, **body}
        else:
            body = {"input": [prompt, "The sea is blue."], **body}
        model = self.embedding_model if endpoint == "/v1/embeddings" else self.model
        return {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": {"model": model, **body}}

    def chat_input(self) -> list[dict]:
        return [self.line("ok-0", ENDPOINTS[0], temperature=0), self.line("ok-1", ENDPOINTS[0], seed=1),
                self.line("bad-temperature", ENDPOINTS[0], temperature=-1)]  # valid JSON, refused by the run

    def create_file(self, sdk, lines: list[dict], name: str = "conformance.jsonl"):
        upload = self.calls.call("files.create", sdk.files.create, file=(name, jsonl(lines)), purpose="batch")
        self.files[upload.id] = sdk
        return upload

    def create_batch(self, sdk, lines: list[dict], endpoint: str, window: str = "24h"):
        upload = self.create_file(sdk, lines)
        batch = self.calls.call("batches.create", sdk.batches.create, input_file_id=upload.id, endpoint=endpoint,
                                completion_window=window, metadata={"check": "conformance"})
        self.batch_ids.append(batch.id)
        return batch

    def wait(self, sdk, batch_id: str, done: Callable[[Any], bool] = lambda b: b.status in TERMINAL,
             timeout_s: float | None = None):
        for _ in waiting(timeout_s or self.timeout_s, f"batch {batch_id} not ended"):
            batch = self.calls.call("batches.retrieve", sdk.batches.retrieve, batch_id)
            if done(batch):
                return batch

    def lines(self, sdk, file_id: str | None) -> list[dict]:
        if file_id is None:
            return []
        self.files[file_id] = sdk
        content = self.calls.call("files.content", sdk.files.content, file_id)
        return [json.loads(line) for line in content.text.splitlines() if line.strip()]

    # -- files

    def files_create(self) -> str:
        from openai.types import FileObject

        upload = self.upload = self.create_file(self.sdk, self.chat_input())
        need(isinstance(upload, FileObject) and upload.id, "no file object")
        need(upload.purpose == "batch" and upload.bytes == len(jsonl(self.chat_input())),
             f"purpose {upload.purpose!r}, {upload.bytes} bytes")
        need(upload.filename == "conformance.jsonl", f"filename {upload.filename!r}")
        return upload.id

    def files_retrieve(self) -> None:
        need(self.upload, "no upload")
        found = self.calls.call("files.retrieve", self.sdk.files.retrieve, self.upload.id)
        need((found.id, found.bytes, found.filename) == (self.upload.id, self.upload.bytes, self.upload.filename),
             f"retrieved {found}")

    def files_content(self) -> None:
        need(self.upload, "no upload")
        content = self.calls.call("files.content", self.sdk.files.content, self.upload.id).content
        need(content == jsonl(self.chat_input()), "the content is not the upload's bytes")

    def files_list(self) -> None:
        need(self.upload, "no upload")
        first = self.calls.call("files.list", self.sdk.files.list, purpose="batch", limit=1)
        need([f.id for f in first.data] == [self.upload.id], f"newest first: {[f.id for f in first.data]}")
        ascending = self.calls.call("files.list", self.sdk.files.list, limit=10000, order="asc").data
        need(ascending and ascending[-1].id == self.upload.id, "order=asc does not end with the upload")
        if first.has_next_page():
            page = self.calls.call("files.list next page", first.get_next_page)
            need(self.upload.id not in [f.id for f in page.data], "the next page repeats the upload")

    # -- batches

    def batches_create(self, endpoint: str) -> str:
        if endpoint == "/v1/embeddings" and not self.embedding_model:
            raise Skipped("no embedding model given (--embedding-model): /v1/embeddings not checked")
        if endpoint == "/v1/chat/completions":
            need(self.upload, "no upload")
            batch = self.calls.call("batches.create", self.sdk.batches.create, input_file_id=self.upload.id,
                                    endpoint=endpoint, completion_window="24h", metadata={"check": "conformance"})
            self.batch_ids.append(batch.id)
        else:
            sdk = self.embedder if endpoint == "/v1/embeddings" else self.sdk
            batch = self.create_batch(sdk, [self.line(f"{endpoint.rsplit('/', 1)[1]}-{i}", endpoint)
                                            for i in range(2)], endpoint)
        self.batches[endpoint] = batch
        need(batch.id and batch.object == "batch" and batch.endpoint == endpoint, f"batch {batch}")
        need(batch.status in {"validating", "in_progress"}, f"created {batch.status}")
        need(batch.completion_window == "24h" and batch.metadata == {"check": "conformance"},
             f"window {batch.completion_window!r}, metadata {batch.metadata}")
        return batch.id

    def batches_retrieve(self) -> str:
        need(self.batches, "no batch was created")
        for endpoint, batch in self.batches.items():
            sdk = self.embedder if endpoint == "/v1/embeddings" else self.sdk
            ended = self.ended[endpoint] = self.wait(sdk, batch.id)
            need(ended.status == "completed", f"{endpoint}: {ended.status} {ended.errors}")
            counts = ended.request_counts
            need(counts.completed + counts.failed == counts.total, f"{endpoint}: counts {counts}")
            need(ended.completed_at >= ended.in_progress_at >= ended.created_at, f"{endpoint}: times out of order")
        return f"{len(self.ended)} batches completed"

    def outputs(self, endpoint: str, expected: int) -> list[dict]:
        batch = self.ended.get(endpoint)
        need(batch, f"no {endpoint} batch ended")
        lines = self.lines(self.embedder if endpoint == "/v1/embeddings" else self.sdk, batch.output_file_id)
        need(len(lines) == expected == batch.request_counts.completed,
             f"{len(lines)} output lines, {batch.request_counts.completed} completed, {expected} expected")
        for line in lines:
            need(line["error"] is None and line["response"]["status_code"] == 200, f"line {line}")
        return lines

    def chat_lines(self) -> None:
        from openai.types.chat import ChatCompletion

        lines = self.outputs(ENDPOINTS[0], 2)
        need(sorted(line["custom_id"] for line in lines) == ["ok-0", "ok-1"], "custom_ids")
        for line in lines:
            completion = ChatCompletion.model_validate(line["response"]["body"])
            need(completion.model == self.model and completion.choices[0].message.role == "assistant",
                 f"{completion}")
            need(0 < completion.usage.completion_tokens <= 4, f"usage {completion.usage}")

    def completion_lines(self) -> None:
        from openai.types import Completion

        for line in self.outputs(ENDPOINTS[1], 2):
            completion = Completion.model_validate(line["response"]["body"])
            need(completion.object == "text_completion" and completion.choices[0].text is not None, f"{completion}")

    def response_lines(self) -> None:
        from openai.types.responses import Response

        for line in self.outputs(ENDPOINTS[2], 2):
            response = Response.model_validate(line["response"]["body"])
            need(response.object == "response" and response.status in {"completed", "incomplete"}, f"{response}")
            need(response.output_text is not None and response.usage.output_tokens <= 4, f"{response.usage}")

    def embedding_lines(self) -> None:
        from openai.types import CreateEmbeddingResponse

        if not self.embedding_model:
            raise Skipped("no embedding model given")
        for line in self.outputs(ENDPOINTS[3], 2):
            response = CreateEmbeddingResponse.model_validate(line["response"]["body"])
            need(len(response.data) == 2 and len(response.data[0].embedding) > 0, f"{len(response.data)} vectors")

    def failing_request(self) -> str:
        from openai.types.shared import ErrorObject

        batch = self.ended.get(ENDPOINTS[0])
        need(batch, "no chat batch ended")
        counts = batch.request_counts
        need((batch.status, counts.total, counts.completed, counts.failed) == ("completed", 3, 2, 1),
             f"{batch.status} with {counts}")
        [line] = self.lines(self.sdk, batch.error_file_id) or [None]
        need(line and line["custom_id"] == "bad-temperature" and line["error"] is None, f"error line {line}")
        response = line["response"]
        need(response["status_code"] == 400 and response["request_id"] == line["id"], f"response {response}")
        error = ErrorObject.model_validate(response["body"]["error"])
        need((error.type, error.code) == ("invalid_request_error", "invalid_parameter"), f"error {error}")
        return "temperature -1 (a per-line check of the run): 400 invalid_parameter in the error file"

    def batches_list(self) -> None:
        need(len(self.batch_ids) >= 3, "fewer than 3 batches")
        newest = self.batch_ids[::-1]
        first = self.calls.call("batches.list", self.sdk.batches.list, limit=2)
        need([b.id for b in first.data] == newest[:2] and first.has_more, f"first page {[b.id for b in first.data]}")
        second = self.calls.call("batches.list next page", first.get_next_page)
        need([b.id for b in second.data] == newest[2:4], f"next page {[b.id for b in second.data]}")

    def cancel_ended(self) -> None:
        batch = self.ended.get(ENDPOINTS[0])
        need(batch, "no chat batch ended")
        error = self.calls.refused("batches.cancel (ended)", 409, self.sdk.batches.cancel, batch.id)
        need(error.response.headers.get("x-should-retry") == "false", "409 without x-should-retry: false")

    def long_input(self, prefix: str) -> list[dict]:
        lines = [self.line(f"{prefix}-short-{i}", ENDPOINTS[0], 2, seed=i) for i in range(2)]
        return lines + [self.line(f"{prefix}-long-{i}", ENDPOINTS[0], self.long_tokens, ESSAY,
                                  min_tokens=self.long_tokens, seed=i) for i in range(4)]

    def started(self, batch_id: str) -> Any:
        """The batch once in progress and, for up to 2 s more, once a request finished."""
        running_since: list[float] = []

        def running(batch) -> bool:
            if batch.status != "in_progress":
                return batch.status in TERMINAL
            running_since[:] = running_since or [time.monotonic()]
            return batch.request_counts.completed > 0 or time.monotonic() - running_since[0] > 2

        return self.wait(self.sdk, batch_id, running)

    def stopped_mid_run(self, batch, prefix: str, status: str, code: str) -> str:
        counts = batch.request_counts
        need(batch.status == status, f"{batch.status}, not {status}: {batch.errors}")
        need(counts.total == 6 and counts.completed + counts.failed == 6, f"counts {counts}")
        finished = self.lines(self.sdk, batch.output_file_id)
        unrun = self.lines(self.sdk, batch.error_file_id)
        need(len(finished) == counts.completed and len(unrun) == counts.failed,
             f"{len(finished)} + {len(unrun)} lines for {counts}")
        ids = [line["custom_id"] for line in finished + unrun]
        need(sorted(ids) == sorted(line["custom_id"] for line in self.long_input(prefix)),
             "not every custom_id once across the output and error files")
        need(unrun and {line["error"]["code"] for line in unrun} == {code},
             f"unrun lines {[line['error'] for line in unrun]} (did the batch end before it was stopped? "
             f"raise --long-tokens)")
        return f"{counts.completed} finished, {counts.failed} {code}"

    def cancel_mid_run(self) -> str:
        batch = self.create_batch(self.sdk, self.long_input("cancel"), ENDPOINTS[0])
        batch = self.started(batch.id)
        need(batch.status == "in_progress", f"{batch.status} before the cancel (raise --long-tokens)")
        cancelling = self.calls.call("batches.cancel", self.sdk.batches.cancel, batch.id)
        need(cancelling.status in {"cancelling", "cancelled"} and cancelling.cancelling_at, f"{cancelling.status}")
        ended = self.wait(self.sdk, batch.id)
        need(ended.cancelled_at and ended.cancelled_at >= ended.cancelling_at, "cancelled_at")
        return self.stopped_mid_run(ended, "cancel", "cancelled", "batch_cancelled")

    def expiry(self) -> str:
        if self.expire:
            batch = self.started(self.create_batch(self.sdk, self.long_input("expire"), ENDPOINTS[0]).id)
            need(batch.status == "in_progress", f"{batch.status} before the expiry (raise --long-tokens)")
            self.expire(batch.id)
            how = "the expiry hook"
        else:
            window = f"{self.expiry_window_s}s"
            try:
                batch = self.create_batch(self.sdk, self.long_input("expire"), ENDPOINTS[0], window)
            except self.openai.BadRequestError as error:
                raise Skipped(f"completion_window {window!r} refused ({error.code}): serve with "
                              f"--max-completion-window to check expiry") from None
            how = f"completion_window {window}"
        try:
            ended = self.wait(self.sdk, batch.id, timeout_s=self.timeout_s + self.expiry_window_s)
        except CheckFailed:  # never expired: stop it
            self.calls.call("batches.cancel", self.sdk.batches.cancel, batch.id)
            raise
        need(ended.expired_at, f"{ended.status}, not expired, past its deadline ({how})")
        return f"{how}: " + self.stopped_mid_run(ended, "expire", "expired", "batch_expired")

    # -- tenants and cleanup

    def other_tenant(self) -> str:
        need(self.files and self.batch_ids, "nothing was made")
        other, calls = self.other, self.calls
        ours = {file_id for file_id, sdk in self.files.items() if sdk is self.sdk}  # on this server
        for file_id in sorted(ours):
            for name, fn in (("files.retrieve", other.files.retrieve), ("files.content", other.files.content),
                             ("files.delete", other.files.delete)):
                calls.refused(f"{name} (other tenant)", 404, fn, file_id)
        for batch_id in self.batch_ids:
            for name, fn in (("batches.retrieve", other.batches.retrieve), ("batches.cancel", other.batches.cancel)):
                calls.refused(f"{name} (other tenant)", 404, fn, batch_id)
        listed = calls.call("files.list (other tenant)", other.files.list, limit=10000).data
        need(not ours & {f.id for f in listed}, "the other tenant lists our files")
        batches = calls.call("batches.list (other tenant)", other.batches.list, limit=100).data
        need(not set(self.batch_ids) & {b.id for b in batches}, "the other tenant lists our batches")
        calls.call("files.retrieve", self.sdk.files.retrieve, self.upload.id)  # not deleted by the other tenant
        return f"{len(ours)} files x 3 calls, {len(self.batch_ids)} batches x 2 calls"

    def files_delete(self) -> str:
        need(self.upload, "no upload")
        deleted = self.calls.call("files.delete", self.sdk.files.delete, self.upload.id)
        need(deleted.deleted and deleted.id == self.upload.id, f"{deleted}")
        self.calls.refused("files.retrieve (deleted)", 404, self.sdk.files.retrieve, self.upload.id)
        for file_id, sdk in self.files.items():  # the rest: inputs and results
            if file_id != self.upload.id:
                self.calls.call("files.delete", sdk.files.delete, file_id)
        return f"{len(self.files)} files deleted"


# ---- Anthropic ---------------------------------------------------------------------------------------------------

class AnthropicConformance:
    def __init__(self, base_url: str, key: str, other_key: str, model: str, long_tokens: int,
                 expire: Callable[[str], None] | None, timeout_s: float) -> None:
        import anthropic

        self.anthropic, self.model, self.long_tokens = anthropic, model, long_tokens
        self.expire, self.timeout_s = expire, timeout_s
        self.calls = Calls(Wire())
        self.sdk, self.other = self._client(base_url, key), self._client(base_url, other_key)
        self.batch = self.ended = None
        self.batch_ids: list[str] = []

    def _client(self, base_url: str, key: str):
        return self.anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=2, timeout=60,
                                        http_client=self.anthropic.DefaultHttpxClient(
                                            event_hooks={"request": [self.calls.wire]}))

    def checks(self) -> list[tuple[str, Callable]]:
        return [("messages.batches.create", self.create), ("messages.batches.retrieve", self.retrieve),
                ("messages.batches.results", self.results), ("a request failing in the run", self.failing_request),
                ("messages.batches.list (paged)", self.list_paged), ("messages.batches.cancel mid-run", self.cancel),
                ("expiry", self.expiry), ("another tenant gets 404", self.other_tenant),
                ("messages.batches.delete", self.delete), ("no SDK retries", self.calls.verdict)]

    def request(self, custom_id: str, max_tokens: int = 4, prompt: str = COLOR, **params) -> dict:
        return {"custom_id": custom_id, "params": {"model": self.model, "max_tokens": max_tokens,
                                                   "messages": [{"role": "user", "content": prompt}], **params}}

    def submit(self, requests: list[dict]):
        batch = self.calls.call("messages.batches.create", self.sdk.messages.batches.create, requests=requests)
        self.batch_ids.append(batch.id)
        return batch

    def wait(self, batch_id: str):
        for _ in waiting(self.timeout_s, f"message batch {batch_id} not ended"):
            batch = self.calls.call("messages.batches.retrieve", self.sdk.messages.batches.retrieve, batch_id)
            if batch.processing_status == "ended":
                return batch

    def results_of(self, batch_id: str) -> dict[str, Any]:
        lines = list(self.calls.call("messages.batches.results", self.sdk.messages.batches.results, batch_id,
                                     http_requests=2))
        by_id = {line.custom_id: line for line in lines}
        need(len(by_id) == len(lines), "a custom_id twice in the results")
        return by_id

    def create(self) -> str:
        batch = self.batch = self.submit([self.request("ok-0", temperature=0), self.request("ok-1", top_k=5),
                                          self.request("unknown-model", model="claude-not-served-here")])
        need(batch.id.startswith("msgbatch_") and batch.type == "message_batch", f"{batch.id} {batch.type}")
        need(batch.processing_status == "in_progress" and batch.results_url is None and batch.ended_at is None,
             f"{batch.processing_status}, results_url {batch.results_url}")
        need(batch.request_counts.processing == 3 and batch.expires_at > batch.created_at, f"{batch.request_counts}")
        return batch.id

    def retrieve(self) -> None:
        need(self.batch, "no batch")
        ended = self.ended = self.wait(self.batch.id)
        counts = ended.request_counts
        need((counts.succeeded, counts.errored, counts.processing) == (2, 1, 0), f"counts {counts}")
        need(ended.ended_at >= ended.created_at and ended.results_url, "ended_at, results_url")

    def results(self) -> None:
        from anthropic.types import Message

        need(self.ended, "no batch ended")
        by_id = self.results_of(self.ended.id)
        need(sorted(by_id) == ["ok-0", "ok-1", "unknown-model"], f"custom_ids {sorted(by_id)}")
        for custom_id in ("ok-0", "ok-1"):
            result = by_id[custom_id].result
            need(result.type == "succeeded" and isinstance(result.message, Message), f"{custom_id}: {result.type}")
            message = result.message
            need(message.role == "assistant" and message.content[0].type == "text", f"{message}")
            need(message.stop_reason in {"end_turn", "max_tokens"} and 0 < message.usage.output_tokens <= 4,
                 f"stop {message.stop_reason}, usage {message.usage}")

    def failing_request(self) -> str:
        need(self.ended, "no batch ended")
        result = self.results_of(self.ended.id)["unknown-model"].result
        need(result.type == "errored" and result.error.error.type == "not_found_error", f"{result}")
        return "an unserved model: errored, not_found_error, the others succeeded"

    def list_paged(self) -> str:
        need(self.batch, "no batch")
        more = [self.submit([self.request(f"page-{i}", 1)]).id for i in range(2)]
        newest = [*more[::-1], self.batch.id]
        list_ = self.sdk.messages.batches.list
        first = self.calls.call("messages.batches.list", list_, limit=2)
        need([b.id for b in first.data] == newest[:2] and first.has_more, f"first page {[b.id for b in first.data]}")
        need((first.first_id, first.last_id) == (newest[0], newest[1]), f"first_id/last_id {first.first_id}")
        second = self.calls.call("messages.batches.list next page", first.get_next_page)  # after_id=last_id
        need([b.id for b in second.data][:1] == newest[2:], f"next page {[b.id for b in second.data]}")
        before = self.calls.call("messages.batches.list", list_, limit=1, before_id=newest[2])
        need([b.id for b in before.data] == [newest[1]] and before.has_more, f"before_id {[b.id for b in before.data]}")
        newer = self.calls.call("messages.batches.list next page", before.get_next_page)  # before_id=first_id
        need([b.id for b in newer.data] == [newest[0]], f"before_id's next page {[b.id for b in newer.data]}")
        for batch_id in more:
            self.wait(batch_id)
        return "limit, after_id and before_id, the SDK's next pages"

    def long_batch(self, prefix: str):
        return self.submit([self.request(f"{prefix}-short-{i}", 2) for i in range(2)] +
                           [self.request(f"{prefix}-long-{i}", self.long_tokens, ESSAY) for i in range(4)])

    def stopped(self, batch_id: str, kind: str) -> str:
        ended = self.wait(batch_id)
        counts = ended.request_counts
        stopped = getattr(counts, kind)
        need(counts.processing == counts.errored == 0 and stopped and counts.succeeded + stopped == 6,
             f"counts {counts} (did the batch end before it was stopped? raise --long-tokens)")
        by_id = self.results_of(batch_id)
        need(len(by_id) == 6 and sum(line.result.type == kind for line in by_id.values()) == stopped,
             f"results {[line.result.type for line in by_id.values()]}")
        return f"{counts.succeeded} succeeded, {stopped} {kind}"

    def cancel(self) -> str:
        batch = self.long_batch("cancel")
        time.sleep(1)  # into the run
        sdk = self.sdk.messages.batches
        self.calls.refused("GET .../results (running)", 400, self.sdk.get,  # the SDK asks only once ended
                           f"/v1/messages/batches/{batch.id}/results", cast_to=object)
        error = self.calls.refused("messages.batches.delete (running)", 400, sdk.delete, batch.id)
        need(error.response.headers.get("x-should-retry") == "false", "400 without x-should-retry: false")
        canceling = self.calls.call("messages.batches.cancel", sdk.cancel, batch.id)
        need(canceling.processing_status in {"canceling", "ended"} and canceling.cancel_initiated_at,
             f"{canceling.processing_status}")
        verdict = self.stopped(batch.id, "canceled")
        again = self.calls.call("messages.batches.cancel (ended)", sdk.cancel, batch.id)
        need(again.processing_status == "ended", "an ended batch's cancel changed it")
        return verdict

    def expiry(self) -> str:
        if not self.expire:
            raise Skipped("a message batch's window is Anthropic's fixed 24 hours: no quick expiry from outside")
        batch = self.long_batch("expire")
        time.sleep(1)
        self.expire(batch.id)
        return "the expiry hook: " + self.stopped(batch.id, "expired")

    def other_tenant(self) -> str:
        need(self.batch_ids, "no batches")
        sdk, calls = self.other.messages.batches, self.calls
        for batch_id in self.batch_ids:
            for name, fn in (("retrieve", sdk.retrieve), ("cancel", sdk.cancel), ("delete", sdk.delete),
                             ("results", sdk.results)):
                error = calls.refused(f"messages.batches.{name} (other tenant)", 404, fn, batch_id)
                need(error.body["error"]["type"] == "not_found_error", f"{name}: {error.body}")
            calls.refused("messages.batches.list after_id (other tenant)", 404, sdk.list, after_id=batch_id)
        listed = calls.call("messages.batches.list (other tenant)", sdk.list, limit=1000).data
        need(not set(self.batch_ids) & {b.id for b in listed}, "the other tenant lists our batches")
        return f"{len(self.batch_ids)} batches x 5 calls"

    def delete(self) -> str:
        need(self.batch_ids, "no batches")
        sdk = self.sdk.messages.batches
        for batch_id in self.batch_ids:
            self.wait(batch_id)
            deleted = self.calls.call("messages.batches.delete", sdk.delete, batch_id)
            need(deleted.id == batch_id and deleted.type == "message_batch_deleted", f"{deleted}")
        self.calls.refused("messages.batches.retrieve (deleted)", 404, sdk.retrieve, self.batch_ids[0])
        return f"{len(self.batch_ids)} batches deleted"


# ---- the run -----------------------------------------------------------------------------------------------------

def run_conformance(openai_base_url: str, anthropic_base_url: str, key: str, other_key: str, *,
                    model: str = "smollm2-135m", embedding_model: str | None = None,
                    embedding_base_url: str | None = None, long_tokens: int = 1024,
                    expire: Callable[[str], None] | None = None, expiry_window_s: int = 5,
                    timeout_s: float = 120, console=None) -> list[CheckResult]:
    """Every check of both APIs, printed as a table (`console`: a rich Console, default stdout's). `expire` (batch
    id ->), for tests, ends a running batch as its deadline would; without it the OpenAI expiry uses a completion
    window of `expiry_window_s` and the Anthropic one is skipped. `long_tokens`: the length of the requests a
    cancel or an expiry stops, which must still be running then."""
    openai_run = OpenAIConformance(openai_base_url, key, other_key, model, embedding_model, embedding_base_url,
                                   long_tokens, expire, expiry_window_s, timeout_s)
    anthropic_run = AnthropicConformance(anthropic_base_url, key, other_key, model, long_tokens, expire, timeout_s)
    results = []
    for api, run in ((OPENAI, openai_run), (ANTHROPIC, anthropic_run)):
        checks = Checks(api)
        for name, check in run.checks():
            checks.run(name, check)
        results += checks.results
    print_results(results, console)
    return results


def print_results(results: list[CheckResult], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    style = {PASS: "green", FAIL: "bold red", SKIP: "yellow"}
    failed = sum(r.status == FAIL for r in results)
    table = Table("api", "check", "result", "detail",
                  title=f"SDK conformance: {len(results) - failed} of {len(results)} checks not failed")
    for result in results:
        table.add_row(result.api, result.name, f"[{style[result.status]}]{result.status}[/]", result.detail)
    (console or Console()).print(table)
