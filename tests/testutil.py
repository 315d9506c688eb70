"""Helpers shared by test folders (on sys.path through pytest's `pythonpath = ["tests"]`)."""

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed (or reset) this client socket: read without waiting."""
    s.settimeout(0.01)
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def serve_in_thread(app):
    """Serve an ASGI app with uvicorn on a free loopback port in a daemon thread: (base URL, stop)."""
    import threading
    import time

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)

    def stop():
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{port}", stop


def run_requests(engine, requests) -> list:
    """Add (prompt, SamplingParams) pairs to an LLMEngine, step it until all finish, outputs in order."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def wait_healthy(url: str, proc=None, timeout: float = 90.0) -> None:
    """Wait until `url`/health answers 200; fail early when the server process `proc` has exited."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"server exited early:\n{out}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy in {timeout}s")


def openglm_serve(checkpoint, *args: str, env: dict | None = None):
    """Context manager: `openglm serve CHECKPOINT --port P ARGS` (the real CLI, a subprocess) on a free
    port, healthy; yields its base URL and stops it on exit."""
    import contextlib
    import os
    import subprocess
    import sys

    @contextlib.contextmanager
    def run():
        port = free_port()
        cmd = [sys.executable, "-m", "openglm", "serve", str(checkpoint), "--port", str(port), *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env or {**os.environ, "OMP_NUM_THREADS": "1"})
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()

    return run()


def kernels_at_every_dispatch(monkeypatch) -> dict:
    """Counts the calls of the model's CUDA dispatch points (`openglm.model.gpu`). Without CUDA they take CPU
    tensors to the Triton kernels too (run by Triton's interpreter) and the C decode step is off. Returns the
    calls per dispatch function, filled as the test runs."""
    import torch

    from openglm.model import gpu

    if not torch.cuda.is_available():
        monkeypatch.setattr(gpu, "kernel_device", lambda t: True)
        monkeypatch.setattr("openglm.model.glm5.decode_step.DecodePlan.create", lambda *a, **k: None)
    calls = {}
    for name in ("experts_forward", "dsa_attention", "gather_attention"):
        def counted(*args, _fn=getattr(gpu, name), _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(gpu, name, counted)
    return calls
