"""Bearer tokens of the OpenAI Batch API: made here, stored as their SHA-256 only, each acting for one tenant."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from storage.models import ApiKey, utcnow

TOKEN_PREFIX = "tm-"


def key_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def create_key(session: Session, tenant: str, name: str | None = None) -> str:
    """A new key for tenant; the token is returned once and never stored."""
    if not tenant or len(tenant) > 255:
        raise ValueError("a tenant is a name of 1 to 255 characters")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiKey(tenant=tenant, name=name, key_hash=key_hash(token), key_prefix=token[:10]))
    return token


def tenant_of(session: Session, token: str) -> str | None:
    """The tenant a live key acts for; None for an unknown or revoked one."""
    return session.scalar(select(ApiKey.tenant).where(ApiKey.key_hash == key_hash(token),
                                                      ApiKey.revoked_at.is_(None)))


def tenant_of_token(engine: Engine, token: str) -> str | None:
    """`tenant_of` that takes no write lock, for checks of every request: on SQLite every session begins with
    BEGIN IMMEDIATE, so this runs one autocommit SELECT on a raw pooled connection (WAL: it never waits for a
    writer, and a flood of bad keys cannot stall the jobs' writes); elsewhere a plain read."""
    if engine.dialect.name != "sqlite":
        with engine.connect() as connection:
            return connection.scalar(select(ApiKey.tenant).where(ApiKey.key_hash == key_hash(token),
                                                                 ApiKey.revoked_at.is_(None)))
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("SELECT tenant FROM api_keys WHERE key_hash = :hash AND revoked_at IS NULL",
                       {"hash": key_hash(token)})
        row = cursor.fetchone()
        cursor.close()
    finally:
        raw.close()
    return None if row is None else row[0]


def list_keys(session: Session, tenant: str | None = None) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
    return list(session.scalars(query if tenant is None else query.where(ApiKey.tenant == tenant)))


def revoke_key(session: Session, key_id: int) -> bool:
    """Revoke the key with this id (as `key list` shows it); False when there is no such live key."""
    key = session.get(ApiKey, key_id)
    if key is None or key.revoked_at is not None:
        return False
    key.revoked_at = utcnow()
    return True
