"""How a job's run reports progress (`tokenmill run`'s bar, a Celery task's state): `Progress`, and
`NoProgress`, which only logs the phases."""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger("tokenmill.jobs")


class Progress(Protocol):
    def phase(self, description: str) -> None: ...

    def start(self, total_rows: int, done_rows: int) -> None: ...

    def advance(self, rows: int, tokens: int) -> None: ...


class NoProgress:
    def phase(self, description: str) -> None:
        log.info(description)

    def start(self, total_rows: int, done_rows: int) -> None:
        pass

    def advance(self, rows: int, tokens: int) -> None:
        pass
