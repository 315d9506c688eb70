"""End to end, through the runtime: resource faults, stuck loops, budgets and a safe pause."""

import json
import os
import subprocess
import sys
from pathlib import Path

from agent_testkit import ScriptedModel, bash, call, dump, events, fast_config, resilient_worker, turn

from openglm.agent import service
from openglm.agent.llm import ReplayModel
from openglm.agent.resilience import Action, Threshold
from openglm.agent.resilience.budget import raise_budget

LEAK = ("python -c \"import time\nopen('partial.txt', 'w').write('x')\nheld = []\n"
        "for i in range(100):\n    held.append(b'1' * 3 * 2**20); time.sleep(0.1)\"")  # 30 MB/s for 10 s
HOG = ("python -c \"import multiprocessing as mp, time\ndef spin():\n    t = time.time()\n"
       "    while time.time() - t < 4: pass\nif __name__ == '__main__':\n"
       "    ps = [mp.Process(target=spin) for _ in range(4)]\n    [p.start() for p in ps]; [p.join() for p in ps]\"")


def test_leaking_command_is_detected_killed_restarted_from_snapshot_and_the_task_continues(store, config, workspace):
    task = service.submit(store, config, "write result.txt", str(workspace), {"deliverables": ["result.txt"]})
    model = ScriptedModel([turn(bash(LEAK)), turn(bash("echo ok > result.txt")), turn(call("submit"))])
    assert resilient_worker(config, store, model).run_one() == "SUCCEEDED", dump(store, task.id)
    actions = [e.data for e in events(store, task.id, "resource_monitor_action")]
    action = next(a for a in actions if a["metric"] == "rss_growth_short")  # (python's start may also throttle)
    assert action["value"] > 10 * 2**20 and "killed" in action["outcome"]
    restart = events(store, task.id, "restart")[0].data
    assert restart["step"] == 1 and restart["restored_step"] == 0
    assert not (workspace / "partial.txt").exists()  # the leaking step's changes were rolled back
    obs = events(store, task.id, "observation")[0].data
    assert obs["ok"] is False and obs["meta"]["duration_s"] < 8  # killed long before it would have ended
    assert "leak" in model.seen[1][-1]["content"]


def test_cpu_hog_is_throttled(store, config, workspace):
    task = service.submit(store, config, "crunch", str(workspace))
    model = ScriptedModel([turn(bash(HOG)), turn(call("submit"))])
    assert resilient_worker(config, store, model).run_one() == "SUCCEEDED", dump(store, task.id)
    crossed = [e.data for e in events(store, task.id, "resource_threshold_crossed")
               if e.data["metric"] == "cpu_percent"]
    action = next(e.data for e in events(store, task.id, "resource_monitor_action")
                  if e.data["metric"] == "cpu_percent")
    assert crossed and action["action"] == "reduce_parallelism" and action["outcome"].startswith("parallelism 2;")
    assert "reniced/narrowed [" in action["outcome"] and action["outcome"] != "reniced/narrowed []"
    resources = store.get_task(task.id).resources
    assert resources["parallelism"] == 2 and "cpu_percent" in resources and resources["gpu_status"]


def test_model_repeating_the_same_action_is_stuck_enters_the_ladder_and_is_condensed(store, config, workspace):
    (workspace / "a.txt").write_text("hello\n")
    task = service.submit(store, config, "read a.txt", str(workspace), {"deliverables": ["b.txt"]})
    model = ScriptedModel([turn(bash("cat a.txt"))] * 3 + [
        turn(bash("cp a.txt b.txt"), content="Plan:\n- copy a.txt to b.txt\n- submit"), turn(call("submit"))])
    assert resilient_worker(config, store, model).run_one() == "SUCCEEDED", dump(store, task.id)
    stuck = events(store, task.id, "stuck")[0].data
    assert stuck["kind"] == "repeated_pair" and stuck["steps"] == [1, 2, 3]
    escalation = events(store, task.id, "recovery_escalation")[0].data
    assert (escalation["level"], escalation["error_class"]) == (4, "stuck")
    assert events(store, task.id, "loop_condensed")[0].data["steps"] == [2, 3]
    outputs = [m["content"] for m in model.seen[3] if m.get("role") == "tool"]
    assert outputs[0].strip().endswith("hello") and all("[condensed" in o for o in outputs[1:3])
    assert events(store, task.id, "replan")


def test_token_budget_pauses_cleanly_and_raising_it_resumes(store, config, workspace):
    task = service.submit(store, config, "two files", str(workspace),
                          {"max_tokens": 70, "deliverables": ["one.txt", "two.txt"]})
    turns = [turn(bash("echo 1 > one.txt")), turn(bash("echo 2 > two.txt")), turn(call("submit"))]
    assert resilient_worker(config, store, ScriptedModel(turns)).run_one() == "PAUSED", dump(store, task.id)
    t = store.get_task(task.id)
    assert t.reason.startswith("budget exhausted: tokens budget exhausted: used 80 of 70")
    final = events(store, task.id, "state")[-1].data
    assert final["state"] == "PAUSED" and final["snapshot"] == t.snapshot and t.step == 2
    assert (workspace / "two.txt").exists()  # the step that crossed the cap finished and was committed
    raise_budget(store, task.id, max_tokens=1000)
    service.resume(store, task.id)
    assert resilient_worker(config, store, ScriptedModel(turns[2:])).run_one() == "SUCCEEDED", dump(store, task.id)
    try:
        raise_budget(store, task.id, max_tokens=2000)
    except ValueError as exc:
        assert "SUCCEEDED" in str(exc)
    else:
        raise AssertionError("raised the budget of a finished task")


def test_wall_clock_ends_the_task_timed_out_and_a_raise_while_running_extends_it(store, config, workspace):
    task = service.submit(store, config, "slow", str(workspace), {"timeout": "1.5s"})
    turns = [turn(bash("sleep 0.6; echo a > a.txt")), turn(bash("sleep 0.6")), turn(bash("sleep 0.6")),
             turn(call("submit"))]
    assert resilient_worker(config, store, ScriptedModel(turns)).run_one() == "TIMED_OUT", dump(store, task.id)
    final = events(store, task.id, "state")[-1].data
    assert final["snapshot"] == store.get_task(task.id).snapshot and (workspace / "a.txt").exists()
    extended = service.submit(store, config, "slow", str(workspace), {"timeout": "1.5s"})

    def raise_then_continue(messages):
        # From "another client", while the task runs: at its first model call, so the raise does not race the
        # 1.5 s clock on a loaded machine (each command also pays the confinement launcher's start-up).
        raise_budget(store, extended.id, timeout="1m")
        return turns[0]

    assert resilient_worker(config, store, ScriptedModel([raise_then_continue, *turns[1:]])).run_one() == "SUCCEEDED"
    assert events(store, extended.id, "budget_raised")[0].data["caps"] == {"timeout": "1m"}


WORKER_SCRIPT = r"""
import json, os, sys
from openglm.agent.config import AgentConfig
from openglm.agent.llm import ReplayModel
from openglm.agent.resilience.hooks import ResilienceHooks
from openglm.agent.store.sqlite_store import SQLiteStore
from openglm.agent.worker import Worker
sys.path.insert(0, sys.argv[3])
from agent_testkit import fast_config
config = AgentConfig(data_dir=sys.argv[1], lease_ttl=3.0, poll_interval=0.05)
worker = Worker(config, store=SQLiteStore(sys.argv[2]), model=ReplayModel(sys.argv[4]),
                hooks=ResilienceHooks(fast_config()))
print(json.dumps({"state": worker.run_one(), "pid": os.getpid()}))
"""


def test_monitor_pause_is_safe_and_the_task_resumes_in_another_process(store, config, workspace, tmp_path):
    script = tmp_path / "turns.jsonl"
    busy = "python -c \"import time; t = time.time()\nwhile time.time() - t < 1.0: pass\"; echo 1 > one.txt"
    turns = [turn(bash(busy)), turn(bash("echo 2 > two.txt")), turn(call("submit"))]
    script.write_text("\n".join(json.dumps(t) for t in turns) + "\n")
    task = service.submit(store, config, "two files", str(workspace), {"deliverables": ["one.txt", "two.txt"]})
    pausing = fast_config()
    # any CPU use by the task's command pauses it: the request arrives while step 1's command runs
    pausing.monitor.thresholds["cpu_percent"] = Threshold(0.0, Action.PAUSE)
    assert resilient_worker(config, store, ReplayModel(str(script)), pausing).run_one() == "PAUSED"
    t = store.get_task(task.id)
    assert t.reason.startswith("paused by the resource monitor: cpu_percent") and t.step == 1
    assert (workspace / "one.txt").exists() and not (workspace / "two.txt").exists()  # step 1 was finished
    assert events(store, task.id, "state")[-1].data["snapshot"] == t.snapshot
    service.resume(store, task.id)
    out = subprocess.run([sys.executable, "-c", WORKER_SCRIPT, config.data_dir, str(tmp_path / "agent.db"),
                          str(Path(__file__).parents[1]), str(script)],
                         capture_output=True, text=True, timeout=60)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["state"] == "SUCCEEDED" and result["pid"] != os.getpid(), out.stderr[-2000:]
    committed = [e.step for e in events(store, task.id, "step_committed")]
    assert committed == sorted(set(committed))  # no step lost or run twice across the pause
    assert (workspace / "one.txt").read_text() == "1\n" and (workspace / "two.txt").read_text() == "2\n"
