"""Fixtures for the agent tests: a real redis-server, stores of both kinds, replay workers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import redis
from testutil import free_port

from openglm.agent.config import AgentConfig
from openglm.agent.store.redis_store import RedisStore
from openglm.agent.store.sqlite_store import SQLiteStore

sys.path.insert(0, os.path.dirname(__file__))  # agent_testkit.py (tests use --import-mode=importlib)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    if not shutil.which("redis-server"):
        pytest.fail("redis-server is not installed (make system-deps)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = SQLiteStore(str(tmp_path / "agent.db"))
    else:
        s = RedisStore(request.getfixturevalue("redis_url"), prefix=f"test-{uuid.uuid4().hex[:8]}:")
    yield s
    s.close()


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture
def config(tmp_path):
    return AgentConfig(data_dir=str(tmp_path / "data"), lease_ttl=3.0, poll_interval=0.05)
