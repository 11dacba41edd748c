"""`LLMEngine.stream` on a tiny random model: a stop request or a caller that stops iterating ends the stream,
and the requests it added that had not finished are aborted, their KV blocks freed."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tokenmill.bench.tiny_model import save_random_model

LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_random_model(path)
    return LLM(str(path), num_threads=1, max_num_seqs=2).engine


def requests(count: int, fed: list[int]):
    for i in range(count):
        fed.append(i)
        yield f"r{i}", f"Question {i}:", LONG


def assert_idle(engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.usable_blocks


def test_should_stop_ends_the_stream_and_aborts_what_runs(engine) -> None:
    asked, fed = [], []

    def stop_after_five_steps() -> bool:
        asked.append(1)
        return len(asked) > 5

    outputs = list(engine.stream(requests(6, fed), should_stop=stop_after_five_steps))
    assert outputs == [] and len(asked) == 6  # 40 tokens each: nothing finished in five steps
    assert fed == [0, 1, 2, 3]  # at most 2 * max_num_seqs pending, pulled lazily
    assert_idle(engine)


def test_a_caller_that_stops_iterating_aborts_the_rest(engine) -> None:
    fed = []
    short = (("s0", "Hi", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)),)
    stream = engine.stream([*short, *requests(3, fed)])
    first = next(stream)
    assert first.request_id == "s0" and engine.has_unfinished_requests()
    stream.close()
    assert_idle(engine)
    assert [o.request_id for o in engine.stream(requests(2, []))] == ["r0", "r1"]  # the engine goes on
    assert_idle(engine)
