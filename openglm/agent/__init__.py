"""The durable long-horizon agent runtime.

Modules: `task` (task model, constraints), `store` (SQLite / Redis), `snapshot` (git-based
differential snapshots), `loop` (the write-ahead step protocol), `state` (state rebuilt from the
log), `tools`, `llm` (LLM clients), `hooks` + `policy` (extension points), `worker`, `service`,
`api` (FastAPI), `cli`. See docs/agent.md.
"""
