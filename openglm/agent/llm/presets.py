"""Named model endpoints for `--model NAME` without `--model-url` (data, not code)."""

from __future__ import annotations

# Z.ai's hosted GLM-5.1 behind its OpenAI-compatible API. The key is read from the environment
# variable named here; `context_window` is the provider's documented window (its /models does not
# report one), used to fit the conversation.
MODEL_PRESETS: dict[str, dict] = {
    "zai-glm-5.1": {"base_url": "https://api.z.ai/api/paas/v4", "model": "glm-5.1", "api_key_env": "ZAI_API_KEY",
                    "context_window": 200_000, "max_tokens": 8192},
}


def preset_spec(name: str, environ) -> dict | None:
    """The model spec of preset `name` (the API key filled in from the environment), or None."""
    preset = MODEL_PRESETS.get(name)
    if preset is None:
        return None
    spec = {k: v for k, v in preset.items() if k != "api_key_env"}
    spec["api_key"] = environ.get(preset["api_key_env"])
    return spec
