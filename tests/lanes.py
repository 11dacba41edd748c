"""The suite's lanes (`pytest -n 3`, as `make test` runs it) and its closing report.

Each test file is one unit of work, so its module fixtures (engines, stacks of its own) are built once, except the
files of tests/service that use its shared stack: they form two units, each one pytest process with one stack for
the whole unit (the `stack` fixture is scoped to the package, so each process builds its own). Those two go first,
on two lanes: they mostly wait on leases and sweeps, and the third lane computes meanwhile; whichever lane frees
up takes the next file. (pytest-xdist's own `--dist loadgroup` cannot do this on pytest 9: the group it writes into
a test's id is not kept.) The run ends with its wall time and the peak RSS of every pytest process (the controller
and each xdist worker)."""

from __future__ import annotations

import os
import re
import resource
import time
from pathlib import Path

import pytest

SERVICE_DIR = "tests/service/"
# tests/service files that start no shared stack (their own, or none): units of their own, run on any lane
WITHOUT_SHARED_STACK = {"test_intake.py", "test_shard_claims.py", "test_wheel.py", "test_worker_metrics.py"}
# the shared-stack files the second stack runs (about half the time; the rest go to the first)
SECOND_STACK = {"test_faults.py", "test_soak.py", "test_workers.py", "test_sharing.py", "test_shared_hostname.py",
                "test_front_doors.py", "test_embedding_stack.py", "test_fuzz_stack.py", "test_rabbitmq.py",
                "test_stack.py"}
STACK_UNITS = (f"{SERVICE_DIR} (stack 1)", f"{SERVICE_DIR} (stack 2)")
_started = time.monotonic()
_peaks: dict[str, int] = {}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: one of the two shared-stack units, else its file."""
    path = nodeid.split("::", 1)[0]
    name = path.removeprefix(SERVICE_DIR)
    if not path.startswith(SERVICE_DIR) or name in WITHOUT_SHARED_STACK:
        return path
    return STACK_UNITS[name in SECOND_STACK]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The stack units first (order kept otherwise): they are the longest."""
    for item in items:
        if "stack" in getattr(item, "fixturenames", ()) and item.nodeid.startswith(SERVICE_DIR) \
                and unit_of(item.nodeid) not in STACK_UNITS:
            raise pytest.UsageError(f"{item.nodeid} uses the shared stack: take {item.path.name} out of "
                                    "tests/lanes.py's WITHOUT_SHARED_STACK")
    items.sort(key=lambda item: unit_of(item.nodeid) not in STACK_UNITS)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return Lanes(config, log)


def _cpu_s() -> float:
    """CPU seconds of this process and of the children it waited for (not the stacks' daemons)."""
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                      resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With $TOKENMILL_TEST_CPU set to a file: each test's CPU seconds (setup to teardown), wall seconds, end time,
    lane and id, appended."""
    log = os.environ.get("TOKENMILL_TEST_CPU")
    if not log:
        return (yield)
    cpu, wall = _cpu_s(), time.monotonic()
    try:
        return (yield)
    finally:
        with open(log, "a") as f:
            f.write(f"{_cpu_s() - cpu:.1f}\t{time.monotonic() - wall:.1f}\t{time.time():.0f}\t"
                    f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{item.nodeid}\n")


def rss_mib() -> tuple[int, int]:
    """(RSS, peak RSS) of this process, MiB."""
    status = Path("/proc/self/status").read_text()
    return tuple(int(re.search(rf"{key}:\s+(\d+)", status).group(1)) // 1024 for key in ("VmRSS", "VmHWM"))


def peak_rss_mib() -> int:
    return rss_mib()[1]


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its peak goes back to the controller
        workeroutput["peak_rss_mib"] = peak_rss_mib()


def pytest_testnodedown(node, error) -> None:
    if peak := getattr(node, "workeroutput", {}).get("peak_rss_mib"):
        _peaks[node.gateway.id] = peak


def pytest_terminal_summary(terminalreporter, config) -> None:
    if getattr(config, "workeroutput", None) is not None:
        return
    peaks = {"main": peak_rss_mib(), **_peaks}
    each = ", ".join(f"{name} {mib:,}" for name, mib in peaks.items())
    terminalreporter.write_line(f"suite: {time.monotonic() - _started:.0f} s wall; pytest peak RSS "
                                f"{max(peaks.values()):,} MiB ({each} MiB)")
