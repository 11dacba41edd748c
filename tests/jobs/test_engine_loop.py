"""The Celery worker's engine loop (workers/engine_loop.py): shards of several jobs, each waited for by its own
task thread, run at once in one engine. Each gets exactly its own rows, with the outputs it gets alone; a cancel
or an error of one shard leaves the others running; the final progress is reported even for a short shard."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from storage.formats import COMPLETIONS, Request
from workers.engine_loop import EngineLoop, RowSettings, shards_in_flight

pytestmark = pytest.mark.real_model

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def rows(prefix: str, count: int, max_tokens: int) -> list[Request]:
    return [Request(i, f"{prefix}-{i}", COMPLETIONS, prompt=f"{prefix} question {i}: what is {i} plus {i}?",
                    params={"max_tokens": max_tokens}) for i in range(count)]


def texts(outcome) -> dict[str, str]:
    return {r["custom_id"]: r["text"] for r in outcome.records}


class Counts:
    def __init__(self) -> None:
        self.rows = self.tokens = self.flushed = 0

    def advance(self, rows: int, tokens: int) -> None:
        self.rows += rows
        self.tokens += tokens

    def flush(self) -> None:
        self.flushed += 1


def run_together(loop: EngineLoop, shards: dict[str, tuple], **kwargs) -> dict[str, object]:
    """Run each shard (execution, rows, should_stop) from its own thread; name -> outcome or the error raised."""
    results: dict[str, object] = {}

    def run(name: str, settings, shard_rows, should_stop) -> None:
        try:
            results[name] = loop.run(settings, shard_rows, f"{name}-", should_stop=should_stop, **kwargs)
        except Exception as error:
            results[name] = error

    threads = [threading.Thread(target=run, args=(name, *shard)) for name, shard in shards.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


@pytest.fixture
def loop(llm_engine):
    """The engine service over the shared engine, closed after the test (two loops stepping it at once would
    clash; an idle one steps nothing)."""
    service = EngineLoop(llm_engine)
    yield service
    service.close()


def test_two_jobs_shards_share_the_engine_with_their_solo_outputs(loop, llm_engine) -> None:
    a, b = rows("a", 5, 6), rows("b", 4, 3)
    execution = RowSettings(GREEDY, batch_invariant=True)  # solo and shared batches: the job's setting pins them
    solo = {name: texts(loop.run(execution, shard_rows, f"solo-{name}-")) for name, shard_rows in (("a", a), ("b", b))}
    steps = []
    llm_engine.step_observers.append(lambda finished: steps.append(llm_engine.num_unfinished_requests))
    try:
        together = run_together(loop, {"a": (execution, a, lambda: False), "b": (execution, b, lambda: False)})
    finally:
        llm_engine.step_observers.pop()
    assert {name: texts(outcome) for name, outcome in together.items()} == solo
    assert max(steps) > max(len(a), len(b)), "both shards' rows must be in the engine at once"
    assert not llm_engine.has_unfinished_requests() and not loop.pending
    assert llm_engine.runner.batch_invariant  # switched on for the job's shards
    llm_engine.set_batch_invariant(None)  # back to the engine's own setting for other tests
    assert not llm_engine.runner.batch_invariant


def test_cancelling_one_shard_aborts_its_rows_and_the_other_completes(loop, llm_engine) -> None:
    stop_at = time.monotonic() + 0.5
    execution = RowSettings(GREEDY)
    results = run_together(loop, {"cancelled": (execution, rows("c", 4, 200), lambda: time.monotonic() > stop_at),
                                  "kept": (execution, rows("k", 4, 12), lambda: False)})
    cancelled, kept = results["cancelled"], results["kept"]
    assert cancelled.cancelled and len(cancelled.records) < 4
    assert not kept.cancelled and sorted(texts(kept)) == [f"k-{i}" for i in range(4)]
    assert not llm_engine.has_unfinished_requests(), "the cancelled shard's rows must be aborted in the engine"


def test_one_shards_error_fails_it_alone_and_the_loop_goes_on(loop, llm_engine) -> None:
    broken = RowSettings(GREEDY, speculative={"method": "no-such-method"})  # the shard's error, not a row's
    results = run_together(loop, {"broken": (broken, rows("x", 2, 4), lambda: False),
                                  "fine": (RowSettings(GREEDY), rows("f", 3, 4), lambda: False)})
    assert isinstance(results["broken"], Exception), results["broken"]
    assert sorted(texts(results["fine"])) == ["f-0", "f-1", "f-2"]
    again = loop.run(RowSettings(GREEDY), rows("g", 2, 4), "after-")
    assert sorted(texts(again)) == ["g-0", "g-1"] and loop.thread.is_alive()


def test_a_short_shard_reports_all_its_rows_and_flushes(loop, llm_engine) -> None:
    counts = Counts()
    outcome = loop.run(RowSettings(GREEDY), rows("p", 3, 2), "p-", progress=counts)
    assert (counts.rows, counts.tokens, counts.flushed) == (3, 6, 1)
    assert outcome.totals()["completion_tokens"] == 6


def test_shards_in_flight_fill_a_batch_and_one_more() -> None:
    assert shards_in_flight(256, 500) == 2
    assert shards_in_flight(256, 16) == 17
    assert shards_in_flight(256, 16, kv_rows=64) == 5


class PoisonedEngine:
    """The real engine, except that a step raises while a request that `poisons` (by its id and token ids; by
    default an id holding "poison") is in it (as a row that crashes the model would), or blocks while `stuck` is
    set."""

    def __init__(self, engine, poisons=lambda request_id, token_ids: "poison" in request_id) -> None:
        self._engine, self.poisoned, self.stuck, self.released = engine, set(), False, threading.Event()
        self.poisons = poisons

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def add_request(self, request_id: str, *args):
        if self.poisons(request_id, args[0]):
            self.poisoned.add(request_id)
        return self._engine.add_request(request_id, *args)

    def abort(self, request_id: str) -> None:
        self.poisoned.discard(request_id)
        self._engine.abort(request_id)

    def step(self):
        if self.stuck:
            self.released.wait(60)
        if self.poisoned:
            raise RuntimeError("the model crashed on this batch")
        return self._engine.step()


def test_a_step_that_raises_fails_only_the_rows_that_did_it(llm_engine) -> None:
    """Two shards share the engine and a step raises: no one can tell whose row did it, so both run again, one
    at a time; the poisoned one's rows, run one at a time, each fail alone with engine_error; the other completes
    with its solo outputs, no attempt lost."""
    loop = EngineLoop(PoisonedEngine(llm_engine))
    fine = rows("f", 3, 5)
    solo = texts(loop.run(RowSettings(GREEDY), fine, "solo-"))
    results = run_together(loop, {"poison": (RowSettings(GREEDY), rows("p", 2, 5), lambda: False),
                                  "fine": (RowSettings(GREEDY), fine, lambda: False)})
    poisoned = results["poison"]
    assert not poisoned.records and [(e.custom_id, e.code) for e in poisoned.errors] == [
        ("p-0", "engine_error"), ("p-1", "engine_error")]
    assert texts(results["fine"]) == {k.replace("solo-", ""): v for k, v in solo.items()}
    assert not llm_engine.has_unfinished_requests()
    loop.close()


def test_a_row_that_makes_every_step_raise_fails_alone_and_its_shards_other_rows_finish(loop, llm_engine) -> None:
    """One row of a shard makes each step it is in raise: the shard runs again alone, its unfinished rows one at
    a time; that row fails with engine_error, the others keep the outputs they get alone."""
    mixed, execution = rows("m", 4, 5), RowSettings(GREEDY, batch_invariant=True)  # batched or alone: same text
    together = texts(loop.run(execution, mixed, "m-"))
    loop = EngineLoop(PoisonedEngine(llm_engine, lambda request_id, token_ids: request_id == "mixed-2"))
    try:
        outcome = loop.run(execution, mixed, "mixed-")
    finally:
        loop.close()
        llm_engine.set_batch_invariant(None)
    assert [(e.custom_id, e.code) for e in outcome.errors] == [("m-2", "engine_error")]
    assert "RuntimeError" in outcome.errors[0].message
    assert texts(outcome) == {k: v for k, v in together.items() if k != "m-2"}
    assert sorted(r["row_index"] for r in outcome.records) == [0, 1, 3]
    assert not llm_engine.has_unfinished_requests() and not loop.pending


def test_a_stuck_engine_trips_the_watchdog_and_a_cancel_still_returns(llm_engine, monkeypatch) -> None:
    from workers import engine_loop

    monkeypatch.setattr(engine_loop, "CANCEL_WAIT_S", 1.0)
    stuck_engine = PoisonedEngine(llm_engine)
    stuck_engine.stuck = True
    tripped = threading.Event()
    loop = EngineLoop(stuck_engine, watchdog_s=1.0, on_stuck=tripped.set)
    started = time.monotonic()
    try:
        outcome = loop.run(RowSettings(GREEDY), rows("s", 2, 4), "stuck-",
                           should_stop=lambda: time.monotonic() - started > 1)
        assert outcome.cancelled and not outcome.records  # the cancel returned though the engine never stepped
        assert tripped.wait(10), "the watchdog must fire when the engine makes no progress"
    finally:
        stuck_engine.stuck = False
        stuck_engine.released.set()
        deadline = time.monotonic() + 30
        while llm_engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.1)  # the loop drops the cancelled rows once its step returns
    assert not llm_engine.has_unfinished_requests()


class AdmissionBlockingEngine:
    """No model: its `blocking` call (a draft model that never finishes loading) blocks until released, then
    raises, so that its shard fails and the loop goes idle."""

    embedding_size = spec = None

    def __init__(self, blocking: str) -> None:
        self.blocking, self.entered, self.released = blocking, threading.Event(), threading.Event()

    def speculation_matches(self, settings) -> bool:
        return True

    def batch_invariance_matches(self, on) -> bool:
        return True

    def set_speculative_config(self, settings) -> None:
        self._maybe_block("set_speculative_config")

    def set_batch_invariant(self, on) -> None:
        self._maybe_block("set_batch_invariant")

    def _maybe_block(self, call: str) -> None:
        if call == self.blocking:
            self.entered.set()
            self.released.wait(60)
            raise RuntimeError(f"{call} released by the test")

    def abort(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("blocking", ["set_speculative_config", "set_batch_invariant"])
def test_a_hang_while_admitting_a_shard_trips_the_watchdog(blocking, monkeypatch) -> None:
    """The engine is idle and the shard it admits hangs in the engine (no step runs yet): the watchdog counts
    that time as no progress, as it does a hung step, since the shard's lease is kept alive meanwhile."""
    from workers import engine_loop

    monkeypatch.setattr(engine_loop, "CANCEL_WAIT_S", 1.0)
    engine = AdmissionBlockingEngine(blocking)
    tripped = threading.Event()
    loop = EngineLoop(engine, watchdog_s=1.0, on_stuck=tripped.set)
    started = time.monotonic()
    try:
        outcome = loop.run(RowSettings(GREEDY, speculative={"method": "draft"}), rows("d", 2, 4), "draft-",
                           should_stop=lambda: tripped.wait(0) or time.monotonic() - started > 8)
        assert engine.entered.is_set() and outcome.cancelled
        assert tripped.wait(0), "the watchdog must fire while the engine thread hangs admitting a shard"
    finally:
        engine.released.set()


def run_into(results: dict[str, object], loop: EngineLoop, name: str) -> None:
    try:
        results[name] = loop.run(RowSettings(GREEDY), rows(name, 1, 4), f"{name}-")
    except Exception as error:
        results[name] = error


def test_a_released_loop_fails_what_waits_ends_its_threads_and_frees_the_engine() -> None:
    """A job's run closes its engine service when it ends: shard a hangs in the engine while b waits and the
    close comes; a fails with the engine's error, b with the closed loop's, and nothing holds the engine."""
    engine = AdmissionBlockingEngine("set_batch_invariant")
    engine_ref = weakref.ref(engine)
    loop = EngineLoop(engine)
    results: dict[str, object] = {}
    shards = [threading.Thread(target=run_into, args=(results, loop, name)) for name in "ab"]
    shards[0].start()
    assert engine.entered.wait(10)
    shards[1].start()
    deadline = time.monotonic() + 10
    while loop.inbox.qsize() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    closing = threading.Thread(target=loop.close)
    closing.start()
    engine.released.set()
    for thread in (*shards, closing):
        thread.join(30)
    assert "released by the test" in str(results["a"]) and "loop was closed" in str(results["b"]), results
    assert not loop.thread.is_alive() and not loop.watchdog.is_alive()
    del engine, loop, results  # the errors' tracebacks hold the engine too
    gc.collect()
    assert engine_ref() is None
