"""The live task dashboard and trajectory viewer served by `openglm agent-server` (docs/agent.md).

    from openglm.agent.dashboard import mount
    mount(app, store, config)   # pages at /ui/, data at /v1/dash/...
"""

from openglm.agent.dashboard.routes import mount

__all__ = ["mount"]
