"""Noticing a broker that lost its state. The database keeps a marker, a deployment id and a generation, whose
generation is also written into the broker (a Redis key beside the queues, one per database, so deployments
sharing a Redis keep theirs apart). Each check that finds the broker's generation current moves both on, under
the marker row's lock. A FLUSHALL or a Redis restart without persistence loses the key with the queued tasks; a
Redis restored from a snapshot holds an older generation and lacks what was sent since. Either way the sweep
finds the broker lost and resends all waiting work without the grace period, and the marker is put back
(`restore_marker`) only once that resend was sent: a sweep that fails or dies before sending leaves the loss to
the next. Brokers that keep their queues durably (RabbitMQ) need no marker."""

from __future__ import annotations

import logging
import uuid

from sqlalchemy.orm import Session, sessionmaker

from storage.models import ServiceMarker

log = logging.getLogger("tokenmill.sweep")

KEY = "tokenmill:broker-marker"
NAME = "broker"  # the marker's row in service_markers: "<deployment id>.<generation>"


def _uses_marker(broker_url: str) -> bool:
    return broker_url.startswith(("redis://", "rediss://"))


def _redis_client(broker_url: str):
    import redis

    return redis.Redis.from_url(broker_url, socket_timeout=5)


broker_client = _redis_client  # the fault explorer (`workers.sim`) puts its simulated broker here


def _read(marker: ServiceMarker) -> tuple[str, int | None]:
    """(deployment id, generation); no generation in a marker written before there were any."""
    deployment, _, generation = marker.value.partition(".")
    return deployment, int(generation) if generation else None


def broker_lost(sessions: sessionmaker[Session], broker_url: str) -> bool:
    """Did the broker lose its state (the marker gone or older than the database's)? True until
    `restore_marker`. Unknown (the broker or the database down) counts as not lost: the grace period applies."""
    if not _uses_marker(broker_url):
        return False
    try:
        with broker_client(broker_url) as client, sessions.begin() as session:
            marker = session.get(ServiceMarker, NAME, with_for_update=True)
            if marker is None:  # the first check of this database
                deployment = uuid.uuid4().hex
                session.add(ServiceMarker(name=NAME, value=f"{deployment}.1"))
                client.set(f"{KEY}:{deployment}", b"1")
                return False
            deployment, generation = _read(marker)
            held = client.get(f"{KEY}:{deployment}")
            if held is None or (generation is not None and held != str(generation).encode()):
                log.warning("the broker lost its state (its marker is %s): resending all waiting work now",
                            "gone" if held is None else f"generation {held.decode()}, not {generation}")
                return True
            generation = (generation or 0) + 1  # written to the broker before the commit, under the row's lock
            marker.value = f"{deployment}.{generation}"
            client.set(f"{KEY}:{deployment}", str(generation).encode())
    except Exception as error:
        log.warning("could not check the broker marker: %s", error)
    return False


def restore_marker(sessions: sessionmaker[Session], broker_url: str) -> None:
    """Put the database's marker back into the broker: call once the work resent after a loss was sent."""
    if not _uses_marker(broker_url):
        return
    try:
        with broker_client(broker_url) as client, sessions.begin() as session:
            marker = session.get(ServiceMarker, NAME, with_for_update=True)
            if marker is not None:
                deployment, generation = _read(marker)
                client.set(f"{KEY}:{deployment}", str(generation or 1).encode())
    except Exception as error:  # the next sweep finds the broker lost again and resends once more
        log.warning("could not put the broker marker back: %s", error)
