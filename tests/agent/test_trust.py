"""Secrets: a per-task model key is never stored or echoed, and no API client can
point a task at an arbitrary base_url or make the server read an arbitrary replay file."""

import pytest
from fastapi.testclient import TestClient

from openglm.agent import service
from openglm.agent.api import create_app
from openglm.agent.config import AgentConfig
from openglm.agent.store.sqlite_store import SQLiteStore
from openglm.agent.trust import resolve_model_spec

ALLOWED = "http://127.0.0.1:8000/v1"


@pytest.fixture
def api(tmp_path):
    (tmp_path / "replays").mkdir()
    config = AgentConfig(data_dir=str(tmp_path / "data"), model={"base_url": ALLOWED, "model": "m"},
                         replay_dirs=[str(tmp_path / "replays")])
    store = SQLiteStore(str(tmp_path / "agent.db"))
    return TestClient(create_app(config, store=store), base_url="http://localhost"), store, tmp_path


@pytest.mark.parametrize("model,field", [
    ({"base_url": ALLOWED, "model": "m", "api_key": "sk-live-123"}, "model.api_key"),
    ({"base_url": "http://attacker.example/v1", "model": "m"}, "model.base_url"),
    ({"base_url": ALLOWED, "model": "m", "fallback": {"base_url": "http://evil:1/v1", "model": "m"}},
     "model.fallback.base_url"),
    ({"replay": "/etc/passwd"}, "model.replay"),
    ({"replay": "REPLAYS/../../agent.db"}, "model.replay"),
    ({"base_url": ALLOWED, "model": "m", "api_key_env": "AWS_SECRET_ACCESS_KEY"}, "model.api_key_env"),
])
def test_untrusted_model_specs_are_refused_naming_the_field(api, model, field):
    client, store, tmp = api
    if "replay" in model:
        model = {"replay": model["replay"].replace("REPLAYS", str(tmp / "replays"))}
    resp = client.post("/v1/tasks", json={"objective": "x", "model": model})
    assert resp.status_code == 422 and resp.json()["field"] == field
    assert "sk-live-123" not in resp.text
    assert store.list_tasks() == []


def test_allowed_specs_are_stored_without_any_key(api, monkeypatch):
    client, store, tmp = api
    (tmp / "replays" / "s.jsonl").write_text("")
    spec = {"base_url": ALLOWED + "/", "model": "m", "api_key_env": "OPENGLM_MODEL_API_KEY"}
    task_id = client.post("/v1/tasks", json={"objective": "x", "model": spec}).json()["task_id"]
    assert client.post("/v1/tasks", json={"objective": "x", "model": {"replay": str(tmp / "replays" / "s.jsonl")}}
                       ).status_code == 201
    monkeypatch.setenv("OPENGLM_MODEL_API_KEY", "sk-from-env")
    shown = client.get(f"/v1/tasks/{task_id}").text
    assert "sk-from-env" not in shown and "OPENGLM_MODEL_API_KEY" in shown
    assert "sk-from-env" not in store.get_task(task_id).to_dict().__repr__()
    assert resolve_model_spec(store.get_task(task_id).meta["model"])["api_key"] == "sk-from-env"  # in memory only


def test_a_legacy_record_with_a_key_is_redacted_on_output(api, tmp_path):
    client, store, _ = api
    task = service.submit(store, AgentConfig(data_dir=str(tmp_path / "d")), "old")
    store.update_task(task.id, {"meta": {"model": {"base_url": ALLOWED, "model": "m", "api_key": "sk-old"}}})
    for path in (f"/v1/tasks/{task.id}", "/v1/tasks"):
        assert "sk-old" not in client.get(path).text


def test_no_record_ever_holds_a_key_even_in_process(tmp_path):
    from openglm.agent.task import ConstraintError

    store = SQLiteStore(str(tmp_path / "agent.db"))
    with pytest.raises(ConstraintError, match="api_key_env"):
        service.submit(store, AgentConfig(data_dir=str(tmp_path / "d")), "x",
                       model={"replay": "s.jsonl", "fallback": {"base_url": ALLOWED, "model": "m", "api_key": "k"}})
    assert store.list_tasks() == []
