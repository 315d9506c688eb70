"""The dashboard in a real headless Chromium against a live `agent-server` (one browser for the module).

Tasks run replay-model scripts (one per task, through the task's model spec); the resilience hooks
watch them with a compressed leak window so an injected leak crosses its threshold in seconds.
Set OPENGLM_DASH_SCREENSHOTS=docs/img to (re)write the screenshots shown in docs/agent.md.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from agent_testkit import AgentServer, call, turn, write_script
from browser import PHONE, WIDE, RequestLog, launch
from playwright import sync_api as playwright_api
from testutil import free_port

MB = 2**20
LEAK = ("python3 -c \"import time\nheld = []\nfor i in range(140):\n"
        "    held.append(b'1' * 2**20); time.sleep(0.05)\nprint('leaked', len(held), 'MB')\"")  # 20 MB/s for 7 s
RESILIENCE = {"hooks": ["openglm.agent.resilience.hooks:factory"],
              "resilience": {"monitor": {"interval_s": 0.1, "short_window_s": 2.0, "thresholds": {
                  "rss_growth_short": {"limit": 2 * MB, "action": "warn", "sustain": 5, "cooldown_s": 60}}}}}


def ticks(tag, n, pause=0.25):
    return f"for i in $(seq 1 {n}); do echo {tag}-tick-$i; sleep {pause}; done"


@pytest.fixture(scope="module")
def pw():
    with playwright_api.sync_playwright() as p:
        browser = launch(p)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def dash(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash")
    (tmp / "config.json").write_text(json.dumps(RESILIENCE))
    default = write_script(tmp / "default.jsonl", [turn(call("submit", summary="nothing to do"))])
    srv = AgentServer(tmp, free_port(), default, workers=3,
                      extra_args=("--config", str(tmp / "config.json"))).wait_ready()
    srv.tmp = tmp
    srv.http = httpx.Client(base_url=srv.url, timeout=10)
    srv.leak = submit(srv, "leaky build", [turn(call("bash", command=LEAK)), turn(call("submit", summary="built"))])
    yield srv
    srv.stop()


def submit(srv, objective, turns, **constraints) -> str:
    name = f"{objective.replace(' ', '-')}-{time.monotonic_ns()}"
    script = write_script(srv.tmp / f"{name}.jsonl", turns)
    ws = srv.tmp / name
    ws.mkdir()
    r = srv.http.post("/v1/tasks", json={"objective": objective, "workspace": str(ws), "model": {"replay": script},
                                         "constraints": constraints or None})
    assert r.status_code == 201, r.text
    return r.json()["task_id"]


def task(srv, task_id) -> dict:
    return srv.http.get(f"/v1/tasks/{task_id}").json()


def events(srv, task_id, kind=None) -> list[dict]:
    evs = srv.http.get(f"/v1/tasks/{task_id}/events", params={"limit": 1000}).json()["events"]
    return [e for e in evs if kind is None or e["kind"] == kind]


def wait_until(predicate, timeout=30, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def page(pw):
    context = pw.new_context(viewport=WIDE)
    errors = []
    pg = context.new_page()
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.set_default_timeout(30_000)
    yield pg
    context.close()
    assert not errors, errors


def test_task_page_streams_the_running_commands_output(dash, page):
    tid = submit(dash, "long build", [turn(call("bash", command=ticks("A", 24))), turn(call("submit", summary="ok"))])
    page.goto(f"{dash.url}/ui/task.html?id={tid}")
    page.wait_for_function("document.getElementById('live-output').textContent.includes('A-tick-3')")
    status = task(dash, tid)
    # the command is still running: its step has not committed, yet its output is on the page
    assert status["state"] == "RUNNING" and status["step"] == 0, status
    assert "running: for i in" in page.inner_text("#live-cmd")
    page.wait_for_function("document.getElementById('live-output').textContent.includes('A-tick-8')")
    assert not page.inner_text("#live-output").count("A-tick-24")  # still streaming, not replayed at the end


def test_tasks_page_lists_a_running_task_and_shows_a_new_step_within_2_s(dash, page):
    tid = submit(dash, "three steps", [turn(call("bash", command=ticks("B", 12))),
                                       turn(call("bash", command=ticks("C", 12))), turn(call("submit", summary="ok"))])
    page.goto(f"{dash.url}/ui/")
    row = f'tr[data-task="{tid}"]'
    page.wait_for_selector(f"{row} .badge.s-RUNNING")
    page.evaluate("""(sel) => { window.seen = {}; new MutationObserver(() => {
        const r = document.querySelector(sel); """
                  """if (r && !(r.dataset.step in window.seen)) window.seen[r.dataset.step] = Date.now() / 1000;
      }).observe(document.querySelector('#tasks tbody'), {childList: true, subtree: true, attributes: true}); }""", row)
    page.wait_for_function(f"document.querySelector('{row}') && +document.querySelector('{row}').dataset.step >= 2",
                           timeout=40_000)
    seen = page.evaluate("window.seen")
    committed = {e["step"]: e["ts"] for e in events(dash, tid, "step_committed")}
    lags = {s: seen[str(s)] - committed[s] for s in (1, 2) if str(s) in seen}
    assert lags and all(0 <= lag < 2.0 for lag in lags.values()), lags
    assert "three steps" in page.inner_text(row)
    page.select_option("#f-state", "SUCCEEDED")  # filters: the running task is hidden
    if task(dash, tid)["state"] == "RUNNING":
        assert page.query_selector(row) is None


def test_pause_rollback_with_diff_resume_and_answer_through_the_page(dash, page):
    tid = submit(dash, "interactive", [
        turn(call("create", path="x.txt", content="v1\n")),
        turn(call("bash", command="echo v2 > x.txt; echo extra > new.txt; sleep 3")),
        turn(call("ask_user", question="option A or option B?")),
        turn(call("create", path="y.txt", content="done\n")),
        turn(call("submit", summary="ok"))])
    page.goto(f"{dash.url}/ui/task.html?id={tid}")
    page.wait_for_selector('#timeline tr[data-step="2"]')  # step 2 (the sleep) has started
    page.get_by_role("button", name="Pause task").click()
    page.wait_for_selector('body[data-state="PAUSED"]')
    t = task(dash, tid)
    assert t["state"] == "PAUSED" and t["reason"] == "paused by request" and t["step"] == 2
    ws = Path(t["workspace"])
    assert (ws / "x.txt").read_text() == "v2\n"

    page.select_option("#snap-step", "1")
    assert page.get_by_role("button", name="Roll the workspace back to this snapshot").is_disabled()  # diff first
    page.get_by_role("button", name="Show the diff of this snapshot against the workspace").click()
    diff = page.wait_for_selector("#diff:not([hidden])").inner_text()
    assert "-v1" in diff and "+v2" in diff and "new.txt" in diff
    assert f"Rolling back DELETES 1 file(s) the snapshot does not have from your folder {ws} (used in place)" in diff
    asked = []  # the workspace is the user's own folder: the page asks before deleting from it

    def reply(dialog, accept):
        asked.append(dialog.message)
        dialog.accept() if accept else dialog.dismiss()

    page.once("dialog", lambda d: reply(d, False))
    page.get_by_role("button", name="Roll the workspace back to this snapshot").click()
    page.wait_for_function("document.getElementById('snap-msg').textContent === 'not rolled back'")
    assert (ws / "new.txt").exists()
    page.once("dialog", lambda d: reply(d, True))
    page.get_by_role("button", name="Roll the workspace back to this snapshot").click()
    page.wait_for_function("document.getElementById('snap-msg').textContent.includes('rolled back to step 1')")
    assert (ws / "x.txt").read_text() == "v1\n" and not (ws / "new.txt").exists()
    assert asked == ["Roll back to step 1? 1 file(s) listed in the diff are deleted: new.txt"] * 2
    rollback = events(dash, tid, "rollback")[-1]["data"]
    assert rollback["to_step"] == 1 and rollback["by"] == "user"
    # the user's rollback is listed as theirs, not as the recovery ladder's L3
    page.wait_for_function("document.getElementById('rollbacks').textContent.includes("
                           "'rolled back by the user to step 1')")
    assert page.inner_text("#ladder tbody") == "no recovery events"

    page.get_by_role("button", name="Resume task").click()
    page.wait_for_selector('body[data-state="NEEDS_INPUT"]', timeout=40_000)
    assert "option A or option B?" in page.inner_text("#question")
    page.get_by_label("Your answer").fill("option B, please")
    page.get_by_role("button", name="Send answer").click()
    page.wait_for_selector('body[data-state="SUCCEEDED"]', timeout=40_000)
    answer = events(dash, tid, "answer")[-1]["data"]
    assert answer == {"answer": "option B, please", "question": "option A or option B?"}
    states = [e["data"]["state"] for e in events(dash, tid, "state")]
    assert states == ["PAUSED", "QUEUED", "NEEDS_INPUT", "QUEUED", "SUCCEEDED"], states
    assert (ws / "y.txt").exists()


def test_resource_graph_shows_the_injected_leak_crossing_its_threshold_and_the_alert(dash, page):
    tid = dash.leak
    wait_until(lambda: task(dash, tid)["state"] == "SUCCEEDED", 60, "the leaking task to finish")
    page.goto(f"{dash.url}/ui/task.html?id={tid}")
    alert = page.wait_for_selector('#res-alerts .alert[data-metric="rss_growth_short"]')
    assert "warn" in alert.inner_text() or "threshold crossed" in alert.inner_text()
    chart = page.locator("figure.chart", has_text="Memory growth")
    crossing = chart.evaluate("""(fig) => {
        const line = fig.querySelector('line.threshold'), path = fig.querySelector('path.series');
        const ys = path.getAttribute('d').split(/[ML]/).filter(Boolean).map((p) => +p.split(',')[1]);
        return {threshold_y: +line.getAttribute('y1'), top_y: Math.min(...ys), """
                             """markers: fig.querySelectorAll('.marker').length,
                label: fig.querySelector('svg').getAttribute('aria-label')};
      }""")
    assert crossing["top_y"] < crossing["threshold_y"], crossing  # SVG y grows downwards: the curve is above the line
    assert crossing["markers"] >= 1 and "threshold 120" in crossing["label"], crossing
    samples = dash.http.get(f"/v1/dash/tasks/{tid}/resources").json()["samples"]
    assert max(s.get("rss_growth_short", 0) for s in samples) > 2 * MB
    crossed = [e for e in events(dash, tid, "resource_threshold_crossed") if e["data"]["metric"] == "rss_growth_short"]
    assert crossed and crossed[0]["data"]["limit"] == 2 * MB
    page.goto(f"{dash.url}/ui/")
    assert "rss_growth_short" in page.inner_text(f'tr[data-task="{tid}"] .alerts')


def test_finished_and_paused_tasks_show_time_and_alerts_as_they_are(dash, page):
    """Before: "18 min 60 s left", a finished task with time left and a budget bar, and a task PAUSED for
    "model unavailable" with "alerts: none"."""
    page.goto(f"{dash.url}/ui/")
    page.wait_for_selector("#tasks")
    assert page.evaluate("[D.dur(1139.6), D.dur(59.7), D.dur(3599.8), D.dur(7199.9), D.dur(5.25)]") == [
        "19 min 0 s", "1 min 0 s", "1 h 0 min", "2 h 0 min", "5.3 s"]
    done = submit(dash, "quick one", [turn(call("submit", summary="ok"))], timeout="1h")
    stuck = submit(dash, "model gone", [], timeout="1h")  # an empty script: the model is unavailable at once
    wait_until(lambda: task(dash, done)["state"] == "SUCCEEDED" and task(dash, stuck)["state"] == "PAUSED", 30,
               "one task to finish and one to pause")
    finished, paused = f'tr[data-task="{done}"]', f'tr[data-task="{stuck}"]'
    page.wait_for_selector(f"{finished} .badge.s-SUCCEEDED")
    page.wait_for_selector(f"{paused} .badge.s-PAUSED")
    cell = page.inner_text(f'{finished} td[data-label="Time budget"]')
    assert "used" in cell and "finished (timeout 1 h 0 min)" in cell and "left" not in cell
    assert page.query_selector(f'{finished} td[data-label="Time budget"] [role=progressbar]') is None
    assert "left (clock stopped)" in page.inner_text(f'{paused} td[data-label="Time budget"]')
    alerts = page.inner_text(f"{paused} .alerts")
    assert "PAUSED: model unavailable:" in alerts and "replay script exhausted" in alerts
    page.check("#f-alerts")  # "with alerts" keeps it (each row counts its alerts)
    page.wait_for_selector(paused)
    assert page.query_selector(finished) is None
    page.goto(f"{dash.url}/ui/task.html?id={done}")
    page.wait_for_function("document.getElementById('progress').textContent.includes('used (timeout 1 h 0 min)')")
    assert page.query_selector("#progress [role=progressbar]") is None
    page.goto(f"{dash.url}/ui/task.html?id={stuck}")
    page.wait_for_function("document.getElementById('progress').textContent.includes('PAUSED: model unavailable')")


def test_exported_trajectory_opens_offline(dash, pw, tmp_path):
    tid = submit(dash, "export me", [turn(call("bash", command="echo 'exported-output </script>'"), content="run it"),
                                     turn(call("submit", summary="ok"), content="all done")])
    wait_until(lambda: task(dash, tid)["state"] == "SUCCEEDED", 30, "the task to finish")
    out = tmp_path / "trajectory.html"
    env = dict(os.environ, OPENGLM_AGENT_URL=dash.url)
    p = subprocess.run([sys.executable, "-m", "openglm.agent", "task", "export-html", tid, "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == str(out), p.stderr
    context = pw.new_context(viewport=WIDE, offline=True)
    log = RequestLog(context)
    context.route("**/*",
                  lambda route: route.abort() if not route.request.url.startswith("file:") else route.continue_())
    pg = context.new_page()
    pg.goto(out.as_uri())
    pg.wait_for_selector("body[data-ready='1']")
    assert pg.locator("article.turn").count() == 2
    pg.get_by_label("expand all prompts and results").check()
    text = pg.inner_text("#turns")
    assert "exported-output </script>" in text and "all done" in text and "Objective:\nexport me" in text
    assert log.urls == [out.as_uri()], log.urls
    context.close()


def _names_missing(pg) -> list[str]:
    return pg.evaluate("""() => [...document.querySelectorAll('button, select, input, textarea, a')].filter((e) => {
        if (e.closest('[hidden]')) return false;
        const label = e.getAttribute('aria-label') """
                      """|| (e.labels && [...e.labels].map((l) => l.textContent).join('')) || e.textContent;
        return !label.trim();
      }).map((e) => e.outerHTML.slice(0, 80))""")


def test_pages_at_desktop_and_phone_width_with_named_controls(dash, pw):
    shots = os.environ.get("OPENGLM_DASH_SCREENSHOTS")
    tid = dash.leak
    wait_until(lambda: task(dash, tid)["state"] == "SUCCEEDED", 60, "the leaking task to finish")
    running = submit(dash, "nightly build", [turn(call("bash", command=ticks("N", 200)))], timeout="2h")
    wait_until(lambda: task(dash, running)["state"] == "RUNNING", 30, "a running task")
    pages = {"tasks": "/ui/", "task": f"/ui/task.html?id={tid}", "trajectory": f"/ui/trajectory.html?id={tid}"}
    for size, viewport in (("desktop", WIDE), ("phone", PHONE)):
        context = pw.new_context(viewport=viewport, timezone_id="Asia/Shanghai")
        pg = context.new_page()
        for name, path in pages.items():
            pg.goto(dash.url + path)
            pg.wait_for_selector({"tasks": f'tr[data-task="{tid}"]', "task": "#timeline tr[data-step]",
                                  "trajectory": "body[data-ready='1']"}[name])
            pg.wait_for_timeout(300)
            assert _names_missing(pg) == [], (name, size)
            assert "Asia/Shanghai" in pg.inner_text("#zone")  # the viewer's zone, not the server's
            overflow = pg.evaluate("document.scrollingElement.scrollWidth - window.innerWidth")
            assert overflow <= 1, (name, size, overflow)  # nothing wider than the window
            if shots:
                Path(shots).mkdir(parents=True, exist_ok=True)
                pg.screenshot(path=f"{shots}/dashboard-{name}-{size}.png", full_page=size == "desktop")
        context.close()
    assert dash.http.post(f"/v1/tasks/{running}/cancel").status_code == 200  # also kills its command
    wait_until(lambda: task(dash, running)["state"] == "CANCELLED", 30, "the cancel")


@pytest.fixture
def token_server(tmp_path):
    """The task API app (no workers) behind a full token and a read-only one, served by uvicorn in a thread."""
    import threading

    import uvicorn

    from openglm.agent.api import create_app
    from openglm.agent.config import AgentConfig
    from openglm.agent.store.sqlite_store import SQLiteStore

    config = AgentConfig(data_dir=str(tmp_path / "data"))
    store = SQLiteStore(str(tmp_path / "agent.db"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(config, store=store, token="full-secret", view_token="look-only"),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _up(url), 20, "the token server")
    yield url
    server.should_exit = server.force_exit = True  # no waiting for open event streams
    thread.join(10)
    # (the store is left to the garbage collector: the task API's event streams, polling in worker
    # threads, notice a closed client only at their next write)


def _up(url):
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_token_form_and_a_read_only_key_turn_the_controls_off(token_server, page):
    full = {"Authorization": "Bearer full-secret"}
    tid = httpx.post(token_server + "/v1/tasks", json={"objective": "guarded"}, headers=full).json()["task_id"]
    page.goto(token_server + "/ui/")
    page.wait_for_selector("#token-form")  # no token yet: the data answered 401 and the page asks for one
    page.get_by_label("This server needs its bearer token:").fill("look-only")
    page.get_by_role("button", name="Use token").click()
    page.wait_for_selector(f'tr[data-task="{tid}"] .badge.s-QUEUED')
    page.goto(f"{token_server}/ui/task.html?id={tid}")
    page.wait_for_function("document.getElementById('control-msg').textContent.includes('read-only key')")
    for name in ("Pause task", "Resume task", "Cancel task"):
        assert page.get_by_role("button", name=name).is_disabled(), name
    status = page.evaluate(f"fetch('/v1/tasks/{tid}/pause', {{method: 'POST', headers: D.headers()}})"
                           ".then((r) => r.status)")
    assert status == 403 and httpx.get(f"{token_server}/v1/tasks/{tid}", headers=full).json()["state"] == "QUEUED"
    page.goto(f"{token_server}/ui/#token=full-secret")  # a link may carry the key once
    page.wait_for_selector(f'tr[data-task="{tid}"]')
    assert "full-secret" not in page.url  # taken out of the address bar
    page.goto(f"{token_server}/ui/task.html?id={tid}")
    page.wait_for_function("!document.getElementById('btn-pause').disabled")
    page.get_by_role("button", name="Pause task").click()
    page.wait_for_selector('body[data-state="PAUSED"]')
    assert httpx.get(f"{token_server}/v1/tasks/{tid}", headers=full).json()["state"] == "PAUSED"
