"""Where the job code reads time: the host's wall clock (`utcnow`), the database's clock (`database_now`), a
monotonic clock, sleeping, and the periodic threads of lease heartbeats. Production reads the real ones; the fault
explorer (`workers.sim`) installs a simulated clock, so hours of leases, sweeps and deadlines pass in moments."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime


class SystemClock:
    def utcnow(self) -> datetime:
        return datetime.now(UTC)

    def database_now(self) -> datetime | None:
        """The database's clock when it is simulated; None: ask the database."""
        return None

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def periodic(self, every_s: float, tick: Callable[[], None], stop: threading.Event,
                 name: str) -> threading.Thread | None:
        """Call `tick` every `every_s` until `stop` is set, on a daemon thread (returned)."""
        def run() -> None:
            while not stop.wait(every_s):
                tick()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread


_clock: SystemClock = SystemClock()


def install(clock: SystemClock) -> SystemClock:
    """Make `clock` the process's clock; returns the one it replaced."""
    global _clock
    previous, _clock = _clock, clock
    return previous


def current() -> SystemClock:
    return _clock


def utcnow() -> datetime:
    return _clock.utcnow()


def database_now() -> datetime | None:
    return _clock.database_now()


def monotonic() -> float:
    return _clock.monotonic()


def sleep(seconds: float) -> None:
    _clock.sleep(seconds)


def periodic(every_s: float, tick: Callable[[], None], stop: threading.Event, name: str) -> threading.Thread | None:
    return _clock.periodic(every_s, tick, stop, name)
