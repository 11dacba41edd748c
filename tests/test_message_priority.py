"""The broker priority of shard tasks: job priority first, then each job's first shards before later ones."""

from __future__ import annotations

from workers.tasks import config, message_priority

REDIS, RABBIT = "redis://127.0.0.1:6379/0", "amqp://guest:guest@127.0.0.1:5672//"


def order(broker: str, tasks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(job priority, shard index) in the order the broker hands them out (Redis: lowest level first)."""
    sign = 1 if broker.startswith("redis") else -1
    return sorted(tasks, key=lambda task: sign * message_priority(*task, broker))


def test_a_higher_job_priority_goes_first_on_both_brokers() -> None:
    tasks = [(-3, 0), (0, 0), (7, 20), (0, 9)]
    for broker in (REDIS, RABBIT):
        assert order(broker, tasks) == [(7, 20), (0, 0), (0, 9), (-3, 0)]


def test_a_jobs_first_shards_go_before_another_jobs_later_ones_of_equal_priority() -> None:
    head = config.fair_share_shards
    assert order(REDIS, [(0, head), (0, 2 * head + 5), (0, 0)]) == [(0, 0), (0, head), (0, 2 * head + 5)]
    levels = {message_priority(p, i, broker)
              for p in (-9, 0, 9) for i in (0, head, 10**6) for broker in (REDIS, RABBIT)}
    assert levels <= set(range(10)), "Redis priority_steps and RabbitMQ x-max-priority are 0..9"
