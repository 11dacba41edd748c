"""A live progress bar for a running job: rows done/total, generated tokens per second, ETA."""

from __future__ import annotations

import logging
import sys
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class JobProgressBar:
    """Implements `workers.progress.Progress`; use as a context manager around `run_job`."""

    def __init__(self, console: Console) -> None:
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
            TextColumn("{task.fields[tokens_per_s]:>7.1f} tok/s"), TimeElapsedColumn(), TextColumn("ETA"),
            TimeRemainingColumn(), console=console)
        self.task = self.bar.add_task("starting", total=None, tokens_per_s=0.0)
        self.tokens, self.started = 0, None
        self._streams: list[tuple[logging.StreamHandler, object]] = []

    def __enter__(self) -> JobProgressBar:
        self.bar.start()
        self._route_logs(sys.stderr)  # while live, rich proxies stderr: log lines then print above the bar
        return self

    def __exit__(self, *exc) -> None:
        self.bar.stop()
        for handler, stream in self._streams:
            handler.setStream(stream)

    def _route_logs(self, stream) -> None:
        for handler in logging.getLogger().handlers:
            if type(handler) is logging.StreamHandler:
                self._streams.append((handler, handler.stream))
                handler.setStream(stream)

    def phase(self, description: str) -> None:
        self.bar.update(self.task, description=description)

    def start(self, total_rows: int, done_rows: int) -> None:
        self.bar.reset(self.task, total=total_rows, completed=done_rows, tokens_per_s=0.0)
        self.tokens, self.started = 0, time.perf_counter()

    def advance(self, rows: int, tokens: int) -> None:
        self.tokens += tokens
        elapsed = time.perf_counter() - (self.started or time.perf_counter())
        self.bar.update(self.task, advance=rows, tokens_per_s=self.tokens / elapsed if elapsed > 0 else 0.0)
