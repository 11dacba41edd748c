"""Which errors are transient (a service down or slow: wait and try again) and which are about the thing being
processed (record it and move on). A front door retries only the first kind, so one bad message never blocks
the ones after it."""

from __future__ import annotations

import importlib
import os
import signal
from collections.abc import Callable

THROTTLING_CODES = {"Throttling", "ThrottlingException", "SlowDown", "RequestTimeout", "RequestLimitExceeded",
                    "ServiceUnavailable", "InternalError"}

# (module, class) of errors that mean a service is unreachable; imported lazily, each package is optional
_TRANSIENT_CLASSES = [
    ("sqlalchemy.exc", "OperationalError"), ("sqlalchemy.exc", "InterfaceError"),
    ("sqlalchemy.exc", "TimeoutError"), ("sqlalchemy.exc", "DisconnectionError"),
    ("botocore.exceptions", "EndpointConnectionError"), ("botocore.exceptions", "ConnectionClosedError"),
    ("botocore.exceptions", "ReadTimeoutError"), ("botocore.exceptions", "ConnectTimeoutError"),
    ("kombu.exceptions", "OperationalError"), ("redis.exceptions", "ConnectionError"),
    ("redis.exceptions", "TimeoutError"), ("kafka.errors", "KafkaConnectionError"),
    ("kafka.errors", "KafkaTimeoutError"), ("kafka.errors", "NoBrokersAvailable"),
]


def _classes() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in _TRANSIENT_CLASSES:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def is_transient(error: BaseException) -> bool:
    """True for a service that is down, unreachable, throttling or failing on its side (5xx); a cause chained
    below the error counts too."""
    seen: set[int] = set()
    current: BaseException | None = error
    classes = _classes()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, classes) or _is_server_side(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def _is_server_side(error: BaseException) -> bool:
    response = getattr(error, "response", None)
    if not isinstance(response, dict):  # botocore's ClientError carries a dict
        return False
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    return status >= 500 or status == 429 or response.get("Error", {}).get("Code") in THROTTLING_CODES


crash_hook: Callable[[str], None] | None = None

CRASH_POINTS = ("after_part_upload", "during_finalize", "after_consumer_insert", "before_sweep_sends")


def pause_point(name: str) -> None:
    """Fault-test hook: while the file `pause-<name>` exists in $TOKENMILL_FAULT_DIR (`tokenmill stack up` sets it
    for its processes), the first process to pass here takes the file (renamed `paused-<name>-<group>-<pid>`)
    and stops itself with SIGSTOP, to be resumed by whoever set the trigger (ops/soak_faults.py: once its lease
    lapsed). The pause lands exactly where the code says, not where a poller happens to catch it."""
    if _take_trigger("pause", name):
        os.kill(os.getpid(), signal.SIGSTOP)


TAKEN = {"pause": "paused", "crash": "crashed"}  # a trigger file's name once a process took it


def _take_trigger(kind: str, name: str) -> bool:
    """Did this process take the trigger file `<kind>-<name>` of $TOKENMILL_FAULT_DIR (renamed
    `paused-<name>-<process group>-<pid>` or `crashed-...`; of several processes passing at once, one takes it)?"""
    fault_dir = os.environ.get("TOKENMILL_FAULT_DIR")
    if not fault_dir:
        return False
    taken = os.path.join(fault_dir, f"{TAKEN[kind]}-{name}-{os.getpgrp()}-{os.getpid()}")
    try:
        os.rename(os.path.join(fault_dir, f"{kind}-{name}"), taken)
    except OSError:  # no trigger, or another process took it
        return False
    return True


def crash_point(name: str) -> None:
    """Fault-test hook: with TOKENMILL_CRASH_AT=<name> set, this process SIGKILLs itself here, so a test can
    kill a worker, `tokenmill run` or the consumer at an exact step (no cleanup code runs, as after a power cut);
    so does the first process to take the trigger file `crash-<name>` of $TOKENMILL_FAULT_DIR (see `pause_point`).
    The fault explorer (`workers.sim`) sets `crash_hook` to decide there itself."""
    if crash_hook is not None:
        crash_hook(name)
    if os.environ.get("TOKENMILL_CRASH_AT") == name or _take_trigger("crash", name):
        os.kill(os.getpid(), signal.SIGKILL)
