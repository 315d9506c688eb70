"""Without a fallback model the ladder's messages say so: no claim of a fallback that does not exist."""

from types import SimpleNamespace

from agent_testkit import ScriptedModel, fast_config, resilient_worker

from openglm.agent import service
from openglm.agent.llm import ModelError
from openglm.agent.resilience.hooks import _TaskMonitor


def test_L5_pause_without_a_fallback_does_not_claim_one(store, config, workspace):
    task = service.submit(store, config, "finish", str(workspace))
    model = ScriptedModel([ModelError("connection refused")] * 20)
    assert resilient_worker(config, store, model, fast_config()).run_one() == "PAUSED"
    reason = store.get_task(task.id).reason
    assert "no fallback model configured" in reason and "and the fallback" not in reason


def test_switch_fallback_without_a_fallback_keeps_the_primary():
    guard = SimpleNamespace(prefer_fallback=False)
    monitor = SimpleNamespace(ctx=SimpleNamespace(model=ScriptedModel([])), guard=guard)
    answer = _TaskMonitor.fallback(monitor, alert=None)
    assert answer.startswith("no fallback model configured") and guard.prefer_fallback is False
