"""Store faults: a full disk, a corrupt file, a Redis restart and a dead worker thread
never kill the runtime silently, never fail a task by a blip, and never leave half a task."""

import shutil
import subprocess
import sys
import threading
import time
import uuid

import pytest
import redis
from agent_testkit import call, turn
from testutil import free_port

from openglm.agent import service
from openglm.agent.api import create_app
from openglm.agent.llm import ReplayModel
from openglm.agent.server import WorkerPool
from openglm.agent.store import StoreCorrupt, StoreUnavailable
from openglm.agent.store.redis_store import RedisStore
from openglm.agent.store.sqlite_store import SQLiteStore
from openglm.agent.worker import Worker

TURNS = [turn(call("bash", command=f"echo step{i} >> log.txt")) for i in range(1, 4)] + [
    turn(call("submit", summary="done"))]


def disk_full(store: SQLiteStore, full: bool) -> None:
    """SQLite's own size limit, with every free byte of the task and event tables below it taken:
    writes then fail with the real SQLITE_FULL "database or disk is full". Freeing deletes the
    filler rows and lifts the limit."""
    import sqlite3

    db = store._db
    if not full:
        db.execute(f"PRAGMA max_page_count={1 << 30}")
        db.execute("DELETE FROM events WHERE task_id LIKE '~filler%'")
        db.execute("DELETE FROM tasks WHERE id LIKE '~filler%'")
        return
    db.execute(f"PRAGMA max_page_count={db.execute('PRAGMA page_count').fetchone()[0]}")
    n = 0
    for size in (2048, 256, 32, 1):
        for sql in ("INSERT INTO events VALUES ('~filler', ?, ?)",
                    "INSERT INTO tasks VALUES ('~filler' || ?, 'FILLER', '', 0, 0, ?)"):
            try:
                while True:
                    n += 1
                    db.execute(sql, (n, "x" * size))
            except sqlite3.OperationalError:
                pass


class FillsTheDisk(ReplayModel):
    """Replays TURNS; the store's disk is full from the moment the model answers turn `at`."""

    def __init__(self, store, at: int):
        super().__init__(TURNS)
        self.store, self.at, self.filled = store, at, threading.Event()

    def query(self, messages, tools=None):
        response = super().query(messages, tools)
        if sum(1 for m in messages if m.get("role") == "assistant") == self.at and not self.filled.is_set():
            disk_full(self.store, True)
            self.filled.set()
        return response


def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_disk_full_pauses_the_task_with_the_reason_and_the_worker_survives(tmp_path, config, workspace):
    store = SQLiteStore(str(tmp_path / "agent.db"))
    task = service.submit(store, config, "three steps", str(workspace))
    model = FillsTheDisk(store, at=2)
    worker = Worker(config, store=store, model=model)
    stop = threading.Event()
    thread = threading.Thread(target=worker.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        model.filled.wait(30)
        wait_for(lambda: worker.store_error is not None, what="the worker to see the full disk")
        time.sleep(1.0)  # the worker backs off and retries while the disk stays full
        assert thread.is_alive() and "disk full" in worker.store_error
        disk_full(store, False)  # space is freed: the pause is recorded, with its reason
        wait_for(lambda: store.get_task(task.id).state == "PAUSED", what="PAUSED")
        paused = store.get_task(task.id)
        assert paused.reason.startswith("store: disk full") and paused.step == 2 and paused.worker == ""
        assert worker.store_error is None and thread.is_alive()
        service.resume(store, task.id)  # the human resumes it; the model is told why it paused
        wait_for(lambda: store.get_task(task.id).state == "SUCCEEDED", what="SUCCEEDED")
    finally:
        stop.set()
        thread.join(10)
    events = store.all_events(task.id)
    guidance = [e for e in events if e.kind == "guidance"]
    assert len(guidance) == 1 and "disk full" in guidance[0].data["content"] and guidance[0].step == 2
    committed = [e.step for e in events if e.kind == "step_committed"]
    assert committed == [0, 1, 2, 3, 4]  # no step lost, none repeated
    assert (workspace / "log.txt").read_text() == "step1\nstep2\nstep3\n"


def test_submit_is_one_transaction(tmp_path, config):
    store = SQLiteStore(str(tmp_path / "agent.db"))
    disk_full(store, True)
    with pytest.raises(StoreUnavailable, match="disk full"):
        service.submit(store, config, "no room")  # a created workspace, a task row and its first event
    disk_full(store, False)
    assert store.list_tasks() == []
    assert not (tmp_path / "data" / "workspaces").exists() or not any((tmp_path / "data" / "workspaces").iterdir())
    task = service.submit(store, config, "room again")
    assert [e.kind for e in store.all_events(task.id)] == ["task_created"]


def test_api_answers_503_while_the_store_is_unavailable(tmp_path, config):
    from fastapi.testclient import TestClient

    store = SQLiteStore(str(tmp_path / "agent.db"))
    client = TestClient(create_app(config, store=store), base_url="http://localhost")
    disk_full(store, True)
    resp = client.post("/v1/tasks", json={"objective": "x"})
    assert resp.status_code == 503 and "disk full" in resp.json()["detail"] and resp.headers["retry-after"]
    disk_full(store, False)
    assert client.post("/v1/tasks", json={"objective": "x"}).status_code == 201


def corrupt(path, how: str) -> None:
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(100)
    else:  # damaged b-tree page headers in the middle of the file
        with open(path, "r+b") as f:
            for page in (2, 3, 4):
                f.seek(4096 * (page - 1))
                f.write(b"\xff" * 64)


@pytest.mark.parametrize("how", ["truncated", "page"])
def test_a_corrupt_sqlite_store_is_refused_with_one_line_and_a_recovery_command(tmp_path, config, how):
    path = tmp_path / "agent.db"
    store = SQLiteStore(str(path))
    for i in range(40):
        service.submit(store, config, f"task {i} " + "x" * 500)
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    corrupt(path, how)
    with pytest.raises(StoreCorrupt, match="restore") as e:
        SQLiteStore(str(path))
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    proc = subprocess.run([sys.executable, "-m", "openglm.agent", "worker", "--once", "--store", str(path),
                           "--replay", str(tmp_path / "none.jsonl")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "openglm task restore" in proc.stderr


def test_backup_and_restore_with_the_cli(tmp_path, config):
    path, backup = tmp_path / "agent.db", tmp_path / "backup.db"
    store = SQLiteStore(str(path))
    task = service.submit(store, config, "keep me")
    run = [sys.executable, "-m", "openglm.agent", "task"]
    out = subprocess.run(run + ["backup", str(backup), "--store", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    store.close()
    corrupt(path, "truncated")
    out = subprocess.run(run + ["restore", str(backup), "--store", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    restored = SQLiteStore(str(path))
    assert restored.get_task(task.id).objective == "keep me"
    assert [e.kind for e in restored.all_events(task.id)] == ["task_created"]


class _CrashOnce:
    """A worker whose first incarnation's loop dies of a bug; the pool must bring up another."""

    def __init__(self, count):
        self.count, self.store_error = count, None

    def serve(self, stop):
        self.count.append(1)
        if len(self.count) == 1:
            raise RuntimeError("a bug in the loop")
        stop.wait()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the crash is the point
def test_a_dead_worker_thread_is_restarted_and_health_reports_liveness(tmp_path, config):
    from fastapi.testclient import TestClient

    store = SQLiteStore(str(tmp_path / "agent.db"))
    stop, count = threading.Event(), []
    pool = WorkerPool(config, 1, stop, make_worker=lambda: _CrashOnce(count))
    client = TestClient(create_app(config, store=store, workers=pool), base_url="http://localhost")
    try:
        wait_for(lambda: pool.restarts == 1 and pool.health()["workers_alive"] == 1, timeout=10, what="restart")
        body = client.get("/health").json()
        assert body["ok"] and body["workers_alive"] == 1 and body["worker_restarts"] == 1 and body["store"] == "ok"
    finally:
        stop.set()
    wait_for(lambda: pool.health()["workers_alive"] == 0, timeout=10, what="workers to stop")
    resp = client.get("/health")
    assert resp.status_code == 503 and resp.json()["workers_alive"] == 0
    down = RedisStore(f"redis://127.0.0.1:{free_port()}/0", retries=0)  # the store's health is reported too
    resp = TestClient(create_app(config, store=down), base_url="http://localhost").get("/health")
    assert resp.status_code == 503 and "redis unreachable" in resp.json()["store"]


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own, which the test stops and restarts on the same port."""
    port = free_port()

    def start():
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
                                 "--save", "", "--appendonly", "yes"], stdout=subprocess.DEVNULL)
        for _ in range(200):
            try:
                redis.Redis(port=port).ping()
                return proc
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    if not shutil.which("redis-server"):
        pytest.fail("redis-server is not installed (make system-deps)")
    state = {"proc": start()}
    yield f"redis://127.0.0.1:{port}/0", state, start
    state["proc"].terminate()
    state["proc"].wait(10)


def test_redis_restart_does_not_fail_the_task_or_kill_the_worker(tmp_path, config, workspace, own_redis):
    url, state, start = own_redis
    store = RedisStore(url, prefix=f"t-{uuid.uuid4().hex[:6]}:", retries=2)  # short retries: the loop backs off
    task = service.submit(store, config, "three steps", str(workspace))
    outage = threading.Event()

    class RestartsRedis(ReplayModel):
        def query(self, messages, tools=None):
            if sum(1 for m in messages if m.get("role") == "assistant") == 2 and not outage.is_set():
                outage.set()
                state["proc"].terminate()  # Redis goes away mid-task (AOF keeps the data)
                state["proc"].wait(10)
            return super().query(messages, tools)

    worker = Worker(config, store=store, model=RestartsRedis(TURNS))
    stop = threading.Event()
    thread = threading.Thread(target=worker.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        outage.wait(30)
        wait_for(lambda: worker.store_error is not None, what="the worker to see the outage")
        assert thread.is_alive() and "redis unreachable" in worker.store_error
        state["proc"] = start()
        wait_for(lambda: store.get_task(task.id).state in ("PAUSED", "SUCCEEDED"), what="the task to settle")
        if store.get_task(task.id).state == "PAUSED":  # the outage hit a write: paused with the reason
            assert "redis unreachable" in store.get_task(task.id).reason
            service.resume(store, task.id)
        wait_for(lambda: store.get_task(task.id).state == "SUCCEEDED", what="SUCCEEDED")
    finally:
        stop.set()
        thread.join(10)
    assert [e.step for e in store.all_events(task.id) if e.kind == "step_committed"] == [0, 1, 2, 3, 4]
    assert thread.is_alive() is False and worker.store_error is None


def test_a_redis_blip_is_absorbed_by_reconnecting(own_redis):
    url, state, start = own_redis
    store = RedisStore(url, prefix=f"t-{uuid.uuid4().hex[:6]}:")
    assert store.event_count("x") == 0
    state["proc"].terminate()
    state["proc"].wait(10)
    threading.Timer(1.0, lambda: state.update(proc=start())).start()
    assert store.event_count("x") == 0  # retried with backoff until Redis was back: no error at all
