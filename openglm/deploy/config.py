"""A deployment described once (`DeployConfig`): read from deploy.yaml, or from `openglm serve CHECKPOINT`'s
flags; served by `openglm serve` (under torchrun for tensor/expert parallelism) or handed to vLLM / SGLang
by `openglm deploy`. `engine_config` is the one place an `EngineConfig` is built for serving.

    model: zai-org/GLM-5.1                # checkpoint folder (or a Hugging Face id, for the hand-off)
    family: glm-5.1                       # the hand-off's recipe; default: from the model's name or config.json
    gpu: H200                             # the hand-off checks the weights per GPU against it
    served_model_name: glm-5.1
    host: 0.0.0.0
    port: 8000
    parallel_config: {tensor_parallel: 8, expert_parallel: 8, pipeline_parallel: 1}   # the write-ups' block
    max_model_len: 202752                 # context: prompt + output tokens; null: the model's
    max_num_batched_tokens: 16384         # tokens computed per step (prefill chunk + decodes), not the context
    max_num_seqs: 64
    block_size: 64                        # tokens per KV block
    num_kv_blocks: 2048                   # openglm's pool size (GPU engines size theirs from memory)
    quantization: fp8                     # none | fp8 | int8 | int4 (weight-only)
    dtype: bfloat16                       # or bf16; float32 / fp32, float16 / fp16
    device: cpu                           # cpu | cuda | cuda:N (openglm's engine on one process; docs/gpu.md)
    session_cache: {enabled: true, ttl_s: 600}   # prefix cache across turns, idle blocks kept ttl_s seconds
    speculative: {method: mtp, num_speculative_tokens: 1}   # GLM's MTP layer (openglm: one process only)
    default_chat_template_kwargs: {enable_thinking: false}   # what a chat request leaves unset (vLLM's flag)
    thinking_token_budget: 2048           # reasoning tokens before </think> is forced, unless a request says
    tool_call_parser: glm47               # default: the family's recipe
    reasoning_parser: glm45
    tokenizer: null                       # a folder with tokenizer.json when `model` has none (null: the model's)

Every key is optional except `model`; an unknown key or a wrong type is an error naming it. The engine-tuning
keys (batched tokens, sequences, block size, KV blocks, dtype) left out mean each engine's own default:
openglm's CPU engine takes OPENGLM_DEFAULTS, a GPU hand-off leaves them to vLLM / SGLang (the dtype: bfloat16,
the GLM checkpoints' own), so a minimal deploy.yaml never hands CPU settings to a GPU engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from openglm.deploy.recipes import RECIPES, gpu_memory_gb
from openglm.engine.config import DEVICE, EngineConfig
from openglm.util.dtypes import dtype_name

if TYPE_CHECKING:
    from openglm.model.parallel import ParallelLayout

# openglm's own engine, for the engine-tuning keys a deployment leaves out (None)
OPENGLM_DEFAULTS = {"max_num_batched_tokens": 2048, "max_num_seqs": 32, "block_size": 16, "num_kv_blocks": 2048,
                    "dtype": "float32"}


class DeployConfigError(ValueError):
    """deploy.yaml is missing, unreadable, or holds a key or value openglm does not know."""


TEMPLATE_SWITCHES = ("enable_thinking", "clear_thinking")  # the chat-template kwargs openglm honours (GLM's)


def check_template_kwargs(value) -> dict | None:
    """`default_chat_template_kwargs` as given (a mapping of GLM's switches to true/false), or the reason not."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise DeployConfigError(f"default_chat_template_kwargs must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(TEMPLATE_SWITCHES))
    if unknown:
        raise DeployConfigError(f"default_chat_template_kwargs: unknown key(s) {unknown} "
                                f"(known: {list(TEMPLATE_SWITCHES)})")
    bad = [k for k, v in value.items() if not isinstance(v, bool)]
    if bad:
        raise DeployConfigError(f"default_chat_template_kwargs: {bad[0]} must be true or false, got {value[bad[0]]!r}")
    return dict(value)


@dataclass(frozen=True)
class SessionCache:
    enabled: bool = True
    ttl_s: float = 600.0


@dataclass(frozen=True)
class Speculative:
    method: str = "mtp"  # the only draft GLM-5 ships: its multi-token-prediction layer
    num_speculative_tokens: int = 1

    def __post_init__(self):
        if self.method != "mtp":
            raise DeployConfigError(f"speculative.method={self.method!r}: only 'mtp' (GLM's own draft layer) is mapped")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise DeployConfigError("speculative.num_speculative_tokens must be a positive integer")


@dataclass(frozen=True)
class DeployConfig:
    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    parallel_config: ParallelLayout = field(default_factory=lambda: _layout())
    max_num_batched_tokens: int | None = None  # None: the engine's own (OPENGLM_DEFAULTS for openglm serve)
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    num_kv_blocks: int | None = None
    quantization: str | None = None
    dtype: str | None = None
    device: str = "cpu"
    session_cache: SessionCache = field(default_factory=SessionCache)
    speculative: Speculative | None = None
    tool_call_parser: str | None = None  # None: the family's recipe (hand-off only)
    reasoning_parser: str | None = None
    json_whitespace: str = "compact"  # between the JSON tokens of constrained output: none, or any run of it
    tokenizer: str | None = None  # folder with tokenizer.json + chat template when `model` lacks them (None: model's)
    family: str | None = None  # a GLM family of deploy.recipes; None: found from the model
    gpu: str | None = None  # the GPU the hand-off's layout must fit: H200, B200, ... or "96GB"
    default_chat_template_kwargs: dict | None = None  # GLM's template switches where a request sets none
    thinking_token_budget: int | None = None  # reasoning tokens before </think> is forced (server/thinking.py)

    def __post_init__(self):
        if not isinstance(self.port, int) or isinstance(self.port, bool) or self.port <= 0:
            raise DeployConfigError(f"port must be a positive integer, got {self.port!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise DeployConfigError(f"{name} must be a positive integer (or left out), got {value!r}")
        if self.quantization not in (None, "none", "fp8", "int8", "int4"):
            raise DeployConfigError(f"quantization must be none, fp8, int8 or int4, got {self.quantization!r}")
        if self.dtype is not None:
            try:
                object.__setattr__(self, "dtype", dtype_name(self.dtype))  # one name for every spelling (frozen)
            except ValueError as e:
                raise DeployConfigError(str(e)) from None
        if self.json_whitespace not in ("compact", "flexible"):
            raise DeployConfigError(f"json_whitespace must be compact or flexible, got {self.json_whitespace!r}")
        check_template_kwargs(self.default_chat_template_kwargs)
        budget = self.thinking_token_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise DeployConfigError(f"thinking_token_budget must be a non-negative integer or null, got {budget!r}")
        if not isinstance(self.device, str) or not DEVICE.fullmatch(self.device):
            raise DeployConfigError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.family is not None and self.family not in RECIPES:
            raise DeployConfigError(f"family {self.family!r} is not one openglm has a recipe for "
                                    f"({', '.join(RECIPES)})")
        if self.gpu is not None:
            try:
                gpu_memory_gb(str(self.gpu))
            except ValueError as e:
                raise DeployConfigError(str(e)) from None

    @property
    def layout(self) -> ParallelLayout:
        return self.parallel_config

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def own(self, name: str):
        """A tuning key as openglm's engine runs it: the deployment's value, else OPENGLM_DEFAULTS."""
        value = getattr(self, name)
        return OPENGLM_DEFAULTS[name] if value is None else value


def _layout(**degrees) -> ParallelLayout:
    # openglm.model.parallel imports torch: loaded when a deployment is made, so every `openglm` command (the
    # CLI registers `serve` and `deploy` at start) does not pay for it
    from openglm.model.parallel import ParallelLayout

    return ParallelLayout.from_dict(degrees)


def _nested(cls, key: str, value):
    if value is None:
        return None
    if not isinstance(value, dict):
        raise DeployConfigError(f"{key} must be a mapping, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise DeployConfigError(f"{key}: unknown key(s) {unknown} (known: {sorted(known)})")
    return cls(**value)


def parse_deploy_config(data) -> DeployConfig:
    if not isinstance(data, dict):
        raise DeployConfigError("deploy config must be a mapping of keys to values")
    known = {f.name for f in fields(DeployConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise DeployConfigError(f"unknown key(s) {unknown} (known: {sorted(known)})")
    if not data.get("model"):
        raise DeployConfigError("`model` is required: the checkpoint folder (or model id) to serve")
    values = dict(data)
    if "parallel_config" in values:
        pc = values["parallel_config"]
        if not isinstance(pc, dict):
            raise DeployConfigError("parallel_config must be a mapping, e.g. {tensor_parallel: 4, expert_parallel: 2}")
        values["parallel_config"] = _layout(**pc)
    values["session_cache"] = _nested(SessionCache, "session_cache", values.get("session_cache")) or SessionCache()
    values["speculative"] = _nested(Speculative, "speculative", values.get("speculative"))
    if values.get("quantization") == "none":
        values["quantization"] = None
    values["model"] = str(values["model"])
    if values.get("gpu") is not None:  # `gpu: 96GB` is a string, but YAML reads a bare number as one
        values["gpu"] = str(values["gpu"])
    try:
        return DeployConfig(**values)
    except TypeError as e:
        raise DeployConfigError(str(e)) from None


def load_deploy_config(path: str | Path) -> DeployConfig:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise DeployConfigError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise DeployConfigError(f"{path} is not valid YAML: {e}") from None
    cfg = parse_deploy_config(data)
    for key in ("model", "tokenizer"):
        value = getattr(cfg, key)
        if value is not None and not Path(value).is_absolute() and (Path(path).parent / value).exists():
            cfg = dataclasses.replace(cfg, **{key: str(Path(path).parent / value)})  # relative to the config file
    return cfg


def engine_config(cfg: DeployConfig, world: int = 1) -> EngineConfig:
    """The engine a deployment runs on `world` processes. Tensor-parallel ranks replay the main model's steps
    only, so speculative (MTP) decoding runs on one process alone (`unused_fields` says so)."""
    spec = cfg.speculative.num_speculative_tokens if cfg.speculative is not None and world == 1 else 0
    return EngineConfig(block_size=cfg.own("block_size"), num_kv_blocks=cfg.own("num_kv_blocks"),
                        max_num_seqs=cfg.own("max_num_seqs"), max_num_batched_tokens=cfg.own("max_num_batched_tokens"),
                        max_model_len=cfg.max_model_len, enable_prefix_caching=cfg.session_cache.enabled,
                        session_ttl=cfg.session_cache.ttl_s, quantization=cfg.quantization, dtype=cfg.own("dtype"),
                        num_speculative_tokens=spec, device=cfg.device)


def unused_fields(cfg: DeployConfig, world: int = 1) -> list[str]:
    """Fields that the hand-off engines use and openglm's own engine does not here (said once at start)."""
    notes = []
    if cfg.speculative is not None and world > 1:
        notes.append("speculative (MTP) decoding runs in a single-process openglm engine; the tensor-parallel "
                     "ranks decode one token a step")
    if cfg.tool_call_parser or cfg.reasoning_parser:
        notes.append("tool_call_parser / reasoning_parser name the vLLM/SGLang parsers; openglm serve renders "
                     "GLM tool calls and reasoning with its own chat template")
    if cfg.family or cfg.gpu:
        notes.append("family / gpu describe the GPU hand-off (openglm deploy); openglm serve does not use them")
    return notes
