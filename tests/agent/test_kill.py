"""Kill test: SIGKILL the worker at >= 20 random points of a scripted task, restart it each time,
and compare the final workspace and event log with an uninterrupted run's.

Workers are forked child processes (real processes, really SIGKILLed): most kills land on a
random crash point of the step protocol (`faults.crashpoint`: inside store transactions, between
`git add` and the tree write, between tool calls, after the model response...), the rest at a
random moment (often in the middle of a shell command).
"""

import json
import os
import random
import signal
import time
import uuid

import pytest
from agent_testkit import call, turn
from test_snapshot import tree_of

from openglm.agent import faults, service
from openglm.agent.config import AgentConfig
from openglm.agent.llm import ReplayModel
from openglm.agent.store.redis_store import RedisStore
from openglm.agent.store.sqlite_store import SQLiteStore
from openglm.agent.worker import Worker

TURNS = [
    turn(call("create", path="src/app.py", content="def greet(name):\n    return 'hi ' + name\n")),
    turn(call("bash", command="mkdir -p data && seq 1 50 > data/numbers.txt && echo 1 >> log.txt")),
    turn(call("edit", path="src/app.py", old="'hi ' + name", new="f'hello {name}'")),
    turn(call("bash", command="sleep 0.15; echo 2 >> log.txt; rm data/numbers.txt"),
         call("create", path="data/summary.txt", content="sum\n")),
    turn(call("create", path="tests/test_app.py",
              content="import sys\nsys.path.insert(0, 'src')\nfrom app import greet\n"
                      "assert greet('x') == 'hello x'\n")),
    turn(call("bash", command="python3 tests/test_app.py && echo 3 >> log.txt")),
    turn(call("view", path="log.txt")),
    turn(call("bash", command="cp -r src backup && echo 4 >> log.txt")),
    turn(call("edit", path="data/summary.txt", old="sum", new="sum: 1275")),
    turn(call("search", pattern="hello", path="src")),
    turn(call("bash", command="rm -r backup && echo 5 >> log.txt")),
    turn(call("submit", summary="done")),
]
VOLATILE = {"ts", "latency_s", "duration_s", "worker"}


def normalized_log(store, task_id, workspace):
    out = []
    for e in store.all_events(task_id):
        if e.kind == "run_started":  # one per worker run: a lifecycle record, not part of the task's history
            continue
        text = json.dumps(e.data, sort_keys=True).replace(str(workspace), "<ws>")
        data = json.loads(text)
        strip(data)
        out.append((e.kind, e.step, data))
    return out


def strip(obj):
    if isinstance(obj, dict):
        for k in list(obj):
            if k in VOLATILE:
                del obj[k]
            else:
                strip(obj[k])
    elif isinstance(obj, list):
        for x in obj:
            strip(x)


def open_store(config, prefix):
    if config.store.startswith("redis://"):
        return RedisStore(config.store, prefix=prefix)
    return SQLiteStore(config.store_url)


def fork_worker(config, prefix, calls_log, crash_at=0):
    pid = os.fork()
    if pid == 0:  # child: a fresh worker process with its own store connection
        try:
            faults._target, faults._hits = crash_at, 0
            store = open_store(config, prefix)
            Worker(config, store=store, model=ReplayModel(TURNS, calls_log=calls_log)).run_one()
        finally:
            os._exit(0)
    return pid


def submit(tmp_path, name, redis_url, prefix):
    ws = tmp_path / name
    ws.mkdir()
    (ws / "README.md").write_text("project\n")
    config = AgentConfig(data_dir=str(tmp_path / f"{name}-data"), lease_ttl=30, store=redis_url or "")
    store = open_store(config, prefix)
    task = service.submit(store, config, "greet properly", str(ws),
                          {"deliverables": ["tests/test_app.py", {"command": "python3 tests/test_app.py"}]})
    return ws, config, store, task


def model_calls(path) -> list[tuple[int, float]]:
    lines = open(path).read().splitlines() if os.path.exists(path) else []
    return [(int(turn_index), float(t)) for turn_index, t in (line.split() for line in lines)]


def calls_per_turn(path):
    turns = [i for i, _ in model_calls(path)]
    return [turns.count(i) for i in range(len(TURNS))]


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_sigkill_anywhere_resumes_to_the_same_result(tmp_path, kind, request):
    redis_url = request.getfixturevalue("redis_url") if kind == "redis" else None
    prefix = f"kill-{uuid.uuid4().hex[:8]}:"
    ref_ws, ref_cfg, ref_store, ref_task = submit(tmp_path, "reference", redis_url, prefix + "ref:")
    _, status = os.waitpid(fork_worker(ref_cfg, prefix + "ref:", str(tmp_path / "ref-calls")), 0)
    assert status == 0 and ref_store.get_task(ref_task.id).state == "SUCCEEDED"
    assert calls_per_turn(tmp_path / "ref-calls") == [1] * len(TURNS)

    ws, config, store, task = submit(tmp_path, "killed", redis_url, prefix)
    rng = random.Random(1234)
    calls_log = str(tmp_path / "calls")
    kills, points, rounds = 0, [], 0
    while store.get_task(task.id).state != "SUCCEEDED":
        rounds += 1
        current = store.get_task(task.id)
        assert rounds < 150 and current.state == "RUNNING" or rounds == 1, (current.state, current.reason, points)
        # timed kills only early on, so one can never let the whole rest of the task through
        timed = current.step < 5 and rng.random() < 0.25
        crash_at = 0 if timed else rng.randint(1, 14)  # a resumed run passes ~3 points before its first step, a step ~8
        pid = fork_worker(config, prefix, calls_log, crash_at)
        if timed:
            time.sleep(rng.uniform(0.01, 0.2))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            kills += 1
            points.append("timed" if timed else crash_at)
            store.update_task(task.id, {"lease_until": 0.0})  # the dead worker's lease expires
    assert kills >= 20, points

    assert tree_of(ws) == tree_of(ref_ws)
    assert normalized_log(store, task.id, ws) == normalized_log(ref_store, ref_task.id, ref_ws)
    assert (ws / "log.txt").read_text() == "1\n2\n3\n4\n5\n"  # no side effect applied twice
    # No recorded model call was paid for again: a turn is re-asked only when the kill came
    # before its response was committed to the log.
    calls = calls_per_turn(calls_log)
    assert all(1 <= c for c in calls) and sum(calls) - len(TURNS) <= kills
    recorded = {e.step - 1: e.ts for e in store.all_events(task.id) if e.kind == "model_response"}
    assert len(recorded) == len(TURNS)  # one recorded response per turn
    assert all(t < recorded[i] for i, t in model_calls(calls_log))  # none asked after it was recorded
    runs = [e for e in store.all_events(task.id) if e.kind == "run_started"]
    assert 0 < len(runs) <= rounds  # (a run killed before its start record leaves none)
    print(f"\nkill test ({kind}): {kills} SIGKILLs over {rounds} worker runs; model calls {sum(calls)} for "
          f"{len(TURNS)} turns; kill points {points}")
