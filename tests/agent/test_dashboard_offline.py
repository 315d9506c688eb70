"""No dashboard page, route or asset fetches anything off the machine: the server and the browser run
in a network namespace that has only loopback, and the browser's request log is checked."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

RUN = Path(__file__).with_name("dashboard_offline_run.py")


def test_dashboard_with_networking_blocked_requests_only_its_own_server(tmp_path):
    assert shutil.which("unshare") and shutil.which("ip"), "util-linux unshare and iproute2 ip are needed"
    cmd = f"ip link set lo up && exec {sys.executable} {RUN} {tmp_path}"
    p = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "sh", "-c", cmd],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["outside"] != "connected"  # the namespace really has no way out
    own = (result["server"] + "/", result["export"])
    assert len(result["urls"]) >= 10  # pages, scripts, stylesheet, data and streams were all requested
    assert [u for u in result["urls"] if not u.startswith(own)] == []
    assert any("/v1/dash/tasks/" in u and "/output" in u for u in result["urls"])
