"""Two worker processes on one real Redis: no task is ever run twice at once, and the task of a
worker that is SIGKILLed mid-run is resumed and finished by the other once the lease expires."""

import os
import signal
import subprocess
import sys
import time

import redis
from agent_testkit import call, turn, write_script

from openglm.agent import service
from openglm.agent.config import AgentConfig
from openglm.agent.store.redis_store import RedisStore

SCRIPT = [turn(call("bash", command="sleep 0.4; echo a >> out.txt")),
          turn(call("bash", command="sleep 0.4; echo b >> out.txt")),
          turn(call("submit", summary="ok"))]


def test_two_workers_share_tasks_and_take_over_a_dead_ones(tmp_path, redis_url):
    url = redis_url.rsplit("/", 1)[0] + "/3"
    redis.Redis.from_url(url).flushdb()
    store = RedisStore(url)
    config = AgentConfig(data_dir=str(tmp_path / "data"), store=url, lease_ttl=1.5)
    script = write_script(tmp_path / "s.jsonl", SCRIPT)
    tasks = []
    for i in range(4):
        ws = tmp_path / f"ws{i}"
        ws.mkdir()
        t = service.submit(store, config, f"task {i}", str(ws),
                           model={"replay": script, "calls_log": str(tmp_path / f"calls{i}")})
        tasks.append(t.id)

    cmd = [sys.executable, "-m", "openglm.agent", "worker", "--store", url, "--data-dir", config.data_dir,
           "--lease-ttl", "1.5"]
    a = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    b = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        victim = None
        deadline = time.monotonic() + 30
        while victim is None and time.monotonic() < deadline:  # wait until A is inside a step of some task
            victim = next((t for t in map(store.get_task, tasks) if f"-{a.pid}-" in t.worker and t.step >= 1), None)
            time.sleep(0.02)
        assert victim is not None, "worker A never ran a task"
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(store.get_task(t).state != "SUCCEEDED" for t in tasks):
            time.sleep(0.1)
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()

    for i, task_id in enumerate(tasks):
        task = store.get_task(task_id)
        assert task.state == "SUCCEEDED", (task_id, task.state, task.reason)
        assert (tmp_path / f"ws{i}" / "out.txt").read_text() == "a\nb\n"  # no step applied twice
        runs = [e.data["worker"] for e in store.all_events(task_id) if e.kind == "run_started"]
        calls = open(tmp_path / f"calls{i}").read().split("\n")
        if task_id == victim.id:
            assert len(runs) == 2 and f"-{a.pid}-" in runs[0] and f"-{b.pid}-" in runs[1]
            assert [e.data["resumed"] for e in store.all_events(task_id) if e.kind == "run_started"] == [False, True]
        else:
            assert len(runs) == 1  # never run by two workers
            assert len([c for c in calls if c]) == len(SCRIPT)  # each model turn asked once
    assert {e.data["worker"].split("-")[-2] for t in tasks for e in store.all_events(t) if e.kind == "run_started"} \
        == {str(a.pid), str(b.pid)}
