"""The one shard executor, the engine service: every shard, of the Celery worker and of `tokenmill run` alike,
runs through an `EngineLoop`, the engine thread of one engine, started and closed by whoever owns the engine (the
worker process, `workers.worker_engine.WorkerProcess`; a job run in process, `workers.inprocess.JobRunner`) and
handed to the shards; nothing looks it up. That thread alone owns the `LLMEngine` and steps it; each shard is
handed over from its own thread (a `run_shard` task, or one of `tokenmill run`'s), which waits for its rows. The
shard's thread talks to it by typed messages only (`SubmitRows`, `CancelRows`, `Close`). So the next shard's rows
are admitted while the previous shard's tail decodes, and shards of several jobs share the engine (ordered by
their request priority when the engine's `scheduling_policy` is `priority`).

The waiting thread asks the database once a second whether the job still runs (`StatusWatch`) and reports
progress; the shard's lease is renewed by a `LeaseHeartbeat` thread. A cancel aborts only that shard's requests.
The engine thread survives any one shard's error. An engine step that raises is pinned on a shard by running the
shards that were in the engine again one at a time; the others finish as if nothing happened. A shard whose rows
raise while it is alone in the engine (a step, or adding or collecting a row) runs again alone, its unfinished
rows one at a time: the row that raises alone fails with `engine_error`, its other rows finish. A watchdog ends the
process when the engine makes no progress for `TOKENMILL_ENGINE_WATCHDOG_S` (its leases then lapse and other
workers take its shards over); time the engine thread spends admitting a shard (switching its speculative or
batch-invariant setting, loading a draft model, adding its rows) counts as no progress too."""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ingest.row_checks import CheckedRow, RowChecks
from storage.formats import Request, RowError
from workers.shards import (
    EmbeddingRow,
    ShardOutcome,
    collect_row,
    prepare_embedding_row,
    prepare_row,
    tokenize_rows,
)

if TYPE_CHECKING:
    from engine import BatchEngine, EmbeddingRequestOutput, LoRARequest, RequestOutput
    from workers.progress import Progress

log = logging.getLogger("tokenmill.engine_loop")

POLL_S = 1.0  # how often a waiting shard asks whether its job still runs and reports progress
CANCEL_WAIT_S = 10.0  # a cancelled shard's wait for the engine thread to drop its rows (it may be stuck)
WATCHDOG_S = float(os.environ.get("TOKENMILL_ENGINE_WATCHDOG_S") or 600)


def shards_in_flight(max_num_seqs: int, rows_per_shard: int, kv_rows: int | None = None) -> int:
    """K, the shards a worker holds at once: enough whole shards to fill a batch of `max_num_seqs` (or the
    rows the KV pool holds, `kv_rows`, when fewer) plus one more, whose rows are admitted as a tail decodes."""
    rows = min(max_num_seqs, kv_rows) if kv_rows else max_num_seqs
    return math.ceil(max(1, rows) / max(1, rows_per_shard)) + 1


@dataclass
class RowSettings:
    """How a job's rows run: its sampling defaults, engine request priority, prefix-cache salt, speculative
    decoding and batch-invariant settings (None: the engine's own), the model names its rows may give (none: any)
    and the LoRA adapters they may name. `checks` gives the row checks (`ingest.row_checks`) they make."""

    defaults: dict[str, Any]
    priority: int = 0
    cache_salt: str | None = None
    speculative: dict[str, Any] | None = None
    models: frozenset[str] = frozenset()
    batch_invariant: bool | None = None
    truncate_inputs: bool = False  # embedding rows: cut inputs over the model's max_seq_length (else they fail)
    # the LoRA adapters its rows name (workers.adapters): each one's request, or why it cannot be served
    adapters: dict[str, LoRARequest | str] = field(default_factory=dict)
    adapter_names: frozenset[str] = frozenset()  # every adapter its rows may name (default: those of `adapters`)

    def checks(self) -> RowChecks:
        return RowChecks(self.defaults, self.models, self.adapters, self.adapter_names, self.truncate_inputs)


@dataclass(eq=False)
class Ticket:
    """One shard handed to the engine thread; `done` is set when all its rows finished, or it was cancelled or
    failed (`error`). Its request ids are `prefix` + row index, unique in the engine."""

    rows: list[CheckedRow | RowError]  # checked on the shard's thread (`ingest.row_checks`)
    prefix: str
    settings: RowSettings
    outcome: ShardOutcome = field(default_factory=ShardOutcome)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    rows_done: int = 0  # finished rows and generated tokens, read by the waiting thread
    tokens: int = 0
    fed: bool = False
    suspect: bool = False  # it was in the engine when a step raised: it runs again alone
    request_ids: set[str] = field(default_factory=set)  # its requests still in the engine
    solo: deque | None = None  # its rows raised in the engine: the rows still to run, one at a time
    solo_row: CheckedRow | RowError | None = None  # while `solo`: the row in the engine

    def restart(self) -> None:
        self.outcome, self.rows_done, self.tokens, self.fed, self.suspect = ShardOutcome(), 0, 0, False, True
        self.solo = self.solo_row = None

    @property
    def finished(self) -> bool:
        """None of its rows is in the engine, and none is left to add."""
        return not self.request_ids and (self.fed if self.solo is None else not self.solo)


@dataclass(frozen=True, eq=False)
class SubmitRows:
    """A shard's checked rows for the engine thread to admit."""

    ticket: Ticket


@dataclass(frozen=True, eq=False)
class CancelRows:
    """Drop a shard's rows: its job stopped."""

    ticket: Ticket


@dataclass(frozen=True)
class Close:
    """End the engine thread; the shards still in it fail."""


Message = SubmitRows | CancelRows | Close


@dataclass(eq=False)
class TextRow:
    """A generation row in the engine: one request."""

    ticket: Ticket
    row: CheckedRow

    def collect(self, output: RequestOutput) -> None:
        row = self.row
        if row.beams is not None:
            output.outputs = output.outputs[:row.beams]
        top_k = None if row.beams else row.params.logprobs  # the row's logprobs top-k
        collect_row(self.ticket.outcome, row.request, output, top_k, row.params)
        self.ticket.rows_done += 1
        self.ticket.tokens += _tokens(output)


@dataclass(eq=False)
class EmbeddingInput:
    """One input of an embeddings row in the engine: a request each; the row is done once all are."""

    ticket: Ticket
    row: EmbeddingRow
    index: int

    def collect(self, output: EmbeddingRequestOutput) -> None:
        self.ticket.tokens += len(output.prompt_token_ids)
        if self.row.collect(self.ticket.outcome, self.index, output):
            self.ticket.rows_done += 1


class EngineLoop:
    """The engine service: the engine thread of one engine, started here and ended by `close` (its owner's).
    `run` is called from the shards' threads; everything else runs on the engine thread, which alone touches
    the engine. Only one loop may step an engine at a time."""

    def __init__(self, engine: BatchEngine, watchdog_s: float = WATCHDOG_S,
                 on_stuck: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.waiting: deque[Ticket] = deque()  # submitted, not yet admitted
        self.active: list[Ticket] = []  # admitted, oldest first
        self.pending: dict[str, TextRow | EmbeddingInput] = {}  # by request id
        self._spec_seen = _spec_counts(engine)  # the engine's, counted before this loop (an earlier job's)
        self.progressed = time.monotonic()  # the last engine step that returned, or the last idle moment:
        # the watchdog counts from it while any shard is in `active` (admitted, or being admitted)
        self.watchdog_s, self.on_stuck = watchdog_s, on_stuck or _exit_stuck
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.watchdog = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)
        self.thread.start()
        self.watchdog.start()

    def close(self, timeout_s: float = 30) -> None:
        """End both threads, so that the engine can be freed; shards still in it fail."""
        self.inbox.put(Close())
        self.thread.join(timeout_s)
        self.watchdog.join(timeout_s)

    # -- shard threads ------------------------------------------------------------------------------

    def run(self, settings: RowSettings, rows: list[Request | RowError], prefix: str,
            should_stop: Callable[[], bool] = lambda: False, progress: Progress | None = None) -> ShardOutcome:
        """Run one shard's rows in the shared engine and wait for them; a stop request (asked every POLL_S)
        aborts its rows and returns the outcome with `cancelled` set. An error of this shard is raised. The rows
        are checked here, on the shard's thread (their LoRA adapters loaded), before the engine thread sees them."""
        ticket = Ticket(settings.checks().check_rows(self.engine, rows), prefix, settings)
        self.inbox.put(SubmitRows(ticket))
        reported = (0, 0)
        cancel_deadline = None
        while not ticket.done.wait(POLL_S):
            reported = _report(progress, ticket, reported)
            if cancel_deadline is None and should_stop():
                cancel_deadline = time.monotonic() + CANCEL_WAIT_S
                self.inbox.put(CancelRows(ticket))
            elif cancel_deadline is not None and time.monotonic() > cancel_deadline:
                log.warning("shard %s: the engine thread did not drop its rows within %.0f s of the cancel; "
                            "the shard ends cancelled without it", prefix, CANCEL_WAIT_S)
                return ShardOutcome(cancelled=True)
        _report(progress, ticket, reported)
        if flush := getattr(progress, "flush", None):
            flush()  # the final counts, even when the shard ended within one throttle window
        if ticket.error is not None:
            raise ticket.error
        return ticket.outcome

    # -- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._receive(block=not self.active and not self.waiting)
                if self.closed.is_set():
                    break
                self._admit()
                if self.active:  # only its own shards: the engine is not stepped for anyone else's requests
                    self._step()
                else:
                    self.progressed = time.monotonic()
            except Exception:  # never let the loop die: it serves every shard of this process
                log.exception("engine loop")
        for ticket in [*self.active, *self.waiting]:
            self._fail(ticket, RuntimeError("the engine loop was closed"))

    def _watch(self) -> None:
        while not self.closed.wait(min(5.0, self.watchdog_s / 4)):
            stuck_s = time.monotonic() - self.progressed
            if self.active and stuck_s > self.watchdog_s:
                log.critical("the engine made no progress for %.0f s with %d shard(s) in it; ending this process "
                             "so that their leases lapse and other workers take them over", stuck_s,
                             len(self.active))
                self.on_stuck()
                return

    def _receive(self, block: bool) -> None:
        while True:
            try:
                message = self.inbox.get(block=block, timeout=POLL_S if block else None)
            except queue.Empty:
                return
            block = False
            match message:
                case SubmitRows(ticket):
                    self.waiting.append(ticket)
                case CancelRows(ticket):
                    self._cancel(ticket)
                case Close():
                    self.closed.set()
                    return

    def _cancel(self, ticket: Ticket) -> None:
        if ticket.done.is_set():
            return
        self._abort(ticket)
        if ticket in self.waiting:
            self.waiting.remove(ticket)
        ticket.outcome.cancelled = True
        self._end(ticket)

    def _abort(self, ticket: Ticket) -> None:
        for request_id in ticket.request_ids:
            self.engine.abort(request_id)
            self.pending.pop(request_id, None)
        ticket.request_ids.clear()

    def _admit(self) -> None:
        """Admit waiting shards in order. One with another speculative or batch-invariant setting waits until the
        engine drained (the engine switches them only while idle); a suspect shard runs alone."""
        while self.waiting:
            ticket = self.waiting[0]
            try:
                if self.active and (ticket.suspect or any(t.suspect for t in self.active)
                                    or not self.engine.speculation_matches(ticket.settings.speculative)
                                    or not self.engine.batch_invariance_matches(ticket.settings.batch_invariant)):
                    return
                self.waiting.popleft()
                self.active.append(ticket)  # first: the watchdog counts a hang while it is admitted (a draft load)
                self.engine.set_speculative_config(ticket.settings.speculative)
                self.engine.set_batch_invariant(ticket.settings.batch_invariant)
            except Exception as error:  # this shard alone fails: its settings, not its rows
                self._fail(ticket, error)
                continue
            self._feed(ticket)

    def _feed(self, ticket: Ticket) -> None:
        """Add the ticket's rows to the engine (isolating: its next row); ended at once if none is left running."""
        if ticket.solo is None:
            try:
                self._add_rows(ticket, ticket.rows)
            except Exception as error:
                self._rows_failed(ticket, error)
                return
            ticket.fed = True
        self._finish_if_done(ticket)

    def _add_rows(self, ticket: Ticket, rows: list[CheckedRow | RowError]) -> None:
        if self.engine.embedding_size is not None:
            self._add_embedding_rows(ticket, rows)
            return
        token_ids = tokenize_rows(self.engine, rows)
        for item in rows:
            prepared = item if isinstance(item, RowError) else prepare_row(self.engine, item, token_ids.get(item.row))
            if isinstance(prepared, RowError):
                ticket.outcome.errors.append(prepared)
                ticket.rows_done += 1
            else:
                self._add_text_row(ticket, item, prepared[0])

    def _add_text_row(self, ticket: Ticket, item: CheckedRow, token_ids: list[int]) -> None:
        """Add a prepared row to the engine, with its LoRA adapter (loaded by its check) if it names one."""
        settings = ticket.settings
        request_id = f"{ticket.prefix}{item.row}"
        self.engine.add_request(request_id, token_ids, item.params, settings.priority, settings.cache_salt,
                                *(() if item.adapter is None else (item.adapter,)))  # the base model: as before LoRA
        self.pending[request_id] = TextRow(ticket, item)
        ticket.request_ids.add(request_id)

    def _add_embedding_rows(self, ticket: Ticket, rows: list[CheckedRow | RowError]) -> None:
        """Embedding rows: one engine request per input (request id: prefix, row, '.', input index), added
        shortest first, so that each engine step holds inputs of like lengths."""
        ticket.outcome.embedding_size = self.engine.embedding_size
        settings = ticket.settings
        inputs = []
        for item in rows:
            prepared = item if isinstance(item, RowError) else prepare_embedding_row(
                self.engine, item, settings.truncate_inputs)
            if isinstance(prepared, RowError):
                ticket.outcome.errors.append(prepared)
                ticket.rows_done += 1
                continue
            inputs += [(len(token_ids), index, token_ids, prepared)
                       for index, token_ids in enumerate(prepared.token_ids)]
        for _, index, token_ids, prepared in sorted(inputs, key=lambda entry: entry[0]):
            request_id = f"{ticket.prefix}{prepared.request.row}.{index}"
            self.engine.add_request(request_id, token_ids, prepared.params)
            self.pending[request_id] = EmbeddingInput(ticket, prepared, index)
            ticket.request_ids.add(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:
            self._step_failed(error)
            return
        self.progressed = time.monotonic()
        self._credit_speculation()
        for output in outputs:
            entry = self.pending.pop(output.request_id, None)
            if entry is None:
                continue
            ticket = entry.ticket
            ticket.request_ids.discard(output.request_id)
            try:
                entry.collect(output)
            except Exception as error:
                self._rows_failed(ticket, error)
                continue
            self._finish_if_done(ticket)

    def _step_failed(self, error: BaseException) -> None:
        """A step raised. Alone in the engine, the shard's rows did it (`_rows_failed`). With others, no one can
        tell whose row did it: every shard in the engine starts over, one at a time, without an attempt. A
        tensor-parallel rank that died leaves no engine: the process ends, so other workers take its shards over."""
        from engine.distributed.group import RankFailure

        if isinstance(error, RankFailure):
            log.critical("the engine is down (%s); ending this process so that the leases of its %d shard(s) lapse "
                         "and other workers take them over", error, len(self.active))
            self.on_stuck()
            return
        if len(self.active) == 1:
            log.warning("engine step failed with one shard in the engine (%s: %s)", type(error).__name__, error,
                        exc_info=error)
            self._rows_failed(self.active[0], error)
            return
        log.warning("engine step failed with %d shards in the engine (%s: %s); running them again one at a time "
                    "to find the one that fails", len(self.active), type(error).__name__, error)
        for ticket in reversed(self.active):
            self._abort(ticket)
            ticket.restart()
            self.waiting.appendleft(ticket)
        self.active.clear()

    def _credit_speculation(self) -> None:
        """Speculation counts go to the oldest shard in the engine (the engine counts them per step)."""
        seen = _spec_counts(self.engine)
        if self.active and seen >= self._spec_seen:
            outcome = self.active[0].outcome
            outcome.spec_draft_tokens += seen[0] - self._spec_seen[0]
            outcome.spec_accepted_tokens += seen[1] - self._spec_seen[1]
        self._spec_seen = seen

    def _rows_failed(self, ticket: Ticket, error: BaseException) -> None:
        """The ticket's rows raised in the engine (a step it had alone, or adding or collecting a row). Isolating
        already: the row in the engine fails alone with `engine_error`, and the next one goes in. Else the shard
        runs again alone, its unfinished rows one at a time; its finished rows stay as they are."""
        self._abort(ticket)
        if ticket.solo is not None:
            self._solo_row_failed(ticket, error)
            self._finish_if_done(ticket)
            return
        outcome = ticket.outcome
        finished = {r["row_index"] for r in outcome.records} | {e.row for e in outcome.errors}
        ticket.solo = deque(row for row in ticket.rows if row.row not in finished)
        log.warning("shard %s: its rows raised in the engine (%s: %s); running its %d unfinished row(s) again one "
                    "at a time, alone in the engine", ticket.prefix, type(error).__name__, error, len(ticket.solo))
        ticket.suspect = True
        if ticket in self.active:
            self.active.remove(ticket)
        self.waiting.appendleft(ticket)

    def _solo_row_failed(self, ticket: Ticket, error: BaseException) -> None:
        """The one row an isolating ticket had in the engine raised: it fails alone (what it had collected goes)."""
        row, outcome = ticket.solo_row, ticket.outcome
        outcome.records = [r for r in outcome.records if r["row_index"] != row.row]
        outcome.errors = [e for e in outcome.errors if e.row != row.row]
        outcome.errors.append(RowError(row.row, row.custom_id, "engine_error",
                                       f"the engine raised {type(error).__name__} while running this request"))
        ticket.rows_done += 1
        log.warning("shard %s: row %d raised in the engine alone (%s: %s); it fails with engine_error",
                    ticket.prefix, row.row, type(error).__name__, error)

    def _finish_if_done(self, ticket: Ticket) -> None:
        """End the ticket once its rows finished; an isolating one first adds its next row, once the last left."""
        while ticket.solo and not ticket.request_ids:
            ticket.solo_row = ticket.solo.popleft()
            try:
                self._add_rows(ticket, [ticket.solo_row])
            except Exception as error:
                self._abort(ticket)
                self._solo_row_failed(ticket, error)
        if ticket.finished:
            self._end(ticket)

    def _fail(self, ticket: Ticket, error: BaseException) -> None:
        self._abort(ticket)
        ticket.error = error
        self._end(ticket)

    def _end(self, ticket: Ticket) -> None:
        if ticket in self.active:
            self.active.remove(ticket)
        ticket.done.set()


def _spec_counts(engine: BatchEngine) -> tuple[int, int]:
    """The draft and accepted tokens the engine's speculative decoder counted so far."""
    spec = getattr(engine, "spec", None)
    return (spec.stats.draft_tokens, spec.stats.accepted_tokens) if spec else (0, 0)


def _exit_stuck() -> None:
    logging.shutdown()
    os._exit(75)


def _tokens(output: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in output.outputs or ())


def _report(progress: Progress | None, ticket: Ticket, reported: tuple[int, int]) -> tuple[int, int]:
    # a shard run again from the start (after a failed step) reports nothing until it passes what it reported
    rows, tokens = max(ticket.rows_done, reported[0]), max(ticket.tokens, reported[1])
    if progress is not None and (rows, tokens) != reported:
        progress.advance(rows - reported[0], tokens - reported[1])
    return rows, tokens
