"""Several shards in flight in one engine, for the Celery worker: one engine thread per worker process (and
model) owns the `LLMEngine` and steps it; each `run_shard` task, in its own thread of the worker's thread pool,
hands its shard's rows to that thread and waits for its own rows. So the next shard's rows are admitted while
the previous shard's tail decodes, and shards of several jobs share the engine (ordered by their request
priority when the engine's `scheduling_policy` is `priority`).

The waiting task thread asks the database once a second whether the job still runs (`StatusWatch`) and
reports progress; the shard's lease is renewed by its `LeaseHeartbeat` thread, independently of engine steps,
and a lost claim stops the shard like a cancel. A cancel aborts only that shard's requests. The engine thread
survives any one shard's error: a row that cannot be prepared or collected fails its shard alone; an engine
step that raises fails the shards then in the engine (their tasks retry them)."""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from storage.formats import Request, RowError
from workers.runner import JobSteps, LeaseHeartbeat, Progress, StatusWatch
from workers.shards import ShardOutcome, ShardsExecution, ShardWork

if TYPE_CHECKING:
    from engine import LLMEngine, RequestOutput
    from storage.models import Job, Shard

log = logging.getLogger("tokenmill.engine_loop")

POLL_S = 1.0  # how often a waiting shard asks whether its job still runs and reports progress


def shards_in_flight(max_num_seqs: int, rows_per_shard: int, kv_rows: int | None = None) -> int:
    """K, the shards a worker holds at once: enough whole shards to fill a batch of `max_num_seqs` (or the
    rows the KV pool holds, `kv_rows`, when fewer) plus one more, whose rows are admitted as a tail decodes."""
    rows = min(max_num_seqs, kv_rows) if kv_rows else max_num_seqs
    return math.ceil(max(1, rows) / max(1, rows_per_shard)) + 1


@dataclass(eq=False)
class Ticket:
    """One shard handed to the engine thread; `done` is set when all its rows finished, or it was cancelled or
    failed (`error`)."""

    work: ShardWork
    execution: ShardsExecution  # the job's sampling defaults, priority and cache salt; prepares and collects rows
    speculative: dict[str, Any] | None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    rows_done: int = 0  # finished rows and generated tokens, read by the waiting task thread
    tokens: int = 0
    request_ids: set[str] = field(default_factory=set)  # its requests still in the engine


class EngineLoop:
    """The engine thread of one engine. `run` is called from task threads; everything else runs on the engine
    thread, which alone touches the engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.inbox: queue.Queue[tuple[str, Ticket]] = queue.Queue()
        self.waiting: deque[Ticket] = deque()  # submitted, not yet admitted (another speculative setting runs)
        self.active: list[Ticket] = []  # admitted, oldest first
        self.pending: dict[str, tuple[Ticket, Request, int | None]] = {}
        self._spec_seen = (0, 0)
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    # -- task threads -------------------------------------------------------------------------------

    def run(self, execution: ShardsExecution, rows: list[Request | RowError], prefix: str,
            speculative: dict[str, Any] | None = None, should_stop: Callable[[], bool] = lambda: False,
            progress: Progress | None = None) -> ShardOutcome:
        """Run one shard's rows in the shared engine and wait for them; a stop request (asked every POLL_S)
        aborts its rows and returns the outcome with `cancelled` set. An error of this shard is raised."""
        ticket = Ticket(ShardWork(None, rows, prefix), execution, speculative)
        self.inbox.put(("run", ticket))
        reported = (0, 0)
        cancelled = False
        while not ticket.done.wait(POLL_S):
            reported = _report(progress, ticket, reported)
            if not cancelled and should_stop():
                cancelled = True
                self.inbox.put(("cancel", ticket))
        _report(progress, ticket, reported)
        if flush := getattr(progress, "flush", None):
            flush()  # the final counts, even when the shard ended within one throttle window
        if ticket.error is not None:
            raise ticket.error
        return ticket.work.outcome

    # -- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._receive(block=not self.active and not self.waiting)
                self._admit()
                if self.active:  # only its own shards: the engine is not stepped for anyone else's requests
                    self._step()
            except Exception:  # never let the loop die: it serves every shard of this process
                log.exception("engine loop")

    def _receive(self, block: bool) -> None:
        while True:
            try:
                what, ticket = self.inbox.get(block=block, timeout=POLL_S if block else None)
            except queue.Empty:
                return
            block = False
            if what == "run":
                self.waiting.append(ticket)
            elif what == "cancel":
                self._cancel(ticket)

    def _cancel(self, ticket: Ticket) -> None:
        if ticket.done.is_set():
            return
        for request_id in ticket.request_ids:
            self.engine.abort(request_id)
            self.pending.pop(request_id, None)
        ticket.request_ids.clear()
        if ticket in self.waiting:
            self.waiting.remove(ticket)
        ticket.work.outcome.cancelled = True
        self._end(ticket)

    def _admit(self) -> None:
        """Admit waiting shards in order; one with another speculative setting waits until the engine drained
        (the engine switches it only while idle)."""
        while self.waiting:
            ticket = self.waiting[0]
            try:
                if self.active and not self._same_speculation(ticket):
                    return
                self.waiting.popleft()
                self.engine.set_speculative_config(ticket.speculative)
                self.active.append(ticket)
                self._feed(ticket)
            except Exception as error:  # this shard alone fails
                self._fail(ticket, error)

    def _same_speculation(self, ticket: Ticket) -> bool:
        return self.engine.speculation_matches(ticket.speculative)

    def _feed(self, ticket: Ticket) -> None:
        work, execution = ticket.work, ticket.execution
        for item in work.rows:
            prepared = item if isinstance(item, RowError) else execution._prepare(item)
            if isinstance(prepared, RowError):
                work.outcome.errors.append(prepared)
                ticket.rows_done += 1
                continue
            request_id = f"{work.prefix}{item.row}"
            self.engine.add_request(request_id, *prepared, execution.priority, execution.cache_salt)
            self.pending[request_id] = (ticket, item, prepared[1].logprobs)
            ticket.request_ids.add(request_id)
        work.fed = True
        self._finish_if_done(ticket)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # the batch's state is unknown: its shards fail, their tasks retry them
            log.exception("engine step failed; failing the %d shard(s) in the engine", len(self.active))
            for ticket in list(self.active):
                self._fail(ticket, error)
            return
        self._credit_speculation()
        for output in outputs:
            entry = self.pending.pop(output.request_id, None)
            if entry is None:
                continue
            ticket, request, top_k = entry
            ticket.request_ids.discard(output.request_id)
            try:
                ShardsExecution._collect(ticket.work.outcome, request, output, top_k)
                ticket.rows_done += 1
                ticket.tokens += _tokens(output)
                self._finish_if_done(ticket)
            except Exception as error:
                self._fail(ticket, error)

    def _credit_speculation(self) -> None:
        """Speculation counts go to the oldest shard in the engine (the engine counts them per step)."""
        spec = self.engine.spec.stats if self.engine.spec else None
        seen = (spec.draft_tokens, spec.accepted_tokens) if spec else (0, 0)
        if self.active and seen >= self._spec_seen:
            outcome = self.active[0].work.outcome
            outcome.spec_draft_tokens += seen[0] - self._spec_seen[0]
            outcome.spec_accepted_tokens += seen[1] - self._spec_seen[1]
        self._spec_seen = seen

    def _finish_if_done(self, ticket: Ticket) -> None:
        if ticket.work.fed and not ticket.request_ids:
            self._end(ticket)

    def _fail(self, ticket: Ticket, error: BaseException) -> None:
        for request_id in ticket.request_ids:
            self.engine.abort(request_id)
            self.pending.pop(request_id, None)
        ticket.request_ids.clear()
        ticket.error = error
        self._end(ticket)

    def _end(self, ticket: Ticket) -> None:
        if ticket in self.active:
            self.active.remove(ticket)
        ticket.done.set()


def _tokens(output: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in output.outputs or ())


def _report(progress: Progress | None, ticket: Ticket, reported: tuple[int, int]) -> tuple[int, int]:
    now = (ticket.rows_done, ticket.tokens)
    if progress is not None and now != reported:
        progress.advance(now[0] - reported[0], now[1] - reported[1])
    return now


_loops: dict[int, EngineLoop] = {}
_loops_lock = threading.Lock()


def loop_for(engine: LLMEngine) -> EngineLoop:
    """The engine thread of this engine (one per engine of the process), started at first use."""
    with _loops_lock:
        if id(engine) not in _loops:
            _loops[id(engine)] = EngineLoop(engine)
        return _loops[id(engine)]


class SharedEngineSteps(JobSteps):
    """`JobSteps` whose shards run in the process's shared engine loop, next to other shards (of any job),
    instead of alone in the engine."""

    def _execute(self, job: Job, shard: Shard, engine: LLMEngine, heartbeat: LeaseHeartbeat) -> ShardOutcome:
        watch = StatusWatch(self.sessions, job.id, heartbeat)
        if watch.should_stop():  # a shard never starts on a job that stopped
            return ShardOutcome(cancelled=True)
        execution = ShardsExecution.for_job(engine, job)
        rows = list(self._reader_for(job).read(shard.row_start, shard.row_end))  # read here, not on the engine thread
        return loop_for(engine).run(execution, rows, f"{job.id[:8]}-{shard.index}-", job.settings.speculative_config,
                                    watch.should_stop, self.progress)
