"""The Celery worker's engine loop (workers/engine_loop.py): shards of several jobs, each waited for by its own
task thread, run at once in one engine. Each gets exactly its own rows, with the outputs it gets alone; a cancel
or an error of one shard leaves the others running; the final progress is reported even for a short shard."""

from __future__ import annotations

import threading
import time

import pytest

from storage.formats import COMPLETIONS, Request
from workers.engine_loop import EngineLoop, loop_for, shards_in_flight
from workers.shards import ShardsExecution

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

    def run(name: str, execution, shard_rows, should_stop) -> None:
        try:
            results[name] = loop.run(execution, shard_rows, f"{name}-", should_stop=should_stop, **kwargs)
        except Exception as error:
            results[name] = error

    threads = [threading.Thread(target=run, args=(name, *shard)) for name, shard in shards.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


@pytest.fixture
def loop(llm_engine) -> EngineLoop:
    return loop_for(llm_engine)  # one per engine: two loops would step it at once


def test_two_jobs_shards_share_the_engine_with_their_solo_outputs(loop, llm_engine) -> None:
    a, b = rows("a", 5, 6), rows("b", 4, 3)
    execution = ShardsExecution(llm_engine, GREEDY)
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


def test_cancelling_one_shard_aborts_its_rows_and_the_other_completes(loop, llm_engine) -> None:
    stop_at = time.monotonic() + 0.5
    execution = ShardsExecution(llm_engine, GREEDY)
    results = run_together(loop, {"cancelled": (execution, rows("c", 4, 200), lambda: time.monotonic() > stop_at),
                                  "kept": (execution, rows("k", 4, 12), lambda: False)})
    cancelled, kept = results["cancelled"], results["kept"]
    assert cancelled.cancelled and len(cancelled.records) < 4
    assert not kept.cancelled and sorted(texts(kept)) == [f"k-{i}" for i in range(4)]
    assert not llm_engine.has_unfinished_requests(), "the cancelled shard's rows must be aborted in the engine"


class Broken(ShardsExecution):
    def _prepare(self, request):
        raise RuntimeError("this shard cannot be prepared")


def test_one_shards_error_fails_it_alone_and_the_loop_goes_on(loop, llm_engine) -> None:
    results = run_together(loop, {"broken": (Broken(llm_engine, GREEDY), rows("x", 2, 4), lambda: False),
                                  "fine": (ShardsExecution(llm_engine, GREEDY), rows("f", 3, 4), lambda: False)})
    assert isinstance(results["broken"], RuntimeError)
    assert sorted(texts(results["fine"])) == ["f-0", "f-1", "f-2"]
    again = loop.run(ShardsExecution(llm_engine, GREEDY), rows("g", 2, 4), "after-")
    assert sorted(texts(again)) == ["g-0", "g-1"] and loop.thread.is_alive()


def test_a_short_shard_reports_all_its_rows_and_flushes(loop, llm_engine) -> None:
    counts = Counts()
    outcome = loop.run(ShardsExecution(llm_engine, GREEDY), rows("p", 3, 2), "p-", progress=counts)
    assert (counts.rows, counts.tokens, counts.flushed) == (3, 6, 1)
    assert outcome.totals()["completion_tokens"] == 6


def test_shards_in_flight_fill_a_batch_and_one_more() -> None:
    assert shards_in_flight(256, 500) == 2
    assert shards_in_flight(256, 16) == 17
    assert shards_in_flight(256, 16, kv_rows=64) == 5
