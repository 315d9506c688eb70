"""The agent runtime's hostile-input repros, one test per attack: snapshots as an execution surface,
the task API's browser trust and limits, the file tools' reads, the clone in the submit handler and
a store deleted under a running server. (The sandbox's own attacks: test_sandbox.py.)"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import tracemalloc
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest
import uvicorn
from agent_testkit import ScriptedModel, call, make_worker, turn
from fastapi.testclient import TestClient
from testutil import closed_by_server, free_port

from openglm.agent import service
from openglm.agent.api import AGENT_LIMITS, create_app
from openglm.agent.config import AgentConfig
from openglm.agent.snapshot import Snapshots
from openglm.agent.store import StoreUnavailable
from openglm.agent.store.sqlite_store import SQLiteStore
from openglm.agent.tools import ToolBox
from openglm.agent.tools import files as file_tools
from openglm.agent.worker import Worker
from openglm.util.git import clone, git, init_repo
from openglm.util.http_limits import HTTPLimits, uvicorn_config


@pytest.fixture
def api(tmp_path):
    config = AgentConfig(data_dir=str(tmp_path / "data"), workspace_roots=[str(tmp_path / "allowed")])
    (tmp_path / "allowed").mkdir()
    store = SQLiteStore(str(tmp_path / "data" / "agent.db"))
    yield TestClient(create_app(config, store=store), base_url="http://127.0.0.1:8100"), store, config
    store.close()


# ---- snapshots are not an execution surface ----------------------------------------------------------

def _planted(path: Path, out: Path) -> None:
    """An fsmonitor 'hook' that records its environment and leaves a daemon behind."""
    path.write_text(f"#!/bin/sh\nenv > {out}\n(setsid sleep 300 </dev/null >/dev/null 2>&1 &)\nexit 1\n")
    path.chmod(0o755)


def test_a_planted_fsmonitor_never_runs_and_git_gets_no_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENGLM_AGENT_TOKEN", "agent-token-91c2")
    monkeypatch.setenv("OPENGLM_MODEL_API_KEY", "model-key-52be")
    ws, hook, ran = tmp_path / "ws", tmp_path / "hook.sh", tmp_path / "hook-ran.txt"
    ws.mkdir()
    (ws / "a.txt").write_text("a\n")
    _planted(hook, ran)
    snaps = Snapshots(ws, tmp_path / "task" / "snapshots.git", track=False)
    snaps.take("step 0")
    with open(snaps.git_dir / "config", "a") as f:  # what a step that could reach the repository would plant
        f.write(f"[core]\n\tfsmonitor = {hook}\n\thooksPath = {tmp_path}\n")
    (ws / "a.txt").write_text("b\n")
    snaps.take("step 1")
    snaps.restore(snaps.head)
    init_repo(ws)  # the workspace's own repository, which a task's commands do write
    git(ws, "config", "core.fsmonitor", str(hook))
    _planted(ws / ".git" / "hooks" / "pre-commit", ran)
    git(ws, "status")
    git(ws, "commit", "-q", "--allow-empty", "-m", "hooks would run here")
    assert not ran.exists(), "git ran a program named by a repository's config"
    env = {}

    def capture(argv, **kw):
        env.update(kw["env"])
        return real(argv, **kw)

    from openglm.util import proc
    real = proc.run
    monkeypatch.setattr(proc, "run", capture)
    snaps.take("step 2")
    assert env and not {"OPENGLM_AGENT_TOKEN", "OPENGLM_MODEL_API_KEY"} & set(env)


def test_a_workspace_repos_filter_and_textconv_programs_never_run_for_snapshots_or_the_diff(tmp_path):
    """A task may write its workspace's own .git/config and .gitattributes; snapshots and the dashboard's
    rollback diff read only the snapshot repository's config, which it cannot reach."""
    from openglm.agent.dashboard.diff import snapshot_vs_workspace

    ws, hook, ran = tmp_path / "ws", tmp_path / "hook.sh", tmp_path / "hook-ran.txt"
    ws.mkdir()
    _planted(hook, ran)
    (ws / "a.txt").write_text("a\n")
    init_repo(ws)
    for key in ("filter.evil.clean", "filter.evil.smudge", "filter.evil.process", "diff.evil.textconv",
                "diff.external"):
        git(ws, "config", key, str(hook))
    (ws / ".gitattributes").write_text("* filter=evil diff=evil\n")
    snaps = Snapshots(ws, tmp_path / "task" / "snapshots.git", track=False)
    first = snaps.take("step 0")
    (ws / "a.txt").write_text("b\n")
    snaps.take("step 1")
    assert "+b" in snapshot_vs_workspace(snaps.git_dir, str(ws), first)["patch"]
    snaps.restore(first)
    assert (ws / "a.txt").read_text() == "a\n" and not ran.exists()


def test_the_snapshot_repository_must_lie_outside_the_workspace(tmp_path):
    (tmp_path / "ws").mkdir()
    with pytest.raises(Exception, match="outside the workspace"):
        Snapshots(tmp_path / "ws", tmp_path / "ws" / "inner" / "snapshots.git", track=False)


def test_clone_never_takes_the_source_for_an_option(tmp_path, monkeypatch):
    (tmp_path / "origin").mkdir()
    (tmp_path / "origin" / "f").write_text("x")
    init_repo(tmp_path / "origin")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    pwned = tmp_path / "pwned"
    # without `--`, git reads the "source" as an option naming a program to run and the destination as the source
    with pytest.raises(Exception):
        clone(f"--upload-pack=touch {pwned}; git-upload-pack", f"file://{tmp_path / 'origin'}", timeout=30)
    assert not pwned.exists()


# ---- task API: workspaces, browser trust ------------------------------------------------------------

@pytest.mark.parametrize("workspace", ["/", "/etc", "../../..", "/root"])
def test_a_workspace_outside_the_allowed_roots_is_refused(api, workspace):
    client, store, _ = api
    resp = client.post("/v1/tasks", json={"objective": "x", "workspace": workspace})
    assert resp.status_code == 422 and resp.json()["field"] == "workspace" and "--workspace-root" in resp.text
    assert store.list_tasks() == []


def test_a_workspace_under_an_allowed_root_is_accepted(api, tmp_path):
    client, _, _ = api
    (tmp_path / "allowed" / "repo").mkdir()
    resp = client.post("/v1/tasks", json={"objective": "x", "workspace": str(tmp_path / "allowed" / "repo")})
    assert resp.status_code == 201


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8100", "127.0.0.1.attacker.example", ""])
def test_dns_rebinding_a_foreign_host_header_is_refused_on_every_route(api, host):
    client, store, config = api
    task = service.submit(store, config, "secret objective")
    for path in ("/health", "/v1/tasks", f"/v1/tasks/{task.id}", "/ui/", "/metrics"):
        resp = client.get(path, headers={"Host": host})
        assert resp.status_code == 400 and "secret objective" not in resp.text, path


def test_a_cross_site_form_post_cannot_cancel_a_task(api):
    client, store, config = api
    task = service.submit(store, config, "x")
    for headers in ({"Origin": "http://attacker.example", "Content-Type": "application/x-www-form-urlencoded"},
                    {"Content-Type": "application/x-www-form-urlencoded"},  # an old browser sends no Origin
                    {"Content-Type": "text/plain"}, {"Content-Type": "multipart/form-data; boundary=x"},
                    {"Origin": "null"}):
        resp = client.post(f"/v1/tasks/{task.id}/cancel", content=b"a=b", headers=headers)
        assert resp.status_code in (403, 415), headers
    assert store.get_task(task.id).state == "QUEUED"
    same_site = client.post(f"/v1/tasks/{task.id}/cancel", headers={"Origin": "http://127.0.0.1:8100"})
    assert same_site.status_code == 200 and store.get_task(task.id).state == "CANCELLED"


def test_a_foreign_origin_cannot_create_tasks(api):
    client, store, _ = api
    for origin in ("http://attacker.example", "http://localhost:9999", "https://127.0.0.1:8100.attacker.example"):
        resp = client.post("/v1/tasks", json={"objective": "x"}, headers={"Origin": origin})
        assert resp.status_code == 403, origin
    assert store.list_tasks() == []
    assert client.post("/v1/tasks", json={"objective": "x"}, headers={"Origin": "http://127.0.0.1:8100"}
                       ).status_code == 201


def test_a_configured_public_name_is_served(tmp_path):
    config = AgentConfig(data_dir=str(tmp_path / "data"), public_names=["agent.example.org"])
    client = TestClient(create_app(config, store=SQLiteStore(str(tmp_path / "a.db"))),
                        base_url="https://agent.example.org")
    assert client.get("/v1/tasks").status_code == 200
    assert client.post("/v1/tasks", json={"objective": "x"}, headers={"Origin": "https://agent.example.org"}
                       ).status_code == 201


def test_the_token_is_never_taken_from_the_command_line(tmp_path):
    from openglm.agent.cli import main

    for flag in ("--token", "--view-token"):
        with pytest.raises(SystemExit, match=f"{flag} on the command line is visible"):
            main(["agent-server", flag, "s3cret", "--data-dir", str(tmp_path), "--workers", "0"])
    with pytest.raises(SystemExit, match="--token-file .* is empty"):
        (tmp_path / "empty").write_text("\n")
        main(["agent-server", "--token-file", str(tmp_path / "empty"), "--data-dir", str(tmp_path)])


# ---- task API: the server's limits ------------------------------------------------------------------

def test_an_oversized_objective_is_refused(api):
    client, store, _ = api
    huge = client.post("/v1/tasks", content=b'{"objective": "' + b"x" * (2 << 20) + b'"}',
                       headers={"Content-Type": "application/json"})
    assert huge.status_code == 413
    long = client.post("/v1/tasks", json={"objective": "x" * 300_000})
    assert long.status_code == 422 and long.json()["field"] == "objective"
    assert store.list_tasks() == []


@pytest.mark.parametrize("query", ["limit=100000000000000000000000", "limit=1e23", "limit=-1", "limit=0",
                                   "offset=-1", "offset=100000000000000000000000"])
def test_paging_parameters_out_of_range_are_400s(api, query):
    client, store, config = api
    resp = client.get(f"/v1/tasks?{query}")
    assert resp.status_code == 400 and resp.json()["field"] == query.split("=")[0]


def test_event_paging_parameters_out_of_range_are_400s(api):
    client, store, config = api
    task = service.submit(store, config, "x")
    for query, field in (("after=-1", "after"), ("after=1e23", "after"), ("limit=-1", "limit"),
                         ("limit=100000", "limit"), ("after=100000000000000000000000", "after")):
        resp = client.get(f"/v1/tasks/{task.id}/events?{query}")
        assert resp.status_code == 400 and resp.json()["field"] == field, query
    assert client.get(f"/v1/tasks/{task.id}?recent=-5").status_code == 400
    assert client.get("/v1/tasks?limit=2&offset=0").status_code == 200


@pytest.fixture
def start_live(tmp_path):
    """Factory: an in-process agent API (no workers) on a free port with `limits`, served as `agent-server`
    serves it."""
    servers = []

    def start(limits: HTTPLimits):
        config = AgentConfig(data_dir=str(tmp_path / "data"))
        store = SQLiteStore(str(tmp_path / "data" / "agent.db"))
        port = free_port()
        server = uvicorn.Server(uvicorn_config(create_app(config, store=store, limits=limits), "127.0.0.1", port,
                                               limits, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        return url, port, store, config

    yield start
    for server, thread in servers:
        server.should_exit = server.force_exit = True
        thread.join(10)


@pytest.fixture
def live(start_live):
    """The agent API with short body and head deadlines, and room for many event-stream viewers."""
    return start_live(dataclasses.replace(AGENT_LIMITS, body_timeout_s=2.0, header_timeout_s=2.0,
                                          max_connections=500))


def test_idle_event_streams_hold_no_thread(live):
    url, port, store, config = live
    task = service.submit(store, config, "watched")
    viewers = []
    for _ in range(60):  # more than the 40 threads that serve the synchronous routes
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(f"GET /v1/tasks/{task.id}/events?stream=true HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        viewers.append(s)
    for s in viewers:
        s.settimeout(10)
        assert s.recv(200).startswith(b"HTTP/1.1 200")
    try:
        t0 = time.monotonic()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.post(url + "/v1/tasks", json={"objective": "y"}, timeout=10).status_code == 201
        assert time.monotonic() - t0 < 8  # generous for a loaded machine; an exhausted pool never answers
    finally:
        for s in viewers:
            s.close()


def test_a_trickled_body_is_cut_off_at_the_whole_body_deadline(live):
    _, port, store, _ = live
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
              "Content-Length: 100\r\n\r\n".encode())
    t0 = time.monotonic()
    answer = b""
    s.settimeout(0.25)
    while time.monotonic() - t0 < 15 and not answer:
        try:
            s.sendall(b" ")  # a byte every quarter second: every pause short, the body never whole
        except OSError:
            break
        try:
            answer = s.recv(1000)
        except socket.timeout:
            pass
    seconds = time.monotonic() - t0
    s.settimeout(5)
    while answer and not answer.endswith(b"}"):  # the head and the JSON body may come apart
        more = s.recv(1000)
        if not more:
            break
        answer += more
    s.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"did not arrive in time (2 s, plus 1 s per 65536 bytes received)" in answer
    assert 1.9 < seconds < 10  # the 2 s deadline (plus 1/65536 s per byte); generous for a loaded machine
    assert store.list_tasks() == []


def test_an_oversized_upload_is_a_413_that_urllib_and_httpx_read(live):
    url, _, store, _ = live
    body = b'{"objective": "' + b"a" * (8 << 20) + b'"}'  # 8 MiB against the 1 MiB cap, sent whole regardless
    request = urllib.request.Request(f"{url}/v1/tasks", data=body, method="POST",
                                      headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:  # without the lingering close: a connection reset
        urllib.request.urlopen(request, timeout=60)
    assert e.value.code == 413 and b"larger than this server's limit of 1048576 bytes" in e.value.read()
    resp = httpx.post(f"{url}/v1/tasks", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert resp.status_code == 413 and "1048576 bytes" in resp.json()["detail"]
    assert store.list_tasks() == [] and httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_slow_connections_do_not_take_the_places_of_ready_requests(start_live):
    limits = dataclasses.replace(AGENT_LIMITS, limit_concurrency=8, max_connections=8, header_timeout_s=60,
                                 body_timeout_s=60)
    url, port, store, _ = start_live(limits)
    slow = []
    try:
        for i in range(16):  # unfinished heads and trickled bodies, twice the connection cap
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            head = f"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            s.sendall((head + "Content-Length: 1000\r\n\r\n{" if i % 2 else head).encode())
            slow.append(s)
        time.sleep(0.5)
        with httpx.Client(base_url=url, timeout=30) as c:  # uvicorn's own connection count answered 503 here
            for _ in range(3):
                assert c.post("/v1/tasks", json={"objective": "ready"}).status_code == 201
            assert c.get("/health").status_code == 200
        assert len(store.list_tasks()) == 3
        assert sum(map(closed_by_server, slow)) >= 8  # the ones beyond the cap, the longest-waiting first
    finally:
        for s in slow:
            s.close()


def test_a_request_head_trickled_forever_is_dropped(live):
    url, port, _, _ = live
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode())
    t0, closed = time.monotonic(), False
    s.settimeout(0.5)
    while time.monotonic() - t0 < 15 and not closed:
        try:
            s.sendall(b"X-Slow: 1\r\n")  # a header line every half second, never the blank line that ends the head
            closed = s.recv(200) == b""
        except socket.timeout:
            pass
        except OSError:
            closed = True
    s.close()
    assert closed and time.monotonic() - t0 < 8  # the 2 s head timeout, generous for a loaded machine
    assert httpx.get(url + "/health", timeout=10).status_code == 200


# ---- repositories are cloned by a worker -------------------------------------------------------------

@pytest.mark.parametrize("repo", ["http://127.0.0.1:9/x.git", "https://169.254.169.254/latest/meta-data",
                                  "https://10.0.0.1/x.git", "git@github.com:o/r.git", "ssh://github.com/o/r",
                                  "https://user:pw@github.com/o/r", "https://github.com:8443/o/r",
                                  "ext::sh -c touch% /tmp/pwned", "--upload-pack=touch /tmp/pwned",
                                  "file:///etc"])
def test_an_internal_or_odd_repo_url_is_refused_at_submit(api, repo):
    client, store, _ = api
    t0 = time.monotonic()
    resp = client.post("/v1/tasks", json={"objective": "x", "repo": repo})
    assert resp.status_code == 422 and resp.json()["field"] == "repo" and time.monotonic() - t0 < 10  # no fetch here
    assert store.list_tasks() == []


def test_a_repo_is_cloned_by_the_worker_not_the_submit_request(api, tmp_path):
    client, store, config = api
    t0 = time.monotonic()
    resp = client.post("/v1/tasks", json={"objective": "x", "repo": "https://github.com/openglm/none"})
    assert resp.status_code == 201 and time.monotonic() - t0 < 10  # no network while the client waits
    task = store.get_task(resp.json()["task_id"])
    assert task.state == "QUEUED" and task.meta["repo"] == "https://github.com/openglm/none"
    assert not Path(task.workspace).exists()


def test_a_failed_clone_does_not_echo_what_the_server_answered(tmp_path):
    config = AgentConfig(data_dir=str(tmp_path / "data"), clone_timeout_s=10)
    store = SQLiteStore(str(tmp_path / "agent.db"))
    answer = b"HTTP/1.1 403 Forbidden\r\nContent-Length: 22\r\n\r\ninternal-secret-banner"
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve():
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(answer)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{port}/repo.git"
    task = service.submit(store, config, "x", repo=url)  # a trusted caller: no URL checks
    assert make_worker(config, store, []).run_one() == "FAILED"
    reason = store.get_task(task.id).reason
    said = reason.split(repr(url), 1)[1]  # what follows the URL (whose port may itself hold "403")
    assert reason.startswith("cannot clone") and "403" not in said and "Forbidden" not in said
    assert "internal-secret-banner" not in reason
    server.close()


# ---- file tools with limits ---------------------------------------------------------------------------

def test_view_of_a_fifo_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    box = ToolBox(str(tmp_path))
    t0 = time.monotonic()
    result = box.call("view", {"path": "pipe"})
    assert not result.ok and "FIFO" in result.output and time.monotonic() - t0 < 10  # it used to block for good
    assert not box.call("edit", {"path": "pipe", "old": "a", "new": "b"}).ok


def test_cancel_interrupts_a_blocked_file_tool(tmp_path, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(file_tools, "view", lambda *a, **k: release.wait(60) and "late")
    box = ToolBox(str(tmp_path))
    t0 = time.monotonic()
    result = box.call("view", {"path": "x"}, should_stop=lambda: time.monotonic() - t0 > 0.3)
    release.set()
    assert not result.ok and result.meta["killed"] == "cancelled" and time.monotonic() - t0 < 10  # it blocks 60 s
    box.file_tool_timeout = 0.3
    release.clear()
    result = box.call("view", {"path": "x"})
    release.set()
    assert result.meta["killed"] == "timeout"


def test_a_fifo_view_in_a_task_neither_hangs_it_nor_survives_a_cancel(tmp_path):
    config = AgentConfig(data_dir=str(tmp_path / "data"), lease_ttl=30, poll_interval=0.05)
    store = SQLiteStore(str(tmp_path / "agent.db"))
    ws = tmp_path / "ws"
    ws.mkdir()
    os.mkfifo(ws / "pipe")
    task = service.submit(store, config, "x", str(ws))
    t0 = time.monotonic()
    state = make_worker(config, store, [turn(call("view", path="pipe")), turn(call("submit", summary="ok"))]).run_one()
    assert state == "SUCCEEDED" and time.monotonic() - t0 < 20
    obs = [e.data for e in store.all_events(task.id) if e.kind == "observation"]
    assert "not a regular file" in obs[0]["output"]


def test_view_of_a_huge_sparse_file_reads_only_what_it_returns(tmp_path):
    with open(tmp_path / "sparse.bin", "wb") as f:
        f.truncate(700 << 20)  # 700 MB of holes: free on disk, and the old view read it all into memory
    with open(tmp_path / "long.txt", "w") as f:
        f.writelines(f"line {i}\n" for i in range(200_000))
    tracemalloc.start()
    try:
        text = file_tools.view(tmp_path, "sparse.bin", max_chars=20_000)
        lines = file_tools.view(tmp_path, "long.txt", start=150_000, end=150_002)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(text) < 21_000 and "output cut at 20000 characters" in text
    assert lines.splitlines() == ["150000\tline 149999", "150001\tline 150000", "150002\tline 150001"]
    assert peak < 8 << 20  # a few pieces of 64 KiB, not the file


def test_edit_refuses_a_file_too_large_to_hold(tmp_path):
    with open(tmp_path / "big.txt", "wb") as f:
        f.truncate(64 << 20)
    result = ToolBox(str(tmp_path)).call("edit", {"path": "big.txt", "old": "a", "new": "b"})
    assert not result.ok and "more than the edit tool's" in result.output


# ---- the store is watched ------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_deleted_or_replaced_store_file_is_noticed_and_nothing_more_is_committed(tmp_path, how):
    config = AgentConfig(data_dir=str(tmp_path / "data"), lease_ttl=30, poll_interval=0.05)
    path = Path(config.store_url)
    store = SQLiteStore(str(path))
    ws = tmp_path / "ws"
    ws.mkdir()
    task = service.submit(store, config, "x", str(ws))

    def pull_the_file(messages):
        for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            name.unlink(missing_ok=True)
        if how == "replaced":
            SQLiteStore(str(path)).close()  # a fresh, empty store now has the name
        return turn(call("bash", command="echo step two"))

    model = ScriptedModel([turn(call("bash", command="echo step one")), pull_the_file,
                           turn(call("submit", summary="done"))])
    worker = Worker(config, store=store, model=model)
    with pytest.raises(StoreUnavailable, match="lost"):
        worker.run_one()
    assert worker.pending_pause is not None and "lost" in worker.pending_pause[3]
    with pytest.raises(StoreUnavailable, match=f"was {how}"):
        store.check()
    client = TestClient(create_app(config, store=store), base_url="http://localhost")
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["store"].startswith("store: lost")
    assert client.get(f"/v1/tasks/{task.id}").status_code == 503


def test_the_sandbox_status_is_on_health(api):
    client, _, _ = api
    assert client.get("/health").json()["sandbox"] == "bwrap"


def test_commands_are_refused_where_the_sandbox_cannot_be_set_up(tmp_path, monkeypatch):
    from openglm.util import sandbox

    sandbox.probe.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap to be found
    try:
        result = ToolBox(str(tmp_path)).call("bash", {"command": "echo hi"})
        assert not result.ok and "commands are refused" in result.output and "bubblewrap" in result.output
        assert "--unsafe-no-sandbox" in result.output and result.meta["refused"]
    finally:
        sandbox.probe.cache_clear()
