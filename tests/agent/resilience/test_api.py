"""The budget endpoint and /metrics on a real `openglm agent-server` (uvicorn on a free port)."""

import json

import httpx
from agent_testkit import AgentServer, write_script
from helpers import free_port


def test_budget_can_be_raised_through_the_api_and_metrics_are_served(tmp_path):
    script = write_script(tmp_path / "turns.jsonl", [{"content": "", "tool_calls": [{"name": "submit"}]}])
    config = tmp_path / "agent.json"  # the resilience layer adds its routes and metrics through its hooks
    config.write_text(json.dumps({"hooks": ["openglm.agent.resilience.hooks:factory"]}))
    server = AgentServer(tmp_path, free_port(), script, workers=0,  # API only: the task stays queued
                         extra_args=("--config", str(config))).wait_ready()
    try:
        ws = tmp_path / "ws"
        ws.mkdir()
        task = httpx.post(server.url + "/v1/tasks", json={"objective": "x", "workspace": str(ws),
                                                          "constraints": {"max_tokens": 100}}).json()
        url = f"{server.url}/v1/tasks/{task['id']}/budget"
        r = httpx.post(url, json={"max_tokens": 5000, "timeout": "2h"})
        assert r.status_code == 200 and r.json()["constraints"]["max_tokens"] == 5000
        assert httpx.get(f"{server.url}/v1/tasks/{task['id']}").json()["constraints"]["timeout"] == "2h"
        lowered = httpx.post(url, json={"max_tokens": 10})
        assert lowered.status_code == 422 and "max_tokens" in lowered.text
        unknown = httpx.post(url, json={"max_parsecs": 3})
        assert unknown.status_code == 422 and "max_parsecs" in unknown.text
        metrics = httpx.get(server.url + "/metrics")
        assert metrics.status_code == 200 and "openglm_task_rss_bytes" in metrics.text
    finally:
        server.stop()
