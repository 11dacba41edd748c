"""Noticing a broker that lost its state. The database keeps a random marker that is also written into the
broker (a Redis key beside the queues); a FLUSHALL or a Redis restart without persistence loses the key with
the queued tasks, so the next sweep finds it missing and resends all waiting work without the grace period.
Brokers that keep their queues durably (RabbitMQ) need no marker."""

from __future__ import annotations

import logging
import uuid

from sqlalchemy.orm import Session, sessionmaker

from storage.models import ServiceMarker

log = logging.getLogger("tokenmill.sweep")

KEY = "tokenmill:broker-marker"


def broker_lost(sessions: sessionmaker[Session], broker_url: str) -> bool:
    """True once after the broker lost the marker (its state); the marker is put back. Unknown (the broker or
    the database down) counts as not lost: the grace period still applies."""
    if not broker_url.startswith(("redis://", "rediss://")):
        return False
    import redis

    try:
        with redis.Redis.from_url(broker_url, socket_timeout=5) as client, sessions.begin() as session:
            marker = session.get(ServiceMarker, "broker")
            first = marker is None
            if first:  # the first sweep of this database
                marker = ServiceMarker(name="broker", value=uuid.uuid4().hex)
                session.add(marker)
            key = f"{KEY}:{marker.value}"  # one key per database: deployments sharing a Redis keep theirs apart
            present = bool(client.exists(key))
            if not present:
                client.set(key, b"1")
    except Exception as error:
        log.warning("could not check the broker marker: %s", error)
        return False
    if first or present:
        return False
    log.warning("the broker lost its state (its marker is gone): resending all waiting work now")
    return True
