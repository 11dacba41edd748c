"""A tenant's quotas held under concurrency: its checks run one at a time, in the transaction that records
what they admit (an upload's reservation, a batch's row), so two requests cannot both pass on the same headroom.
On PostgreSQL that is a transaction-scoped advisory lock per tenant; SQLite's write lock (BEGIN IMMEDIATE)
already serializes every writing transaction. The batch checks of one API process are also bounded per tenant,
refused ones included: each reads up to the whole input file."""

from __future__ import annotations

import threading
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import func, select
from sqlalchemy.orm import Session

TENANT_QUOTA_LOCK = 0x746D_7471  # the advisory lock's first key ("tmtq"); the second is the tenant's
CHECKS_PER_TENANT = 2  # batch inputs of one tenant read at once by one API process


def lock_tenant(db: Session, tenant: str) -> None:
    """Until this transaction ends, no other transaction passes this call for the same tenant."""
    if db.get_bind().dialect.name == "postgresql":
        key = zlib.crc32(tenant.encode()) - (1 << 31)  # PostgreSQL's int4
        db.execute(select(func.pg_advisory_xact_lock(TENANT_QUOTA_LOCK, key)))


class NoSlot(Exception):
    pass


class TenantSlots:
    """At most `limit` of a tenant's requests of one kind at once in this process (batch checks, uploads); NoSlot
    beyond."""

    def __init__(self, limit: int) -> None:
        self.limit, self._lock, self._running = limit, threading.Lock(), Counter()

    @contextmanager
    def slot(self, tenant: str) -> Iterator[None]:
        with self._lock:
            if self._running[tenant] >= self.limit:
                raise NoSlot(tenant)
            self._running[tenant] += 1
        try:
            yield
        finally:
            with self._lock:
                self._running[tenant] -= 1
                if not self._running[tenant]:
                    del self._running[tenant]
