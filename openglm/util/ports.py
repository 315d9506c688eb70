"""Default ports shared by a server and its clients (here, not in the client module, so a CLI's --help
can state them without importing httpx)."""

AGENT_PORT = 8100  # the task API: `openglm agent-server`, `openglm task --server`, GLMClient
AGENT_URL = f"http://127.0.0.1:{AGENT_PORT}"
