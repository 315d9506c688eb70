"""Task stores: one interface (`Store`), SQLite and Redis implementations."""

from openglm.agent.store.base import (
    Event,
    LeaseLost,
    StateConflict,
    Store,
    StoreCorrupt,
    StoreError,
    StoreUnavailable,
    TaskNotFound,
)
from openglm.agent.store.redis_store import RedisStore
from openglm.agent.store.sqlite_store import SQLiteStore


def open_store(url: str) -> Store:
    """'sqlite:///path/to.db', a plain path, or 'redis://host:port/db'."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url)
    return SQLiteStore(url.removeprefix("sqlite://"))


__all__ = ["Event", "LeaseLost", "RedisStore", "SQLiteStore", "StateConflict", "Store", "StoreCorrupt", "StoreError",
           "StoreUnavailable", "TaskNotFound", "open_store"]
