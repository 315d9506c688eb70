"""Run by test_dashboard_offline.py inside a network namespace with only loopback (`unshare -rn`):
an agent-server, a finished task, every dashboard page and the exported file in Chromium; prints
the browser's request log and what a connection off the machine got, as JSON."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]
from agent_testkit import AgentServer, call, turn, write_script  # noqa: E402
from browser import WIDE, RequestLog, launch  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402
from testutil import free_port  # noqa: E402


def outside_reachable() -> str:
    try:
        socket.create_connection(("1.1.1.1", 443), timeout=2).close()
        return "connected"
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def main(tmp: Path) -> dict:
    script = write_script(tmp / "turns.jsonl", [turn(call("bash", command="echo offline > out.txt && cat out.txt")),
                                                turn(call("submit", summary="done"))])
    srv = AgentServer(tmp, free_port(), script).wait_ready()
    try:
        tid = httpx.post(srv.url + "/v1/tasks", json={"objective": "offline check"}).json()["task_id"]
        deadline = time.monotonic() + 60
        while httpx.get(f"{srv.url}/v1/tasks/{tid}").json()["state"] != "SUCCEEDED":
            assert time.monotonic() < deadline, "task did not finish"
            time.sleep(0.2)
        export = tmp / "export.html"
        subprocess.run([sys.executable, "-m", "openglm.agent", "task", "export-html", tid, "--out", str(export),
                        "--server", srv.url], check=True, capture_output=True)
        with sync_playwright() as p:
            browser = launch(p)
            context = browser.new_context(viewport=WIDE)
            log = RequestLog(context)
            page = context.new_page()
            page.goto(srv.url + "/")  # redirects to /ui/
            page.wait_for_selector(f'tr[data-task="{tid}"]')
            page.goto(f"{srv.url}/ui/task.html?id={tid}")
            page.wait_for_selector('#timeline tr[data-step="1"]')
            page.wait_for_function("document.getElementById('live-output').textContent.includes('offline')")
            page.goto(f"{srv.url}/ui/trajectory.html?id={tid}")
            page.wait_for_selector("body[data-ready='1']")
            page.goto(export.as_uri())
            page.wait_for_selector("body[data-ready='1']")
            browser.close()
        return {"urls": log.urls, "server": srv.url, "outside": outside_reachable(), "export": export.as_uri()}
    finally:
        srv.stop()


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
