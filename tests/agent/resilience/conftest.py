import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # helpers.py (tests use --import-mode=importlib)

import pytest  # noqa: E402

from openglm.agent.store.sqlite_store import SQLiteStore  # noqa: E402


@pytest.fixture
def store(tmp_path):
    """The resilience tests run on SQLite only: the store suite covers Redis against the same interface."""
    s = SQLiteStore(str(tmp_path / "agent.db"))
    yield s
    s.close()
