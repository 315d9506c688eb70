"""The step loop with a replay model, real files and real processes."""

import errno
import threading
import time

from agent_testkit import call, make_worker, turn

from openglm.agent import service
from openglm.agent.hooks import Hooks
from openglm.agent.llm import FallbackModel, ModelError, ReplayModel
from openglm.agent.state import rebuild
from openglm.agent.worker import Worker

FIX_TURNS = [
    turn(call("view", path="calc.py")),
    turn(call("edit", path="calc.py", old="a - b", new="a + b")),
    turn(call("create", path="test_calc.py", content="from calc import add\nassert add(2, 3) == 5\n")),
    turn(call("bash", command="python3 test_calc.py && echo PASSED")),
    turn(call("submit", summary="add fixed, test passes")),
]


def kinds(store, task_id):
    return [e.kind for e in store.all_events(task_id)]


def test_multi_step_task_succeeds_with_deliverables(store, config, workspace):
    (workspace / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    task = service.submit(store, config, "fix add()", str(workspace), {
        "timeout": "10m", "deliverables": ["test_calc.py", {"command": "python3 test_calc.py"}]})
    assert make_worker(config, store, FIX_TURNS).run_one() == "SUCCEEDED"
    t = store.get_task(task.id)
    assert (t.state, t.step, t.model_calls, t.progress) == ("SUCCEEDED", 5, 5, 1.0)
    assert t.prompt_tokens > 0 and t.completion_tokens > 0
    assert "return a + b" in (workspace / "calc.py").read_text()
    events = store.all_events(task.id)
    obs = [e.data for e in events if e.kind == "observation"]
    assert "PASSED" in obs[3]["output"] and obs[3]["meta"]["exit_code"] == 0
    assert [e.data["ok"] for e in events if e.kind == "deliverables"] == [True]
    assert kinds(store, task.id).count("step_committed") == 6  # step 0 (initial snapshot) + 5
    changed = [e.step for e in events if e.kind == "snapshot" and e.data["changed"]]
    assert changed == [0, 2, 3]  # only the steps that changed files made new snapshots


def test_failing_deliverable_keeps_the_agent_working(store, config, workspace):
    turns = [turn(call("submit", summary="too early")), turn(call("create", path="out.txt", content="x")),
             turn(call("submit", summary="now"))]
    task = service.submit(store, config, "make out.txt", str(workspace), {"deliverables": ["out.txt"]})
    assert make_worker(config, store, turns).run_one() == "SUCCEEDED"
    checks = [e.data for e in store.all_events(task.id) if e.kind == "deliverables"]
    assert [c["ok"] for c in checks] == [False, True] and checks[0]["failing"] == ["path out.txt"]


def test_timeout_gives_timed_out_with_final_snapshot(store, config, workspace):
    turns = [turn(call("bash", command="echo partial > work.txt")), turn(call("bash", command="sleep 30"))]
    task = service.submit(store, config, "slow", str(workspace), {"timeout": "1s"})
    t0 = time.monotonic()
    assert make_worker(config, store, turns).run_one() == "TIMED_OUT"
    assert time.monotonic() - t0 < 10
    t = store.get_task(task.id)
    final = [e for e in store.all_events(task.id) if e.kind == "state"][-1]
    assert final.data["state"] == "TIMED_OUT" and final.data["snapshot"] == t.snapshot != ""
    killed = [e.data for e in store.all_events(task.id) if e.kind == "observation"][-1]
    assert killed["meta"]["killed"] == "timeout"
    (workspace / "work.txt").unlink()
    service.rollback(store, config, task.id, t.step)  # the final snapshot restores the work
    assert (workspace / "work.txt").read_text() == "partial\n"


def test_pause_resume_and_cancel(store, config, workspace):
    turns = [turn(call("bash", command="sleep 0.5; echo one >> log.txt")),
             turn(call("bash", command="echo two >> log.txt")), turn(call("submit", summary="ok"))]
    task = service.submit(store, config, "log", str(workspace))
    worker = make_worker(config, store, turns)
    result = {}
    th = threading.Thread(target=lambda: result.update(state=worker.run_one()))
    th.start()
    running = config.task_dir(task.id) / "running.pgid"  # the first command has started
    deadline = time.monotonic() + 30
    while not running.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    service.pause(store, task.id)
    th.join(10)
    assert result["state"] == "PAUSED" and store.get_task(task.id).state == "PAUSED"
    assert (workspace / "log.txt").read_text() == "one\n"  # the running step finished, then it paused
    assert worker.run_one() is None  # paused tasks are not claimed
    service.resume(store, task.id)
    assert worker.run_one() == "SUCCEEDED"
    assert (workspace / "log.txt").read_text() == "one\ntwo\n"

    task2 = service.submit(store, config, "cancel me", str(workspace))
    assert service.cancel(store, task2.id).state == "CANCELLED"


def test_cancel_kills_the_running_command(store, config, workspace):
    config.lease_ttl = 0.6  # heartbeat (which carries the cancel) every 0.2 s
    task = service.submit(store, config, "long", str(workspace))
    worker = make_worker(config, store, [turn(call("bash", command="sleep 60"))])
    threading.Timer(0.5, lambda: service.cancel(store, task.id)).start()
    t0 = time.monotonic()
    assert worker.run_one() == "CANCELLED" and time.monotonic() - t0 < 10
    readings = store.get_task(task.id).resources  # the heartbeat stored resource readings on the way
    assert readings["worker_rss_bytes"] > 0 and "tools_rss_bytes" in readings


def test_ask_user_then_answer(store, config, workspace):
    turns = [turn(call("ask_user", question="Which name?")),
             turn(call("create", path="name.txt", content="from answer")), turn(call("submit", summary="ok"))]
    task = service.submit(store, config, "ask", str(workspace))
    worker = make_worker(config, store, turns)
    assert worker.run_one() == "NEEDS_INPUT"
    assert store.get_task(task.id).reason == "Which name?"
    service.answer(store, task.id, "call it name.txt")
    assert worker.run_one() == "SUCCEEDED"
    state = rebuild([], store.all_events(task.id))
    assert any("call it name.txt" in m["content"] for m in state.messages())


def test_rollback_to_an_earlier_step_restores_files(store, config, workspace):
    (workspace / "keep.txt").write_text("original")
    turns = [turn(call("create", path="a.txt", content="step1")),
             turn(call("bash", command="echo changed > keep.txt; rm a.txt; mkdir -p d; echo n > d/new.txt")),
             turn(call("ask_user", question="ok?"))]
    task = service.submit(store, config, "rb", str(workspace))
    assert make_worker(config, store, turns).run_one() == "NEEDS_INPUT"
    t = service.rollback(store, config, task.id, 1)
    assert (workspace / "a.txt").read_text() == "step1" and (workspace / "keep.txt").read_text() == "original"
    assert not (workspace / "d").exists()
    assert t.snapshot == [e.data["snapshot"] for e in store.all_events(task.id) if e.kind == "step_committed"][1]
    state = rebuild([], store.all_events(task.id))
    assert state.step == 1 and sorted(state.steps) == [0, 1] and "rolled back" in state.messages()[-1]["content"]


def test_hooks_wrap_calls_and_pause_on_budget(store, config, workspace):
    seen = {"models": 0, "tools": [], "steps": []}

    class CountedModel:  # a model wrapper: a Model around the run's model
        def __init__(self, inner, ctx):
            self.inner, self.name = inner, inner.name

        def query(self, messages, tools=None):
            seen["models"] += 1
            return self.inner.query(messages, tools)

    class RecordedTools:  # a tool wrapper: an Environment around the run's tools
        def __init__(self, inner, ctx):
            self.inner = inner

        def call(self, name, args):
            seen["tools"].append(name)
            return self.inner.call(name, args)

    def budget(ctx):
        return "step budget spent" if ctx.state.step >= 2 else None

    hooks = Hooks(model_wrappers=[CountedModel], tool_wrappers=[RecordedTools], budgets=[budget],
                  step_callbacks=[lambda ctx, rec: seen["steps"].append((rec.step, rec.changed))])
    turns = [turn(call("bash", command="echo 1 > f")), turn(call("view", path="f")), turn(call("submit"))]
    task = service.submit(store, config, "hooks", str(workspace))
    assert make_worker(config, store, turns, hooks=hooks).run_one() == "PAUSED"
    assert store.get_task(task.id).reason == "step budget spent"
    assert seen == {"models": 2, "tools": ["bash", "view"], "steps": [(1, True), (2, False)]}


def test_disk_full_pauses_instead_of_corrupting(store, config, workspace):
    class DiskFull:
        def __init__(self, inner, ctx):
            pass

        def call(self, name, args):
            raise OSError(errno.ENOSPC, "No space left on device")

    task = service.submit(store, config, "full", str(workspace))
    worker = make_worker(config, store, [turn(call("bash", command="echo x")), turn(call("submit"))],
                         hooks=Hooks(tool_wrappers=[DiskFull]))
    assert worker.run_one() == "PAUSED"
    t = store.get_task(task.id)
    assert t.reason.startswith("disk full") and t.step == 0
    service.resume(store, task.id)  # space freed: the step is not replayed blindly, the model is told why
    calls = []
    model = ReplayModel([turn(call("bash", command="echo x")), turn(call("submit"))])
    original = model.query
    model.query = lambda m, t: (calls.append(m), original(m, t))[1]
    assert Worker(config, store=store, model=model).run_one() == "SUCCEEDED"
    assert len(calls) == 2  # step 1 asked again (with the reason), then the submit turn
    assert any("disk full" in str(m.get("content")) for m in calls[0] if m["role"] == "user")


def test_fallback_model_and_condensation(store, config, workspace):
    class Down(ReplayModel):
        def query(self, messages, tools=None):
            raise ModelError("primary down")

    turns = [turn(call("bash", command="seq 1 1000")) for _ in range(4)] + [turn(call("submit"))]
    config.context_limit = 2000
    task = service.submit(store, config, "long context", str(workspace))
    worker = Worker(config, store=store, model=FallbackModel(Down([]), ReplayModel(turns, name="backup")))
    worker.policy_factory = lambda: __import__("openglm.agent.policy", fromlist=["x"]).ToolCallingPolicy(
        context_limit=2000, keep_recent_steps=1)
    assert worker.run_one() == "SUCCEEDED"
    events = store.all_events(task.id)
    assert {e.data["response"]["model"] for e in events if e.kind == "model_response"} == {"backup"}
    cond = [e.data for e in events if e.kind == "condensation"]
    assert cond and cond[0]["tokens_after"] < cond[0]["tokens_before"]
    state = rebuild([], events)  # a resumed run sees the same condensed conversation
    assert "condensed" in state.messages()[1]["content"]


def test_git_repository_workspace_is_cloned_and_missing_workspace_rejected(store, config, tmp_path):
    import subprocess

    import pytest

    from openglm.agent.task import ConstraintError

    src = tmp_path / "origin"
    src.mkdir()
    (src / "README").write_text("from git\n")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin"}
    for cmd in (["git", "init", "-q"], ["git", "add", "."], ["git", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=src, check=True, env=env)
    task = service.submit(store, config, "cloned", repo=str(src))
    assert not (tmp_path / "data" / "workspaces" / task.id).exists()  # the worker clones, not the submit call
    assert make_worker(config, store, [turn(call("submit", summary="done"))]).run_one() == "SUCCEEDED"
    assert (tmp_path / "data" / "workspaces" / task.id / "README").read_text() == "from git\n"
    with pytest.raises(ConstraintError) as e:
        service.submit(store, config, "x", str(tmp_path / "missing"))
    assert e.value.field == "workspace"
    with pytest.raises(ConstraintError) as e:
        service.submit(store, config, "x", repo=str(tmp_path / "no-such-dir"))
    assert e.value.field == "repo"
    (tmp_path / "not-a-repo").mkdir()
    bad = service.submit(store, config, "x", repo=str(tmp_path / "not-a-repo"))
    assert make_worker(config, store, []).run_one() == "FAILED"
    reason = store.get_task(bad.id).reason
    assert reason.startswith(f"cannot clone {str(tmp_path / 'not-a-repo')!r}") and "fatal" not in reason


def test_monitor_lifecycle_and_rollback_from_a_step_callback(store, config, workspace):
    started, stopped = [], []

    class Monitor:
        def __init__(self, ctx):
            started.append(ctx.task_id)
            ctx.readings["monitor"] = "on"

        def stop(self):
            stopped.append(True)

    def undo_step_2(ctx, record):
        if record.step == 2 and not any(e.kind == "rollback" for e in ctx.store.all_events(ctx.task_id)):
            ctx.rollback(1)
            assert not (workspace / "bad.txt").exists() and ctx.state.step == 1

    turns = [turn(call("create", path="keep.txt", content="1")), turn(call("create", path="bad.txt", content="2")),
             turn(call("create", path="good.txt", content="3")), turn(call("submit"))]
    task = service.submit(store, config, "undo", str(workspace))
    worker = make_worker(config, store, turns, hooks=Hooks(monitors=[Monitor], step_callbacks=[undo_step_2]))
    assert worker.run_one() == "SUCCEEDED"
    assert started == [task.id] and stopped == [True]
    rb = [e for e in store.all_events(task.id) if e.kind == "rollback"]
    assert len(rb) == 1 and rb[0].data["to_step"] == 1
    # the replay script follows the kept conversation, so turn 2 ("bad.txt") is served again as step 3
    assert [e.step for e in store.all_events(task.id) if e.kind == "step_committed"] == [0, 1, 2, 3, 4, 5]
    assert sorted(p.name for p in workspace.iterdir()) == ["bad.txt", "good.txt", "keep.txt"]
