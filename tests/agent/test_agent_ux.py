"""What a newcomer sees of the agent-server and its CLI: the start-up banner and access log, paged events,
`task snapshots`, rollback of a folder used in place (listed, confirmed), a tool call cut off by max_tokens
told as such, and the dashboard rows of finished and paused tasks."""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from agent_testkit import call, make_worker, turn
from fastapi import FastAPI, Request
from testutil import serve_in_thread

from openglm.agent import service
from openglm.agent.api import create_app
from openglm.agent.banner import banner
from openglm.agent.cli import main as agent_main
from openglm.agent.config import AgentConfig
from openglm.agent.dashboard import trajectory
from openglm.agent.dashboard.digest import Digest, summary
from openglm.agent.llm import ModelSpec
from openglm.agent.llm.openai_chat import OpenAIChatModel
from openglm.agent.store.base import Event
from openglm.agent.store.sqlite_store import SQLiteStore
from openglm.agent.task import Task
from openglm.agent.worker import Worker

ROOT = Path(__file__).resolve().parents[2]
FILES = [turn(call("create", path="a.txt", content="one\n")), turn(call("create", path="b.txt", content="two\n")),
         turn(call("submit", summary="done"))]


# ---- the start-up banner and the access log --------------------------------------------------------
class Lines:
    """The lines a process writes to a pipe, read by a thread (a read never blocks the test past its timeout)."""

    def __init__(self, stream):
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in stream], daemon=True).start()

    def until(self, pattern: str, timeout: float = 90) -> str:
        seen, deadline = "", time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            seen += line
            if re.search(pattern, line):
                return seen
        raise AssertionError(f"no line matching {pattern!r} in {timeout:g} s:\n{seen}")


def test_agent_server_says_where_it_listens_and_logs_each_request(tmp_path):
    """Before, it printed nothing: no URL, no dashboard link, no store or worker line, no access log."""
    cmd = [sys.executable, "-m", "openglm.agent", "agent-server", "--port", "0", "--data-dir", str(tmp_path / "d"),
           "--replay", str(ROOT / "examples" / "turns.jsonl")]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        err, out = Lines(server.stderr), Lines(server.stdout)
        head = err.until(r"^  log level")  # the banner on stderr; the access log on stdout (uvicorn's way)
        url = re.search(r"^openglm agent-server: (http://127\.0\.0\.1:\d+);", head, re.M).group(1)
        assert f"  dashboard  {url}/ui/\n" in head
        assert f"  store      {tmp_path / 'd' / 'agent.db'} (SQLite)" in head
        assert "  workers    1 embedded" in head and "examples/turns.jsonl" in head
        assert "  auth       none: loopback only" in head and "one line per request" in head
        assert "  sandbox    bwrap\n" in head
        assert httpx.get(f"{url}/v1/tasks", timeout=10).json() == {"tasks": []}
        assert '"GET /v1/tasks HTTP/1.1" 200' in out.until(r"GET /v1/tasks", timeout=30)
        # a second server on the same port: one line saying so (before, uvicorn's bind error after the workers)
        port = url.rsplit(":", 1)[1]
        again = subprocess.run(cmd[:4] + ["--port", port] + cmd[6:], capture_output=True, text=True, timeout=90,
                               cwd=tmp_path)
        assert again.returncode != 0 and again.stderr.strip().splitlines() == [
            f"error: cannot listen on 127.0.0.1:{port}: in use (another agent-server?): choose another --port"]
    finally:
        server.terminate()
        server.wait(10)


def test_banner_names_auth_and_workers_and_never_a_secret():
    config = AgentConfig(data_dir="/srv/agent", store="redis://:hunter2@db:6379/0",
                         model=ModelSpec(base_url="http://gpu:8000/v1", model="glm-5.1", api_key="sk-secret"))
    text = banner(config, "0.0.0.0", 8100, 0, "tok-123", "view-456", "warning")
    assert "hunter2" not in text and "sk-secret" not in text and "tok-123" not in text and "view-456" not in text
    assert "redis://db:6379/0 (Redis)" in text and "glm-5.1 at http://gpu:8000/v1" in text
    assert "listening on all interfaces, 0.0.0.0:8100" in text and "/ui/#token=<your token>" in text
    assert "none embedded (API only: start `openglm worker --store redis://db:6379/0`)" in text
    assert "bearer token" in text and "read-only view token" in text and "requests are not logged" in text
    assert "none configured" in banner(AgentConfig(), "127.0.0.1", 8100, 1, None, None, "info")


# ---- the CLI against a live task API ------------------------------------------------------------------
@pytest.fixture
def live(tmp_path):
    """(config, store, url): the task API served in this process, workers run by the test."""
    config = AgentConfig(data_dir=str(tmp_path / "data"), lease_ttl=3.0, poll_interval=0.05)
    store = SQLiteStore(config.store_url)
    url, stop = serve_in_thread(create_app(config, store=store))
    yield config, store, url
    stop()
    store.close()


def cli(url, *args, capsys):
    code = agent_main(["task", *args, "--server", url])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_events_page_says_when_more_follow_and_all_gets_every_one(live, workspace, capsys):
    """Before, `task events` stopped at 100 events without a word."""
    config, store, url = live
    task = service.submit(store, config, "chatty", str(workspace))
    store.append(task.id, [("note", 0, {"i": i}) for i in range(1249)])  # 1,250 events with task_created
    code, out, err = cli(url, "events", task.id, capsys=capsys)
    assert code == 0 and [json.loads(x)["seq"] for x in out.splitlines()] == list(range(1, 101))
    assert err == (f"-- more events after seq 100: openglm task events {task.id} --after 100 (or --all for every "
                   "event)\n")
    code, out, err = cli(url, "events", task.id, "--all", capsys=capsys)
    assert [json.loads(x)["seq"] for x in out.splitlines()] == list(range(1, 1251)) and err == ""  # pages of 1,000
    code, out, err = cli(url, "events", task.id, "--after", "1200", "--limit", "50", capsys=capsys)
    assert len(out.splitlines()) == 50 and err == ""  # exactly the rest: no hint


def test_task_snapshots_lists_steps_marks_the_workspace_and_what_a_rollback_discarded(live, workspace, capsys):
    config, store, url = live
    task = service.submit(store, config, "files", str(workspace))
    assert make_worker(config, store, FILES).run_one() == "SUCCEEDED"
    service.rollback(store, config, task.id, 1)
    code, out, err = cli(url, "snapshots", task.id, capsys=capsys)
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["step", "snapshot", "files", "time", "(local)"]
    rows = {int(line.split()[0]): line for line in lines[1:]}
    assert sorted(rows) == [0, 1, 2, 3]
    assert rows[1].endswith("<- the workspace (last committed)") and "changed" in rows[1]
    assert rows[2].endswith("(discarded by a rollback)") and rows[3].endswith("(discarded by a rollback)")
    assert err == f"roll back with: openglm task rollback {task.id} STEP\n"
    code, out, _ = cli(url, "snapshots", task.id, "--json", capsys=capsys)
    assert [(s["step"], s["kept"]) for s in json.loads(out)] == [(0, True), (1, True), (2, False), (3, False)]


def test_rollback_of_a_folder_used_in_place_lists_what_it_deletes_and_asks(live, workspace, capsys, monkeypatch):
    """Before, it deleted the user's own new file without a word."""
    config, store, url = live
    task = service.submit(store, config, "files", str(workspace))
    assert make_worker(config, store, FILES).run_one() == "SUCCEEDED"
    (workspace / "my-notes.txt").write_text("mine\n")  # the user's own file, made after the task
    (workspace / "a.txt").write_text("edited by hand\n")
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    code, out, err = cli(url, "rollback", task.id, "1", capsys=capsys)
    assert code == 2 and out == "" and (workspace / "my-notes.txt").exists()
    assert f"changes {workspace} (your folder, used in place):" in err
    assert "  delete    my-notes.txt  (not in that snapshot)" in err and "  delete    b.txt" in err
    assert "  overwrite a.txt" in err and "confirm with --yes" in err
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert cli(url, "rollback", task.id, "1", capsys=capsys)[0] == 1 and (workspace / "my-notes.txt").exists()
    code, out, err = cli(url, "rollback", task.id, "1", "--yes", capsys=capsys)
    assert code == 0 and json.loads(out)["snapshot"] and not (workspace / "my-notes.txt").exists()
    assert (workspace / "a.txt").read_text() == "one\n"
    rollback = [e for e in store.all_events(task.id) if e.kind == "rollback"]
    assert [e.data["by"] for e in rollback] == ["user"]


def test_rollback_of_the_tasks_own_workspace_lists_but_does_not_ask(live, capsys, monkeypatch):
    config, store, url = live
    task = service.submit(store, config, "files")  # a fresh folder under the data dir
    assert make_worker(config, store, FILES).run_one() == "SUCCEEDED"
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    code, out, err = cli(url, "rollback", task.id, "1", capsys=capsys)
    assert code == 0 and "(the task's own workspace)" in err and "  delete    b.txt" in err
    assert not (Path(task.workspace) / "b.txt").exists()


# ---- a reply cut off by max_tokens ----------------------------------------------------------------
@pytest.fixture
def endpoint():
    """A fake OpenAI endpoint with a 900-token window answering `replies` in order."""
    app, seen, replies = FastAPI(), [], []

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 900}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        seen.append(await request.json())
        finish, message = replies.pop(0)
        return {"model": "m", "choices": [{"index": 0, "finish_reason": finish, "message": message}],
                "usage": {"prompt_tokens": 100, "completion_tokens": 10}}

    url, stop = serve_in_thread(app)
    yield f"{url}/v1", seen, replies
    stop()


def _call(name, arguments: str, cid="c1"):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}]}


def test_a_tool_call_cut_off_by_max_tokens_is_told_as_such(endpoint, store, config, workspace):
    """Before, the model was told "No tool call found" and the log did not say the reply was cut."""
    url, seen, replies = endpoint
    replies += [("length", _call("create", '{"path": "big.py", "content": "def f():\\n    return [1, 2,')),
                ("tool_calls", _call("submit", '{"summary": "done"}', "c2"))]
    task = service.submit(store, config, "write a big file", str(workspace))
    model = OpenAIChatModel(url, "m", max_tokens=100, context_window=8192)
    assert Worker(config, store=store, model=model).run_one() == "SUCCEEDED"
    events = store.all_events(task.id)
    response = next(e for e in events if e.kind == "model_response").data["response"]
    assert response["finish_reason"] == "length" and response["tool_calls"] == []
    assert response["truncation"] == "the reply cap (max_tokens=100 in the model spec)"
    told = next(e for e in events if e.kind == "observation").data["output"]
    assert told.startswith("Your reply was cut off by the reply cap (max_tokens=100 in the model spec) before its "
                           "tool call was complete") and "No tool call" not in told
    assert not (workspace / "big.py").exists()  # half a call's arguments are never run
    assert told in seen[1]["messages"][-1]["content"]  # the model reads it next turn


def test_a_reply_cut_by_the_windows_share_gets_more_room_next_time(endpoint):
    """The context manager is shown the cause: when the window's share (not max_tokens) capped the reply,
    later requests leave the reply up to half the window."""
    url, seen, replies = endpoint
    replies += [("length", {"role": "assistant", "content": "let me think about this at len"}),
                ("stop", {"role": "assistant", "content": "ok"})]
    model = OpenAIChatModel(url, "m", max_tokens=1000)
    msgs = [{"role": "user", "content": "go"}]
    first = model.query(msgs)
    assert first.truncated and seen[0]["max_tokens"] == 225  # a quarter of the 900-token window
    assert first.truncation.startswith("the 225 tokens the 900-token context window left for the reply")
    assert not model.query(msgs).truncated and seen[1]["max_tokens"] == 450


def test_a_replay_turn_may_be_cut_off_too(store, config, workspace):
    turns = [{"content": "", "finish_reason": "length"}, turn(call("submit", summary="ok"))]
    task = service.submit(store, config, "x", str(workspace))
    assert make_worker(config, store, turns).run_one() == "SUCCEEDED"
    told = next(e for e in store.all_events(task.id) if e.kind == "observation").data
    assert told["ok"] is False and told["output"].startswith("Your reply was cut off by max_tokens")
    turns = trajectory.build(store.get_task(task.id), store.all_events(task.id), [])["turns"]
    assert [t["truncation"] for t in turns] == ["max_tokens", ""]  # the viewer marks the cut reply


# ---- the dashboard's rows of finished and paused tasks -----------------------------------------------
def _ev(seq, kind, data, step=1):
    return Event(seq=seq, kind=kind, step=step, data=data, ts=1000.0 + seq)


def test_a_finished_task_has_no_time_left_and_no_budget_bars():
    d = Digest()
    d.fold([_ev(1, "phase", {"phase": "verification", "data": {"phase_steps": 2}, "budget": {"steps": 10}}),
            _ev(2, "state", {"state": "SUCCEEDED", "reason": "done"})])
    task = Task(id="t-1", objective="x", workspace="/w", constraints={"timeout": "1h"}, state="SUCCEEDED",
                active_s=1139.6)
    row = summary(task, d, now=5000.0)
    assert row["time"] == {"elapsed_s": 1139.6, "timeout_s": 3600.0, "remaining_s": None, "used": None,
                           "clock": "finished"}
    assert "used" not in row["phase"]  # no phase budget bar either


def test_a_task_paused_by_a_fault_shows_it_as_an_alert_until_resumed():
    """Before, a task PAUSED for "model unavailable" showed "alerts: none" (and alert_count was missing)."""
    d = Digest()
    d.fold([_ev(1, "state", {"state": "PAUSED", "reason": "model unavailable: m at http://x: HTTP 503"})])
    task = Task(id="t-1", objective="x", workspace="/w", constraints={"timeout": "1h"}, state="PAUSED", active_s=60.0)
    row = summary(task, d, now=5000.0)
    assert [a["text"] for a in row["alerts"]] == ["PAUSED: model unavailable: m at http://x: HTTP 503"]
    assert row["alert_count"] == 1 and row["time"]["clock"] == "stopped" and row["time"]["remaining_s"] == 3540.0
    d.fold([_ev(2, "state", {"state": "QUEUED", "reason": "resumed by request"})])
    assert summary(task, d)["alerts"] == []
    d.fold([_ev(3, "state", {"state": "PAUSED", "reason": "paused by request"})])
    assert summary(task, d)["alert_count"] == 0  # the user's own pause is no alert


def test_rollbacks_say_who_made_them(store, config, workspace):
    from openglm.agent.hooks import Hooks

    def undo(ctx, record):
        if record.step == 2 and not any(e.kind == "rollback" for e in ctx.store.all_events(ctx.task_id)):
            ctx.rollback(1)

    task = service.submit(store, config, "x", str(workspace))
    assert make_worker(config, store, FILES, hooks=Hooks(step_callbacks=[undo])).run_one() == "SUCCEEDED"
    service.rollback(store, config, task.id, 1)
    assert [e.data["by"] for e in store.all_events(task.id) if e.kind == "rollback"] == ["runtime", "user"]

