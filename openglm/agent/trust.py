"""What a task submitted over the API may ask of the server's model set-up.

A per-task model spec is untrusted input: it never carries a key (a key would be stored in the
task record and echoed by `GET /v1/tasks/{id}`): it names an environment variable of the server
instead (`api_key_env`, from the config's allow-list). Its `base_url` must match the server's
allow-list (so no client can make the server send a key, or the task's code, anywhere else), and
a `replay` script must lie in an allowed directory (so no client can make the server read any file).
"""

from __future__ import annotations

import os
from pathlib import Path

from openglm.agent.config import AgentConfig
from openglm.agent.task import ConstraintError

SPEC_KEYS = {"base_url", "model", "api_key_env", "replay", "calls_log", "fallback", "use_tools"}


def _configured(config: AgentConfig) -> dict:
    """The server's own model spec as a dict ({} if none)."""
    spec = config.model
    return {} if spec is None else spec if isinstance(spec, dict) else spec.to_dict()


def allowed_base_urls(config: AgentConfig) -> list[str]:
    urls, spec = list(config.model_base_urls), _configured(config)
    while spec:
        if spec.get("base_url"):
            urls.append(spec["base_url"])
        spec = spec.get("fallback") or {}
    return [u.rstrip("/") for u in urls]


def allowed_replay_dirs(config: AgentConfig) -> list[Path]:
    dirs = [Path(d).resolve() for d in config.replay_dirs]
    if _configured(config).get("replay"):
        dirs.append(Path(_configured(config)["replay"]).resolve().parent)
    return dirs


def check_no_secrets(spec, where: str = "model") -> dict:
    """Every task record, however submitted: an object of known keys, and no key in it."""
    if not isinstance(spec, dict):
        raise ConstraintError(where, f"expected an object, got {type(spec).__name__}")
    if "api_key" in spec:
        raise ConstraintError(f"{where}.api_key", "keys are never stored in task records: name a server-side "
                                                  "environment variable with api_key_env instead")
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise ConstraintError(where, f"unknown key(s): {', '.join(sorted(unknown))}")
    if spec.get("fallback") is not None:
        check_no_secrets(spec["fallback"], f"{where}.fallback")
    return spec


def check_model_spec(config: AgentConfig, spec, where: str = "model") -> dict:
    """A spec from an API client: no secrets, and only the server's allow-listed URLs, key variables
    and replay files; returns it unchanged."""
    check_no_secrets(spec, where)
    for key in ("replay", "calls_log"):  # files the server would read / write
        if key in spec:
            path = Path(str(spec[key])).resolve()
            if not any(path.is_relative_to(d) for d in allowed_replay_dirs(config)):
                raise ConstraintError(f"{where}.{key}", f"the {key} file is outside the server's replay_dirs")
    if "base_url" in spec and "replay" not in spec:
        url = str(spec["base_url"]).rstrip("/")
        if url not in allowed_base_urls(config):
            raise ConstraintError(f"{where}.base_url", f"{url!r} is not in the server's model_base_urls allow-list")
    env = spec.get("api_key_env")
    if env is not None and env not in config.model_key_envs:
        raise ConstraintError(f"{where}.api_key_env", f"must be one of the server's model_key_envs "
                                                      f"({', '.join(config.model_key_envs) or 'none'})")
    if spec.get("fallback") is not None:
        check_model_spec(config, spec["fallback"], f"{where}.fallback")
    return spec


def resolve_model_spec(spec: dict) -> dict:
    """The spec a model is built from: `api_key_env` replaced by the variable's value (in memory only)."""
    out = {k: v for k, v in spec.items() if k not in ("api_key_env", "fallback")}
    if spec.get("api_key_env"):
        out["api_key"] = os.environ.get(spec["api_key_env"])
    if spec.get("fallback"):
        out["fallback"] = resolve_model_spec(spec["fallback"])
    return out


def redact(record: dict) -> dict:
    """A task record for output: any key a legacy record still holds is replaced by a marker."""
    model = (record.get("meta") or {}).get("model")
    if not isinstance(model, dict):
        return record

    def scrub(spec: dict) -> dict:
        spec = {k: ("[redacted]" if k == "api_key" else v) for k, v in spec.items()}
        if isinstance(spec.get("fallback"), dict):
            spec["fallback"] = scrub(spec["fallback"])
        return spec

    return {**record, "meta": {**record["meta"], "model": scrub(model)}}
