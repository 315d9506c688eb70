"""One suite, run against both SQLiteStore and RedisStore (a real redis-server)."""

import os
import subprocess
import sys
import threading
import time

import pytest

from openglm.agent.store import LeaseLost, StateConflict, TaskNotFound
from openglm.agent.store.sqlite_store import SQLiteStore
from openglm.agent.task import Task, TaskState


def new_task(store, objective="do it", **kw) -> Task:
    import uuid

    return store.create_task(Task(id="t-" + uuid.uuid4().hex[:10], objective=objective, workspace="/tmp", **kw))


def test_create_get_list_update(store):
    a = new_task(store, "first")
    time.sleep(0.01)
    b = new_task(store, "second", constraints={"timeout": "1h"})
    assert store.get_task(b.id).constraints == {"timeout": "1h"}
    assert [t.id for t in store.list_tasks()][:2] == [b.id, a.id]
    t = store.update_task(a.id, {"phase": "fixing", "progress": 0.5})
    assert (t.phase, t.progress) == ("fixing", 0.5)
    assert store.get_task(a.id).phase == "fixing"
    with pytest.raises(TaskNotFound):
        store.get_task("t-missing")
    with pytest.raises(KeyError):
        store.update_task(a.id, {"no_such_field": 1})


def test_events_append_only_with_seq_and_paging(store):
    t = new_task(store)
    assert store.append(t.id, [("a", 0, {"i": 0}), ("b", 1, {"i": 1})]) == [1, 2]
    assert store.append(t.id, [("c", 2, {"text": "中文"})], {"step": 2}) == [3]
    assert store.get_task(t.id).step == 2
    evs = store.events(t.id)
    assert [(e.seq, e.kind, e.step) for e in evs] == [(1, "a", 0), (2, "b", 1), (3, "c", 2)]
    assert evs[2].data == {"text": "中文"} and evs[0].ts <= evs[2].ts
    assert [e.seq for e in store.events(t.id, after=1, limit=1)] == [2]
    assert store.event_count(t.id) == 3
    many = [("x", i, {}) for i in range(30)]
    store.append(t.id, many)
    assert [e.seq for e in store.all_events(t.id)] == list(range(1, 34))


def test_fenced_writes_and_expected_state(store):
    t = new_task(store)
    claimed = store.claim("w1", ttl=30)
    assert claimed.id == t.id and claimed.state == "RUNNING" and claimed.worker == "w1"
    store.append(t.id, [("ok", 1, {})], worker="w1")
    with pytest.raises(LeaseLost):
        store.append(t.id, [("intruder", 1, {})], {"phase": "x"}, worker="w2")
    assert [e.kind for e in store.events(t.id)] == ["ok"]  # nothing of the refused write landed
    assert store.get_task(t.id).phase == ""
    with pytest.raises(StateConflict):
        store.update_task(t.id, {"state": "PAUSED"}, expect_state={"QUEUED"})
    store.update_task(t.id, {"control": "pause"}, expect_state={"RUNNING"})
    assert store.heartbeat(t.id, "w1", 30).control == "pause"
    with pytest.raises(LeaseLost):
        store.heartbeat(t.id, "w2", 30)


def test_claim_is_exclusive_under_concurrency(store):
    ids = {new_task(store).id for _ in range(8)}
    got, lock = [], threading.Lock()

    def claimer(name):
        while (task := store.claim(name, ttl=30)) is not None:
            with lock:
                got.append(task.id)

    threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in range(4)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    assert sorted(got) == sorted(ids)  # each task claimed exactly once


def test_expired_lease_is_reclaimed_and_old_worker_fenced(store):
    t = new_task(store)
    store.claim("w1", ttl=0.3)
    assert store.claim("w2", ttl=30) is None  # lease still valid
    time.sleep(0.4)
    again = store.claim("w2", ttl=30)
    assert again.id == t.id and again.worker == "w2"
    with pytest.raises(LeaseLost):
        store.heartbeat(t.id, "w1", 30)


def test_terminal_and_paused_tasks_are_not_claimed(store):
    t = new_task(store)
    store.update_task(t.id, {"state": TaskState.PAUSED.value})
    assert store.claim("w", 30) is None
    store.update_task(t.id, {"state": TaskState.QUEUED.value})
    assert store.claim("w", 30).id == t.id
    store.update_task(t.id, {"state": TaskState.SUCCEEDED.value, "lease_until": 0.0})
    assert store.claim("w", 30) is None


def test_sqlite_survives_sigkill_mid_transaction(tmp_path):
    db = str(tmp_path / "a.db")
    s = SQLiteStore(db)
    t = new_task(s)
    s.append(t.id, [("before", 0, {})], {"phase": "before"})
    code = ("import sys; from openglm.agent.store.sqlite_store import SQLiteStore as S; "
            f"S({db!r}).append({t.id!r}, [('lost', 1, {{}}), ('lost', 2, {{}})], {{'phase': 'lost'}})")
    env = dict(os.environ, OPENGLM_CRASH_AT="2")  # 1st crash point: the schema tx; 2nd: inside append
    p = subprocess.run([sys.executable, "-c", code], env=env)
    assert p.returncode == -9
    s2 = SQLiteStore(db)
    assert [e.kind for e in s2.events(t.id)] == ["before"] and s2.get_task(t.id).phase == "before"
    s2.append(t.id, [("after", 1, {})])
    assert [e.seq for e in s2.events(t.id)] == [1, 2]
