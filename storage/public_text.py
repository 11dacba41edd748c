"""A job's error as someone outside the service may read it (an API tenant, a reader of the events topic): what
went wrong with their job, and nothing of the service's inside: no exception text from the workers, no worker
names, no database or broker addresses, no setting names, and for an API tenant no URI or path either."""

from __future__ import annotations

import re

URI = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://\S+")
PATH = re.compile(r"(?<![\w.:/])/(?:[\w.@+-]+/)+[\w.@+-]*")
EXCEPTION = re.compile(r"^[A-Z]\w*(Error|Exception|Exit|Interrupt|Failure)\b")  # `ValueError: ...`: the server's
EXCEPTION_INSIDE = re.compile(r"\b[A-Z]\w*(Error|Exception|Exit|Interrupt|Failure)\b[:(]")
SHARD_FAILURE = re.compile(r"^(shard \d+ \(rows \d+-\d+\) failed \d+ attempt\(s\), the limit; last: )(.*)$", re.S)
WORKER = re.compile(r"\b(its worker|on worker|by worker|worker) \([^)]*\)")
SETTING = re.compile(r"\$?\b(?:TOKENMILL|AWS|CELERY|OPENAI)_[A-Z0-9_]+\b")
ADDRESS = re.compile(r"\b(?:\d{1,3}(?:\.\d{1,3}){3}|localhost|\[[0-9a-fA-F:]+\])(?::\d+)?\b")
SERVER_ERROR = "The server had an error while running this batch."
MAX_MESSAGE = 1000


def public_message(error: str, uris: bool = False) -> str:
    """`uris`: keep URIs and paths (a Kafka or inbox producer's own, which it named); the API's tenants get none."""
    if EXCEPTION.match(error):
        return SERVER_ERROR
    if failure := SHARD_FAILURE.match(error):  # the limit is the tenant's business, the last cause is not
        cause = failure.group(2)
        cause = "the server had an error while running it" if EXCEPTION_INSIDE.search(cause) or \
            EXCEPTION.match(cause) else cause
        error = failure.group(1) + cause
    error = ADDRESS.sub("<address>", SETTING.sub("<setting>", WORKER.sub(r"\1", error)))
    if not uris:
        error = PATH.sub("<path>", URI.sub("<uri>", error))
    return error[:MAX_MESSAGE]
