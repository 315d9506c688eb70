"""Real processes and a real HTTP server for the resilience tests."""

from __future__ import annotations

import http.server
import json
import sys
import threading
import time

from testutil import free_port

MB = 1024 * 1024

# A child that really leaks: it keeps `rate_mb_s` MB per second alive (written, so resident),
# doing numbered "steps" it records in a progress file; restarted, it resumes after the last one.
LEAKER = r"""
import os, sys, time
rate, progress, total = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
done = [int(x) for x in open(progress).read().split()] if os.path.exists(progress) else []
held, step = [], (done[-1] + 1 if done else 0)
while step < total:
    held.append(b"\x01" * int(rate * 1024 * 1024 / 10))
    time.sleep(0.1)
    with open(progress, "a") as f:
        f.write(f"{step}\n")
    step += 1
time.sleep(60)
"""

# A steady child with noisy allocations: up to `peak_mb` allocated and freed again, no drift.
NOISY = r"""
import random, sys, time
peak = float(sys.argv[1]); random.seed(0)
while True:
    blob = b"\x01" * int(random.uniform(0, peak) * 1024 * 1024)
    time.sleep(random.uniform(0.02, 0.15))
    del blob
    time.sleep(random.uniform(0.0, 0.1))
"""

# A CPU hog: `n` busy processes.
HOG = r"""
import multiprocessing, sys
def spin():
    while True:
        pass
if __name__ == "__main__":
    procs = [multiprocessing.Process(target=spin) for _ in range(int(sys.argv[1]))]
    for p in procs: p.start()
    for p in procs: p.join()
"""

IDLE = "import time; time.sleep(120)"


def py(code: str, *args) -> list[str]:
    return [sys.executable, "-c", code, *map(str, args)]


class FaultServer:
    """An OpenAI-ish HTTP endpoint whose answers are scripted: a queue of faults, then `default`.

    Faults: "500", "429", "hang" (sleeps past the client's timeout), "ok"; they apply to POSTs.
    """

    def __init__(self, faults=(), default="ok", reply="done", hang_s=2.0):
        self.faults, self.default, self.reply, self.hang_s = list(faults), default, reply, hang_s
        self.requests = 0  # POSTs (model calls)
        self.probes = 0  # GETs (reachability probes): answered by `probe_fault`
        self.probe_fault = "ok"
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self):
                with server.lock:
                    if self.command == "GET":  # the monitor's reachability probe
                        server.probes += 1
                        fault = server.probe_fault
                    else:
                        server.requests += 1
                        fault = server.faults.pop(0) if server.faults else server.default
                if fault == "hang":
                    time.sleep(server.hang_s)
                    fault = "ok"
                if fault in ("500", "429"):
                    body, code = b'{"error": "injected"}', int(fault)
                else:
                    message = (server.reply if isinstance(server.reply, dict)
                               else {"role": "assistant", "content": server.reply})
                    body, code = json.dumps({"choices": [{"message": message}],
                                             "usage": {"prompt_tokens": 10, "completion_tokens": 5},
                                             "data": []}).encode(), 200
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the client gave up (timeout)
                    pass

            do_GET = do_POST = _answer

        self.port = free_port()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
