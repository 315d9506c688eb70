"""Task stores: one interface (`Store`), SQLite and Redis implementations."""

from openglm.agent.store.base import (Event, LeaseLost, StateConflict, Store, StoreCorrupt, StoreError,
                                      StoreUnavailable, TaskNotFound, open_store)

__all__ = ["Event", "LeaseLost", "StateConflict", "Store", "StoreCorrupt", "StoreError", "StoreUnavailable",
           "TaskNotFound", "open_store"]
