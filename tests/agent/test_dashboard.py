"""The dashboard's data (digest, trajectory, snapshot diff, live output) and its access rules, without a browser."""

import re
import threading
import time

import pytest
from agent_testkit import call, make_worker, turn
from fastapi.testclient import TestClient

from openglm.agent import service
from openglm.agent.api import create_app
from openglm.agent.dashboard import export, trajectory
from openglm.agent.dashboard.diff import snapshot_vs_workspace
from openglm.agent.dashboard.digest import Digest, summary
from openglm.agent.dashboard.hub import Hub
from openglm.agent.dashboard.live import Tail
from openglm.agent.policy import ToolCallingPolicy
from openglm.agent.state import rebuild
from openglm.agent.store.base import Event
from openglm.agent.store.sqlite_store import SQLiteStore
from openglm.agent.task import Task
from openglm.agent.tools import shell
from openglm.agent.tools.shell import run_shell

TURNS = [
    turn(call("create", path="a.txt", content="one\n"), content="create it"),
    turn(call("bash", command="echo two >> a.txt && cat a.txt"), content="append"),
    turn(call("submit", summary="done"), content="finished"),
]


@pytest.fixture
def sqlite(tmp_path):
    s = SQLiteStore(str(tmp_path / "agent.db"))
    yield s
    s.close()


def ev(seq, kind, data, step=1, ts=None):
    return Event(seq=seq, kind=kind, step=step, data=data, ts=ts or 1000.0 + seq)


def test_digest_alerts_phase_budget_and_time_left():
    d = Digest()
    d.fold([ev(1, "phase", {"phase": "design", "data": {"phase_steps": 3, "phase_started_s": 40.0},
                            "budget": {"steps": 12, "minutes": 30}}),
            ev(2, "step_committed", {"snapshot": "abc"}),
            ev(3, "state", {"state": "NEEDS_INPUT", "reason": "A or B?"}),
            ev(4, "resource_threshold_crossed", {"metric": "cpu_percent", "value": 97.0, "limit": 85.0}),
            ev(5, "resource_threshold_crossed", {"metric": "disk_free_bytes", "value": 1.0, "limit": 5.0}),
            ev(6, "resource_threshold_cleared", {"metric": "disk_free_bytes", "value": 9.0, "limit": 5.0}),
            ev(7, "recovery_escalation", {"level": 3, "error_class": "verification_failed", "cause": "tests broke"})])
    task = Task(id="t-1", objective="x", workspace="/w", constraints={"timeout": "1h", "max_tokens": 1000},
                state="NEEDS_INPUT", active_s=100.0, step=4, prompt_tokens=70, completion_tokens=30)
    row = summary(task, d, now=2000.0)
    assert row["phase"] == {"name": "design", "steps": 3, "elapsed_s": 60.0, "budget": {"steps": 12, "minutes": 30},
                            "used": 0.25}  # 3 of 12 steps outweighs 1 of 30 minutes
    assert row["time"]["remaining_s"] == 3500.0 and row["time"]["used"] == pytest.approx(100 / 3600)
    assert row["cost"] == {"prompt_tokens": 70, "completion_tokens": 30, "tokens": 100, "max_tokens": 1000}
    texts = [a["text"] for a in row["alerts"]]
    assert texts[0] == "cpu_percent 97 past 85"  # still crossed; the cleared disk alert is gone
    assert not any("disk_free" in t for t in texts)
    assert "recovery L3 for verification_failed" in texts[1] and "NEEDS_INPUT: A or B?" in texts[2]  # newest first
    assert row["last_activity"] == {"ts": 1007.0, "kind": "recovery_escalation"} and d.after == 7
    assert row["alerts"][0]["metric"] == "cpu_percent" and row["alerts"][0]["value"] == 97.0  # the page formats it
    d.fold([ev(8, "answer", {"answer": "A", "question": "A or B?"})])
    assert not any("NEEDS_INPUT" in a["text"] for a in summary(task, d, now=2000.0)["alerts"])
    d.fold([ev(9, "state", {"state": "PAUSED", "reason": "paused by request"})])  # the run (and its monitor) ended
    assert not any(a["kind"] == "threshold" for a in summary(task, d, now=2000.0)["alerts"])


def test_summary_of_a_record_with_bad_constraints_still_renders():
    row = summary(Task(id="t-2", objective="x", workspace="/w", constraints={"timeout": "8 parsecs"}), Digest())
    assert row["time"]["timeout_s"] is None and row["steps"]["max"] == 0


def test_trajectory_turns_hold_new_prompt_messages_reply_results_and_verdicts(sqlite, config, workspace):
    task = service.submit(sqlite, config, "grow a.txt", str(workspace), {"deliverables": ["a.txt"]})
    assert make_worker(config, sqlite, TURNS).run_one() == "SUCCEEDED"
    events = sqlite.all_events(task.id)
    traj = trajectory.build(sqlite.get_task(task.id), events, ToolCallingPolicy().initial_messages(task))
    turns = traj["turns"]
    assert [t["step"] for t in turns] == [1, 2, 3]
    assert [t["reply"] for t in turns] == ["create it", "append", "finished"]
    assert [m["role"] for m in turns[0]["prompt"]] == ["system", "user"]
    assert "grow a.txt" in turns[0]["prompt"][1]["content"]
    # turn 2 shows only what is new: the assistant's turn-1 call and its result, not the system prompt again
    assert [m["role"] for m in turns[1]["prompt"]] == ["assistant", "tool"] and turns[1]["prompt_messages"] == 4
    assert turns[1]["calls"][0]["result"]["output"].endswith("one\ntwo\n") and turns[1]["calls"][0]["result"]["ok"]
    assert turns[2]["verdicts"][0]["kind"] == "deliverables" and turns[2]["verdicts"][0]["data"]["ok"] is True
    snaps = rebuild([], events).steps
    assert [t["snapshot"] for t in turns] == [snaps[1], snaps[2], snaps[3]]


class PhasePromptPolicy(ToolCallingPolicy):
    """Adds a message of its own to every prompt (as the SWE policy adds its phase prompt)."""

    def prepare(self, ctx, state, tools):
        messages, tools, events = super().prepare(ctx, state, tools)
        return messages + [{"role": "user", "content": f"PHASE PROMPT before step {state.next_step}"}], tools, events


def test_trajectory_shows_what_the_policy_added_to_each_prompt(sqlite, config, workspace):
    task = service.submit(sqlite, config, "grow a.txt", str(workspace))
    assert make_worker(config, sqlite, TURNS, policy_factory=PhasePromptPolicy).run_one() == "SUCCEEDED"
    traj = trajectory.build(sqlite.get_task(task.id), sqlite.all_events(task.id),
                            ToolCallingPolicy().initial_messages(task))
    for n, t in enumerate(traj["turns"], start=1):
        assert t["prompt"][-1] == {"role": "user", "content": f"PHASE PROMPT before step {n}", "added": True}
        assert not any(m.get("added") for m in t["prompt"][:-1]) and not t["prompt_rewritten"]
    assert [m["role"] for m in traj["turns"][1]["prompt"]] == ["assistant", "tool", "user"]  # the added one is not kept


def test_export_is_one_file_with_the_data_escaped(tmp_path):
    data = {"task": {"id": "t-x", "objective": "</script><script>alert(1)</script>", "state": "SUCCEEDED"}, "turns": []}
    html = export.render(data)
    assert "</script><script>alert(1)" not in html and "<\\/script><script>alert(1)<\\/script>" in html
    refs = set(re.findall(r'(?:src|href)="([^"]*)"', html)) | set(re.findall(r"https?://[^\s\"']+", html))
    # the favicon stub, the (hidden) back link, the SVG namespace
    assert refs == {"data:,", "./", "http://www.w3.org/2000/svg"}


def test_snapshot_diff_shows_edits_new_files_and_respects_ignores(sqlite, config, workspace):
    task = service.submit(sqlite, config, "grow a.txt", str(workspace))
    assert make_worker(config, sqlite, TURNS).run_one() == "SUCCEEDED"
    sha1 = rebuild([], sqlite.all_events(task.id)).steps[1]
    (workspace / "b.txt").write_text("by hand\n")
    (workspace / ".venv").mkdir()
    (workspace / ".venv" / "junk.py").write_text("x = 1\n")
    git_dir = config.task_dir(task.id) / "snapshots.git"
    d = snapshot_vs_workspace(git_dir, str(workspace), sha1)
    assert d["name_status"] == ["M\ta.txt", "A\tb.txt"] and d["files"] == 2
    assert "+two" in d["patch"] and "+by hand" in d["patch"] and ".venv" not in d["patch"]
    index = git_dir / "index"
    before = index.stat().st_mtime_ns if index.exists() else None
    snapshot_vs_workspace(git_dir, str(workspace), sha1)
    assert (index.stat().st_mtime_ns if index.exists() else None) == before  # the runtime's index is untouched


def test_tail_follows_a_file_across_commands_truncation_and_split_characters(tmp_path):
    path = tmp_path / "running.out"
    tail = Tail(str(path))
    assert tail.poll() == (None, "")
    path.write_bytes(b"[1700000000.5] $ make test\n" + "héllo ".encode()[:2])  # 'h' and half of 'é'
    assert tail.poll() == ({"command": "make test", "started": 1700000000.5}, "h")
    with open(path, "ab") as f:
        f.write("héllo ".encode()[2:] + b"world")
    assert tail.poll() == (None, "éllo world")
    path.write_bytes(b"[1700000000.5] $ make test\nx")  # restarted past the cap: from the start again
    assert tail.poll() == ({"command": "make test", "started": 1700000000.5}, "x")
    # the next command reuses the path (and maybe the inode) with more bytes than were read: still a new output
    path.write_bytes(b"[1700000009.0] $ ls\n" + b"a" * 100)
    assert tail.poll() == ({"command": "ls", "started": 1700000009.0}, "a" * 100)


def test_shell_publishes_output_while_the_command_runs(tmp_path, monkeypatch):
    live = tmp_path / "running.out"
    result = {}
    t = threading.Thread(target=lambda: result.update(r=run_shell(
        "echo first; sleep 1.5; echo second", str(tmp_path), timeout=10, output_file=str(live))))
    t.start()
    deadline = time.monotonic() + 5
    while not (live.exists() and live.read_text().endswith("] $ echo first; sleep 1.5; echo second\nfirst\n")):
        assert time.monotonic() < deadline, "no live output while the command ran"
        time.sleep(0.05)
    assert t.is_alive()  # seen before the command finished
    t.join()
    assert live.read_text().endswith("\nfirst\nsecond\n") and result["r"].output == "first\nsecond\n"
    monkeypatch.setattr(shell, "LIVE_CAP", 256)
    run_shell("for i in $(seq 1 40); do echo line-$i; done", str(tmp_path), timeout=10, output_file=str(live))
    text = live.read_text()
    assert text.startswith("[") and "] $ for i in" in text.splitlines()[0]  # the command's line survives the cap
    assert len(text) <= 256 and text.rstrip().endswith("line-40") and "earlier output dropped" in text


def test_view_token_reads_but_cannot_control(sqlite, config, workspace):
    app = create_app(config, store=sqlite, token="full", view_token="look")
    task = service.submit(sqlite, config, "x", str(workspace))
    with TestClient(app, base_url="http://localhost") as http:
        assert http.get("/ui/").status_code == 200 and "openglm tasks" in http.get("/ui/").text  # a shell, no data
        assert http.get("/v1/dash/tasks").status_code == 401
        view = {"Authorization": "Bearer look"}
        assert http.get("/v1/dash/me", headers=view).json()["control"] is False
        assert http.get(f"/v1/dash/tasks/{task.id}", headers=view).status_code == 200
        r = http.post(f"/v1/tasks/{task.id}/pause", headers=view)
        assert r.status_code == 403 and "read-only" in r.json()["detail"]
        assert sqlite.get_task(task.id).state == "QUEUED"
        full = {"Authorization": "Bearer full"}
        assert http.get("/v1/dash/me", headers=full).json()["control"] is True
        assert http.post(f"/v1/tasks/{task.id}/pause", headers=full).json()["state"] == "PAUSED"
        assert http.get(f"/v1/dash/tasks/{task.id}/diff?step=7", headers=full).status_code == 422
        assert http.get("/v1/dash/tasks/t-nope/trajectory", headers=full).status_code == 404


class CountingStore:
    """A store that counts event reads (the hub must not read logs that did not change)."""

    def __init__(self, store):
        self.store, self.event_reads = store, 0

    def __getattr__(self, name):
        return getattr(self.store, name)

    def events(self, *a, **kw):
        self.event_reads += 1
        return self.store.events(*a, **kw)


def test_hub_reads_only_changed_logs_and_reports_changed_rows(store, config, workspace):
    task = service.submit(store, config, "x", str(workspace))
    store.append(task.id, [("tick", 0, {"i": i}) for i in range(2500)])
    counting = CountingStore(store)
    hub = Hub(counting)
    hub.refresh()
    assert hub.digests[task.id].after == 2501 and counting.event_reads == 3  # 1000 + 1000 + 501 events
    version, rows = hub.changes_since(0)
    assert [r["id"] for r in rows] == [task.id] and rows[0]["last_activity"]["kind"] == "tick"
    hub.refresh()
    hub.refresh()
    assert counting.event_reads == 3 and hub.changes_since(version) == (version, [])  # nothing new, nothing read
    store.update_task(task.id, {"resources": {"cpu_percent": 50.0, "rss_bytes": 1000}})
    hub.refresh()
    new_version, rows = hub.changes_since(version)
    assert new_version == version + 1 and rows[0]["resources"]["cpu_percent"] == 50.0
    assert [s["cpu_percent"] for s in hub.history[task.id]] == [50.0]


def test_export_html_without_a_server_is_one_line(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "openglm.agent", "task", "export-html", "t-x",
                        "--out", str(tmp_path / "x.html"), "--server", "http://127.0.0.1:9"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert "cannot reach the task API at http://127.0.0.1:9" in p.stderr
    assert not (tmp_path / "x.html").exists()
