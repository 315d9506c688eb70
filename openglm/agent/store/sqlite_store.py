"""SQLite store (the embedded default): WAL journal, one IMMEDIATE transaction per write.

A SIGKILL mid-write leaves the previous committed state (SQLite's journal rolls the partial
transaction back on the next open). Several processes on one machine may share the file.

Faults: every sqlite3 operational error (disk full, I/O error, a corrupt page, locked past the
busy timeout) surfaces as `StoreUnavailable` with nothing written, so the worker backs off and
retries. The file is integrity-checked (`PRAGMA quick_check`) when opened; a corrupt one is refused
with `StoreCorrupt` naming the recovery commands. `backup`/`restore` use SQLite's online backup API.

The store is watched: every commit (and `check`, which /health calls) first makes sure the path still
names the file that was opened (same device and inode). A database deleted or replaced under a running
server would otherwise take every later write with it (they would go to an unlinked file); instead the
store is `lost` from then on: every call raises StoreUnavailable("lost", why), so workers stop their
runs with nothing more committed and /health answers 503 with `store: lost (...)`.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
import time
from contextlib import contextmanager

from openglm.agent.faults import crashpoint
from openglm.agent.store.base import (
    Event,
    LeaseLost,
    StateConflict,
    Store,
    StoreCorrupt,
    StoreUnavailable,
    TaskNotFound,
    event_from_json,
    event_json,
)
from openglm.agent.task import Task, TaskState

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (id TEXT PRIMARY KEY, state TEXT NOT NULL, worker TEXT NOT NULL,
    lease_until REAL NOT NULL, created_at REAL NOT NULL, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS tasks_state ON tasks(state, created_at);
CREATE TABLE IF NOT EXISTS events (task_id TEXT NOT NULL, seq INTEGER NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (task_id, seq));
"""


def _reason(exc: sqlite3.Error) -> str:
    text = str(exc).lower()
    for needle, reason in (("full", "disk full"), ("malformed", "database is corrupt"), ("not a database",
                           "database is corrupt"), ("locked", "database is locked"), ("busy", "database is locked"),
                           ("i/o", "disk I/O error"), ("readonly", "database is read-only")):
        if needle in text:
            return reason
    return "sqlite error"


@contextmanager
def _unavailable_on_sqlite_errors():
    try:
        yield
    except (sqlite3.OperationalError, sqlite3.DatabaseError) as exc:
        if isinstance(exc, (sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.InterfaceError)):
            raise  # a bug, not the store's health
        raise StoreUnavailable(_reason(exc), str(exc)) from exc


def recovery_hint(path: str) -> str:
    return (f"restore a backup with `openglm task restore BACKUP --store {path}`, or salvage it with "
            f"`sqlite3 {path} .recover | sqlite3 {path}.recovered` and move that into place")


class SQLiteStore(Store):
    def __init__(self, path: str, synchronous: str = "NORMAL"):
        self.path = path
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self._lock = threading.Lock()  # the heartbeat thread shares this connection
        self.lost: str | None = None  # why the store stopped (its file was deleted or replaced)
        try:
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            self._db.execute("PRAGMA busy_timeout=30000")
            problems = [r[0] for r in self._db.execute("PRAGMA quick_check").fetchall()]
        except sqlite3.DatabaseError as exc:  # "file is not a database": truncated or overwritten
            raise StoreCorrupt(f"the task store {path} is unreadable ({exc}): {recovery_hint(path)}") from None
        if problems != ["ok"]:
            self._db.close()
            raise StoreCorrupt(f"the task store {path} is corrupt ({problems[0]}): {recovery_hint(path)}")
        self._file = self._identity()
        with self._tx() as db:
            for statement in filter(str.strip, _SCHEMA.split(";")):
                db.execute(statement)

    def _identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def _watch(self) -> None:
        """StoreUnavailable("lost") once the path no longer names the file this store opened."""
        if self.lost is None:
            now = self._identity()
            if now == self._file:
                return
            self.lost = (f"the database file {self.path} was {'deleted' if now is None else 'replaced'} while the "
                         "server ran; nothing more is written to it (restart to open what is there now, or restore "
                         "a backup)")
            print(f"openglm: store: lost ({self.lost})", file=sys.stderr, flush=True)
        raise StoreUnavailable("lost", self.lost)

    @contextmanager
    def _tx(self):
        with self._lock, _unavailable_on_sqlite_errors():
            self._watch()
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            crashpoint("store_before_commit")  # the kill test kills here too
            try:
                self._watch()  # the file may have gone while the transaction was being built
                self._db.execute("COMMIT")
            except (sqlite3.Error, StoreUnavailable):
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    @contextmanager
    def _read(self):
        with self._lock, _unavailable_on_sqlite_errors():
            self._watch()  # a lost store's answers would be stale: refuse them too
            yield self._db

    def backup(self, dest: str) -> None:
        """A consistent copy of the live store (SQLite's online backup API: writers keep going)."""
        target = sqlite3.connect(dest)
        try:
            with self._read() as db:
                db.backup(target)
        finally:
            target.close()

    @staticmethod
    def restore(src: str, path: str) -> None:
        """Replace the store at `path` with the backup `src` (checked first; no worker may be running)."""
        source = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
        try:
            try:
                problems = [r[0] for r in source.execute("PRAGMA quick_check").fetchall()]
            except sqlite3.DatabaseError as exc:
                raise StoreCorrupt(f"the backup {src} is unreadable ({exc})") from None
            if problems != ["ok"]:
                raise StoreCorrupt(f"the backup {src} is corrupt ({problems[0]})")
            for stale in (path, f"{path}-wal", f"{path}-shm"):  # a corrupt target may not even open
                if os.path.exists(stale):
                    os.unlink(stale)
            target = sqlite3.connect(path)
            try:
                source.backup(target)
            finally:
                target.close()
        finally:
            source.close()

    def close(self):
        self._db.close()

    # tasks
    def create_task(self, task: Task, events=()) -> Task:
        with self._tx() as db:
            db.execute("INSERT INTO tasks VALUES (?,?,?,?,?,?)",
                       (task.id, task.state, task.worker, task.lease_until, task.created_at,
                        json.dumps(task.to_dict(), ensure_ascii=False)))
            db.executemany("INSERT INTO events VALUES (?,?,?)",
                           [(task.id, i + 1, event_json(k, st, d)) for i, (k, st, d) in enumerate(events)])
        return task

    def _load(self, db, task_id: str) -> Task:
        row = db.execute("SELECT body FROM tasks WHERE id=?", (task_id,)).fetchone()
        if row is None:
            raise TaskNotFound(task_id)
        return Task.from_dict(json.loads(row[0]))

    def _save(self, db, task: Task):
        task.updated_at = time.time()
        db.execute("UPDATE tasks SET state=?, worker=?, lease_until=?, body=? WHERE id=?",
                   (task.state, task.worker, task.lease_until, json.dumps(task.to_dict(), ensure_ascii=False),
                    task.id))

    def get_task(self, task_id: str) -> Task:
        with self._read() as db:
            return self._load(db, task_id)

    def list_tasks(self, limit: int = 100, offset: int = 0) -> list[Task]:
        with self._read():
            rows = self._db.execute("SELECT body FROM tasks ORDER BY created_at DESC LIMIT ? OFFSET ?",
                                    (limit, offset)).fetchall()
        return [Task.from_dict(json.loads(r[0])) for r in rows]

    def _apply(self, db, task_id, fields, worker, expect_state) -> Task:
        task = self._load(db, task_id)
        if worker is not None and task.worker != worker:
            raise LeaseLost(f"task {task_id} is owned by {task.worker or 'nobody'}, not {worker}")
        if expect_state is not None and task.state not in expect_state:
            raise StateConflict(f"task {task_id} is {task.state}, expected one of {sorted(expect_state)}")
        for k, v in (fields or {}).items():
            if k not in Task.__dataclass_fields__:
                raise KeyError(f"unknown task field {k!r}")
            setattr(task, k, v)
        self._save(db, task)
        return task

    def update_task(self, task_id, fields, *, worker=None, expect_state=None) -> Task:
        with self._tx() as db:
            return self._apply(db, task_id, fields, worker, expect_state)

    # events
    def append(self, task_id, events, fields=None, *, worker=None, expect_state=None) -> list[int]:
        with self._tx() as db:
            self._apply(db, task_id, fields, worker, expect_state)
            last = db.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE task_id=?", (task_id,)).fetchone()[0]
            seqs = list(range(last + 1, last + 1 + len(events)))
            db.executemany("INSERT INTO events VALUES (?,?,?)",
                           [(task_id, s, event_json(k, st, d)) for s, (k, st, d) in zip(seqs, events)])
        return seqs

    def events(self, task_id, after=0, limit=1000) -> list[Event]:
        with self._read():
            rows = self._db.execute("SELECT seq, body FROM events WHERE task_id=? AND seq>? ORDER BY seq LIMIT ?",
                                    (task_id, after, limit)).fetchall()
        return [event_from_json(s, b) for s, b in rows]

    def event_count(self, task_id) -> int:
        with self._read():
            return self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE task_id=?",
                                    (task_id,)).fetchone()[0]

    # leases
    def claim(self, worker, ttl) -> Task | None:
        now = time.time()
        with self._tx() as db:
            row = db.execute(
                "SELECT id FROM tasks WHERE state=? OR (state=? AND lease_until<?) ORDER BY created_at LIMIT 1",
                (TaskState.QUEUED.value, TaskState.RUNNING.value, now)).fetchone()
            if row is None:
                return None
            return self._apply(db, row[0], {"state": TaskState.RUNNING.value, "worker": worker,
                                            "lease_until": now + ttl}, None, None)

    def heartbeat(self, task_id, worker, ttl) -> Task:
        return self.update_task(task_id, {"lease_until": time.time() + ttl}, worker=worker)
