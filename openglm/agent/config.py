"""Configuration of the agent runtime (server and workers), a typed dataclass loadable from JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from openglm.agent.llm import ModelSpec
from openglm.agent.snapshot import DEFAULT_IGNORE
from openglm.util.sandbox import SandboxConfig
from openglm.util.strict import check_keys

# Where a task submitted over the API may clone a repository from, unless the config says otherwise.
DEFAULT_CLONE_HOSTS = ["github.com", "gitlab.com", "bitbucket.org", "codeberg.org"]


@dataclass
class AgentConfig:
    data_dir: str = "runs/agent"  # snapshots, cloned / created workspaces
    store: str = ""  # '' -> sqlite at <data_dir>/agent.db; or 'redis://host:port/0'
    # a task without its own model uses this one; JSON: {"replay": path} | {"base_url", "model", "api_key", "fallback"}
    model: ModelSpec | None = None
    lease_ttl: float = 15.0  # a worker silent this long loses its task to another worker
    poll_interval: float = 0.5
    ignore: list[str] = field(default_factory=lambda: list(DEFAULT_IGNORE))
    policy: str = ""  # 'package.module:factory' returning a Policy; '' -> ToolCallingPolicy
    policy_config: dict = field(default_factory=dict)  # settings the policy factory reads (e.g. SWEPolicyConfig's)
    hooks: list[str] = field(default_factory=list)  # 'package.module:factory' returning Hooks
    resilience: dict = field(default_factory=dict)  # settings of openglm.agent.resilience (docs/resilience.md)
    context_limit: int = 100_000  # tokens; older observations are condensed near it
    max_output: int = 20_000  # characters of tool output kept (head + tail)
    # what a per-task model spec may use (openglm/agent/trust.py); `model`'s own URL / replay dir are allowed too
    model_base_urls: list[str] = field(default_factory=list)
    replay_dirs: list[str] = field(default_factory=list)
    model_key_envs: list[str] = field(default_factory=lambda: ["OPENGLM_MODEL_API_KEY"])
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # how tasks' commands are confined
    # what an API client may name: a `workspace` under the data dir or one of these roots (--workspace-root);
    # a `repo` that is such a local path, or an https URL on one of `clone_hosts`
    workspace_roots: list[str] = field(default_factory=list)
    clone_hosts: list[str] = field(default_factory=lambda: list(DEFAULT_CLONE_HOSTS))
    clone_timeout_s: float = 300.0  # a worker's `git clone` of a task's repo gives up after this
    public_names: list[str] = field(default_factory=list)  # Host names the API answers besides loopback's

    def __post_init__(self):
        if isinstance(self.model, dict):
            self.model = ModelSpec.from_dict(self.model) if self.model else None
        if isinstance(self.sandbox, dict):
            self.sandbox = SandboxConfig.from_dict(self.sandbox)

    @property
    def store_url(self) -> str:
        return self.store or str(Path(self.data_dir) / "agent.db")

    def task_dir(self, task_id: str) -> Path:
        """A task's own folder: its snapshots (snapshots.git) and the running command's record."""
        return Path(self.data_dir) / "tasks" / task_id

    @classmethod
    def load(cls, path: str | None = None, **overrides) -> "AgentConfig":
        raw = json.loads(Path(path).read_text()) if path else {}
        check_keys(raw, cls, f"key(s) of the agent config {path}")
        raw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**raw)

    def to_dict(self) -> dict:
        return asdict(self)
