"""End to end, through the runtime: each level of the recovery ladder with real injected faults."""

from agent_testkit import ScriptedModel, bash, call, dump, events, fast_config, resilient_worker, turn
from helpers import FaultServer

from openglm.agent import service
from openglm.agent.llm import FallbackModel
from openglm.agent.llm.openai_chat import OpenAIChatModel

SUBMIT = {"role": "assistant", "content": "",
          "tool_calls": [{"id": "s1", "type": "function", "function": {"name": "submit", "arguments": "{}"}}]}


def _levels(store, task_id, kind="recovery_escalation"):
    return [(e.data["level"], e.data["error_class"]) for e in events(store, task_id, kind)]


def test_L1_endpoint_500_429_timeout_then_recovers(store, config, workspace):
    task = service.submit(store, config, "finish", str(workspace))
    with FaultServer(faults=["500", "429", "hang"], reply=SUBMIT, hang_s=1.5) as server:
        model = OpenAIChatModel(server.url, "primary", timeout=0.5)
        assert resilient_worker(config, store, model).run_one() == "SUCCEEDED", dump(store, task.id)
        assert server.requests == 4
    assert _levels(store, task.id) == [(1, "transient")] * 3
    delays = [e.data["delay_s"] for e in events(store, task.id, "recovery_escalation")]
    assert delays == sorted(delays) and delays[1] == 2 * delays[0]  # exponential backoff
    assert events(store, task.id, "recovery_outcome")[-1].data["outcome"] == "recovered"
    assert len(events(store, task.id, "model_response")) == 1  # the retries are one recorded call


def test_L2_primary_stays_down_fallback_answers_and_both_down_pauses_safely(store, config, workspace):
    task = service.submit(store, config, "finish", str(workspace))
    with FaultServer(default="500") as primary, FaultServer(reply=SUBMIT) as fallback:
        model = FallbackModel(OpenAIChatModel(primary.url, "primary", timeout=0.5),
                              OpenAIChatModel(fallback.url, "fallback", timeout=0.5))
        assert resilient_worker(config, store, model).run_one() == "SUCCEEDED", dump(store, task.id)
        assert primary.requests == 4 and fallback.requests == 1
    assert _levels(store, task.id) == [(1, "transient")] * 3 + [(2, "transient")]
    assert events(store, task.id, "model_switch")[0].data["to"] == 1
    down = service.submit(store, config, "finish", str(workspace))
    with FaultServer(default="500") as primary, FaultServer(default="429") as fallback:
        model = FallbackModel(OpenAIChatModel(primary.url, "primary", timeout=0.5),
                              OpenAIChatModel(fallback.url, "fallback", timeout=0.5))
        assert resilient_worker(config, store, model).run_one() == "PAUSED"
    t = store.get_task(down.id)
    assert t.reason.startswith("model unavailable") and t.snapshot  # safe pause, state and snapshot saved


def test_L3_step_that_breaks_the_tests_rolls_back_to_the_last_green_snapshot(store, config, workspace):
    (workspace / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    verify = "python -c 'import calc; assert calc.add(2, 2) == 4'"
    task = service.submit(store, config, "add a notes file", str(workspace),
                          {"deliverables": ["notes.txt", {"command": verify}]})
    model = ScriptedModel([
        turn(call("edit", path="calc.py", old="a + b", new="a - b")),  # breaks the tests
        turn(call("create", path="notes.txt", content="done\n")),
        turn(call("submit")),
    ])
    assert resilient_worker(config, store, model, fast_config(verify_command=verify)).run_one() == "SUCCEEDED", \
        dump(store, task.id)
    assert _levels(store, task.id) == [(3, "verification_failed")]
    rollback = events(store, task.id, "rollback")[0].data
    assert rollback["to_step"] == 0
    assert (workspace / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    verdicts = [(e.data["step"], e.data["ok"]) for e in events(store, task.id, "verification")]
    assert verdicts[:2] == [(0, True), (1, False)] and verdicts[-1][1] is True
    assert "rolled back to step 0" in model.seen[1][-1]["content"]


def fail(word):  # one approach failing on different inputs: not identical errors, so not "stuck"
    return bash(f"python -c \"import sys; sys.exit('approach A: parser rejects input {word}')\"")


FAILS = [turn(fail(w)) for w in ("alpha", "beta", "gamma", "delta", "epsilon")]


def test_L4_repeated_failure_of_one_approach_replans(store, config, workspace):
    task = service.submit(store, config, "make out.txt", str(workspace), {"deliverables": ["out.txt"]})
    model = ScriptedModel(FAILS[:4] + [
        turn(bash("echo B > out.txt"), content="New plan:\n- use approach B\n- write out.txt\n- submit"),
        turn(call("submit")),
    ])
    assert resilient_worker(config, store, model).run_one() == "SUCCEEDED", dump(store, task.id)
    assert _levels(store, task.id) == [(2, "command_failed"), (2, "command_failed"), (4, "command_failed")]
    replan = events(store, task.id, "replan")[0].data
    assert replan["subgoals"] == ["use approach B", "write out.txt", "submit"] and replan["revision"] == 1
    assert "approach A" in replan["failure"] and "[failed]" in replan["plan"]
    asked = model.seen[4][-1]["content"]  # the model was asked for a plan, with the failure as context
    assert "re-plan" in asked and "approach A" in asked
    assert events(store, task.id, "recovery_outcome")[-1].data["outcome"] == "recovered"


def test_L5_exhaustion_needs_input_then_the_answer_resumes_and_succeeds(store, config, workspace):
    task = service.submit(store, config, "make out.txt", str(workspace), {"deliverables": ["out.txt"]})
    model = ScriptedModel(FAILS)
    assert resilient_worker(config, store, model).run_one() == "NEEDS_INPUT", dump(store, task.id)
    t = store.get_task(task.id)
    assert "approach A" in t.reason and "How should it proceed" in t.reason
    assert [lvl for lvl, _ in _levels(store, task.id)] == [2, 2, 4, 5]
    service.answer(store, task.id, "use approach B: echo B > out.txt")
    resumed = ScriptedModel([turn(bash("echo B > out.txt")), turn(call("submit"))])
    assert resilient_worker(config, store, resumed).run_one() == "SUCCEEDED", dump(store, task.id)
    assert any("use approach B" in str(m.get("content")) for m in resumed.seen[0])
    outcomes = [e.data["outcome"] for e in events(store, task.id, "recovery_outcome")]
    assert "answered" in outcomes


def test_a_finished_run_leaves_no_guard_behind_in_a_long_lived_worker(store, config, workspace):
    import gc

    from openglm.agent.resilience.guard import Guard

    w = resilient_worker(config, store, ScriptedModel([turn(call("submit")), turn(call("submit"))]))
    ids = []
    for _ in range(2):  # one worker, one set of hooks, many tasks: as in the agent server
        ids.append(service.submit(store, config, "finish", str(workspace)).id)
        assert w.run_one() == "SUCCEEDED", dump(store, ids[-1])
    gc.collect()  # type() rather than isinstance(): isinstance probes every object, waking deprecated proxies
    assert [g for g in gc.get_objects() if type(g) is Guard and g.ctx.task_id in ids] == []
