"""State a worker process keeps is owned, not module-level: a LoRA adapter's id is derived (no table of ids), its
download is serialised by a lock file (no table of locks), and job events are published by the session factory
they are installed on (no module-level publisher)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from workers import events
from workers.adapters import adapter_id, download_lock, lora_request


def test_an_adapters_id_is_derived_from_its_name_and_directory(tmp_path) -> None:
    first = lora_request("sql", tmp_path / "a")
    assert first.lora_int_id == adapter_id("sql", str(tmp_path / "a")) >= 1  # the same in every process
    assert lora_request("sql", tmp_path / "a") == first
    assert len({adapter_id(name, tmp_path / d) for name in ("sql", "poet") for d in ("a", "b")}) == 4
    assert adapter_id("x" * 1000, "/") < 2**62


def test_one_download_of_an_entry_at_a_time_among_threads(tmp_path) -> None:
    entry, inside, overlaps = tmp_path / "cache" / "sql-abc", [], []

    def fetch() -> None:
        with download_lock(entry):
            overlaps.append(len(inside))
            inside.append(1)
            time.sleep(0.05)
            inside.pop()

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == [0, 0, 0, 0]


@dataclass
class Config:
    kafka_bootstrap: str = "127.0.0.1:9"
    events_topic: str = "tokenmill.events"


def test_job_events_belong_to_the_session_factory_they_are_installed_on() -> None:
    sessions = sessionmaker(create_engine("sqlite://"))
    publisher = events.install(Config(), sessions)
    assert publisher is not None and events.install(Config(), sessions) is publisher  # once per factory
    session, other = sessions(), sessions()
    session.info[events.PENDING] = [{"job_id": "j"}]
    assert other.info[events.PUBLISHER] is publisher and events.PENDING not in other.info
    assert events.install(Config(), sessionmaker()) is not publisher  # another factory, its own
    assert events.install(Config(kafka_bootstrap=""), sessionmaker()) is None  # no Kafka: nothing published
