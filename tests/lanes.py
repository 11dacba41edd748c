"""The suite's two lanes (`pytest -n 2`, as `make test` runs it) and its closing report.

Each test file is one unit of work, so its module fixtures (engines, stacks of its own) are built once, and
tests/service is one unit, so the service stack it shares starts once. That unit goes first: it mostly waits on
leases and sweeps, and the other lane computes meanwhile. (pytest-xdist's own `--dist loadgroup` cannot do this on
pytest 9: the group it writes into a test's id is not kept.) The run ends with its wall time and the peak RSS of
every pytest process (the controller and each xdist worker)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

SERVICE_LANE = "tests/service/"
_started = time.monotonic()
_peaks: dict[str, int] = {}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: tests/service as a whole, else its file."""
    path = nodeid.split("::", 1)[0]
    return SERVICE_LANE if path.startswith(SERVICE_LANE) else path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """tests/service first (order kept otherwise): it is the longest unit."""
    items.sort(key=lambda item: unit_of(item.nodeid) != SERVICE_LANE)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return Lanes(config, log)


def peak_rss_mib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) // 1024


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
