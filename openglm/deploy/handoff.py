"""The hand-off to GPU serving engines: a deploy.yaml as the equivalent vLLM or SGLang launch.

`launch_command` returns (argv, notes): the command line, and the lines `openglm deploy` prints to stderr
("note: ..." for what the engine expresses differently, "warning: ..." for what would go wrong). What the
line is made of, per model family (`recipes.py`): the published FP8 checkpoint when `quantization: fp8`
names one, the recipe's tool-call / reasoning parsers and chat-template content format, GPU dtypes (the
CPU engine's defaults never leak in), the per-step token budget apart from the context length, and the
layout's weights per GPU against the GPU the deployment names (`fit.py`). The flag names are those of the
engines' own argument parsers (tests/deploy/test_deploy.py records the versions they were read from).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from openglm.deploy.config import DeployConfig
from openglm.deploy.fit import Split, budget_gib, check_fit, preset_split, suggest_layout
from openglm.deploy.recipes import GPUS, GlmRecipe, checkpoint_quantization, find_family, gpu_memory_gb
from openglm.model.config import ModelConfig
from openglm.model.errors import ModelError
from openglm.model.parallel import LayoutError, ParallelLayout, check_serving_layout

ENGINES = ("vllm", "sglang")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
# The GLM parser names each engine accepts: vLLM's tool-parser and reasoning-parser registries, SGLang's
# --tool-call-parser / --reasoning-parser choices.
PARSERS = {"vllm": {"tool_call_parser": ("glm45", "glm47"), "reasoning_parser": ("glm45", "glm47")},
           "sglang": {"tool_call_parser": ("glm", "glm45", "glm47"), "reasoning_parser": ("glm45",)}}
GPU_DTYPE = "bfloat16"  # the GLM checkpoints' dtype (and the FP8 ones' unquantised parts)
STEP_TOKENS_RECIPES = (8192, 32768)  # the per-step token budgets the engines' GLM recipes use
STEP_TOKENS_WARN = 65536  # a budget above this is almost surely a context length put in the wrong key
BYTES = {"fp8": 1, "bfloat16": 2, "float16": 2, "float32": 4}
REFERENCE_GPU = "H200"  # the GPU the engines' GLM recipes are written for: a layout is suggested for it


class HandoffError(ValueError):
    """A deploy.yaml field the chosen engine cannot express."""


@dataclass
class Plan:
    """What both engines' lines are made of: the checkpoint, its quantisation, parsers, dtype."""

    model: str
    online_fp8: bool  # the engine quantises BF16 weights on load (--quantization fp8)
    weights: str  # "fp8" or the dtype the weights are served in
    recipe: GlmRecipe | None
    tool_call_parser: str | None
    reasoning_parser: str | None
    dtype: str
    notes: list[str] = field(default_factory=list)


def _checkpoint(cfg: DeployConfig, recipe: GlmRecipe | None, notes: list[str]) -> tuple[str, bool, bool]:
    """(model to serve, quantise online, weights are FP8)."""
    if cfg.quantization in ("int8", "int4"):
        raise HandoffError(f"quantization {cfg.quantization} (weight-only, openglm's CPU kernels) has no vLLM or "
                           "SGLang equivalent for an unquantised checkpoint; use fp8, or a checkpoint quantised for it "
                           "(e.g. compressed-tensors)")
    local_fp8 = checkpoint_quantization(cfg.model) == "fp8" if Path(cfg.model).is_dir() else False
    published_fp8 = recipe is not None and cfg.model.lower() == (recipe.fp8_repo or "").lower()
    if local_fp8 or published_fp8:
        if cfg.quantization is None:
            notes.append(f"note: {cfg.model} is an FP8 checkpoint: served in FP8 (the engine reads its "
                         "quantization_config)")
        return cfg.model, False, True
    if cfg.quantization != "fp8":
        return cfg.model, False, False
    if recipe is not None and recipe.fp8_repo is not None and not Path(cfg.model).is_dir():
        notes.append(f"note: quantization fp8: serving {recipe.fp8_repo}, the FP8 checkpoint Z.ai publishes for "
                     f"{recipe.title} (block-quantised), not {cfg.model} quantised on load")
        return recipe.fp8_repo, False, True
    why = f"no FP8 checkpoint is published for {recipe.title}" if recipe is not None else f"{cfg.model} is not FP8"
    notes.append(f"note: quantization fp8: {why}; the engine quantises its BF16 weights on load (--quantization "
                 "fp8, per-tensor scales)")
    return cfg.model, True, True


def _parser(cfg: DeployConfig, recipe: GlmRecipe | None, engine: str, key: str, notes: list[str]) -> str | None:
    chosen, recommended = getattr(cfg, key), getattr(recipe, key) if recipe is not None else None
    if chosen is None:
        return recommended
    known = PARSERS[engine][key]
    if chosen not in known:
        raise HandoffError(f"{key} {chosen!r}: {ENGINE_NAMES[engine]} has no GLM parser of that name "
                           f"({', '.join(known)})")
    if recommended is not None and chosen != recommended:
        why = " (GLM-4.7 and later write tool calls in the format glm47 parses)" if recommended == "glm47" else ""
        notes.append(f"warning: {key} {chosen}: the engines' {recipe.title} recipes use {recommended}{why}; leave "
                     "the key out to use the recipe's")
    return chosen


def _step_tokens_notes(cfg: DeployConfig) -> list[str]:
    n = cfg.max_num_batched_tokens
    if n is None or n <= STEP_TOKENS_WARN:
        return []
    low, high = STEP_TOKENS_RECIPES
    return [f"warning: max_num_batched_tokens={n} is the tokens one scheduler step computes (a prefill chunk plus "
            f"the running decodes), not the context length: the engines' GLM recipes use {low}-{high} (more buys "
            "prefill throughput with activation memory and latency); the context length is max_model_len"]


def plan(cfg: DeployConfig) -> tuple[Plan, str | None]:
    """The engine-independent part of a hand-off; also returns the preset of the family (memory check)."""
    match = find_family(cfg.model, cfg.family)
    notes = [f"note: model family: {match.how}" if match.recipe else f"warning: {match.how}"]
    model, online, fp8 = _checkpoint(cfg, match.recipe, notes)
    dtype = cfg.dtype or GPU_DTYPE
    if cfg.dtype == "float32":
        notes.append("warning: dtype float32 on GPUs doubles the weight memory of the BF16 GLM checkpoints and "
                     "runs on slower kernels; leave dtype out (bfloat16) unless you mean it")
    notes += _step_tokens_notes(cfg)
    p = Plan(model, online, "fp8" if fp8 else dtype, match.recipe, None, None, dtype, notes)
    return p, (match.recipe.preset if match.recipe else None)


def _model_shape(cfg: DeployConfig, preset: str | None):
    """(ModelConfig, its Split, how `openglm info` names it) of the served model: a local checkpoint's
    config.json, else the family's preset; None when neither is known. Raises what reading the config raises."""
    from openglm.model.checkpoint import read_config  # safetensors underneath: `openglm --help` stays fast

    if Path(cfg.model).is_dir():
        model_cfg = read_config(cfg.model)
        return model_cfg, Split.of(model_cfg), f"--checkpoint {cfg.model}"
    if preset is not None:
        return ModelConfig.from_preset(preset), preset_split(preset), f"--preset {preset}"
    return None


def _memory_notes(cfg: DeployConfig, p: Plan, engine: str, preset: str | None) -> list[str]:
    """Weights per GPU for this layout as the engine shards it; a warning and a layout when it does not fit."""
    try:
        shape = _model_shape(cfg, preset)
    except (ModelError, ValueError, KeyError, TypeError, NotImplementedError) as e:
        return [f"note: no per-GPU memory estimate for {cfg.model}: {e}"]
    if shape is None:
        return []
    (model_cfg, split, source), lay, notes = shape, cfg.layout, []
    try:  # both engines split the attention heads and dense MLP widths tp ways, as openglm's serving does
        check_serving_layout(ParallelLayout(tp=lay.tp), model_cfg)
    except LayoutError as e:
        notes.append(f"warning: {e}: {ENGINE_NAMES[engine]} will refuse this tensor_parallel")
    experts = lay.tp * lay.dp if engine == "vllm" and lay.ep > 1 else lay.tp
    label = f"openglm info {source} --parallel tp={lay.tp},ep={experts}" + (
        f", over {lay.pp} pipeline stages" if lay.pp > 1 else "")
    weights = f"{'FP8' if p.weights == 'fp8' else p.weights} weights"
    return notes + _fit_notes(cfg, split, model_cfg, experts, BYTES[p.weights], f"{weights} per GPU ({label})")


def _fit_notes(cfg: DeployConfig, split: Split, model_cfg: ModelConfig, experts: int, bytes_per_param: float,
               what: str) -> list[str]:
    """The layout's weights per GPU against the GPU deploy.yaml names (or, unnamed, against the largest)."""
    lay = cfg.layout
    if cfg.gpu is None:
        gib = split.per_gpu(lay.tp, experts, lay.pp) * bytes_per_param / 2**30
        largest = max(GPUS, key=GPUS.get)
        if gib <= budget_gib(GPUS[largest]):
            return [f"note: {gib:,.1f} GiB of {what}; name the GPU (gpu: H200 in deploy.yaml, or --gpu) to check "
                    "that the layout fits"]
        hint = suggest_layout(split, model_cfg, bytes_per_param, GPUS[REFERENCE_GPU])
        return [f"warning: {gib:,.1f} GiB of {what} fits no GPU (the largest openglm knows, {largest}, has "
                f"{GPUS[largest]} GB)" + (f"; on {REFERENCE_GPU}s: {hint}" if hint else "")]
    gb = gpu_memory_gb(cfg.gpu)
    fit = check_fit(split, model_cfg, lay.tp, experts, lay.pp, bytes_per_param, gb)
    head = f"layout {lay} on {cfg.gpu} ({gb:g} GB): {fit.gib_per_gpu:,.1f} GiB of {what}"
    budget = f"{fit.budget_gib:,.1f} GiB budget (90% of the GPU)"
    suggestion = f"; suggested: {fit.suggestion}" if fit.suggestion else ""
    if not fit.fits:
        return [f"warning: {head} does not fit its {budget}, before any KV cache"
                f"{suggestion or '; no layout up to 64 GPUs fits'}"]
    left = fit.budget_gib - fit.gib_per_gpu
    if fit.tight:
        return [f"warning: {head} leaves {left:,.1f} GiB of its {budget} for the KV cache{suggestion}"]
    return [f"note: {head}, {left:,.1f} GiB of its {budget} left for the KV cache"]


def _common_notes(cfg: DeployConfig, engine: str) -> list[str]:
    name = ENGINE_NAMES[engine]
    notes = []
    if cfg.num_kv_blocks is not None:
        notes.append(f"note: num_kv_blocks={cfg.num_kv_blocks} is openglm's pool size; {name} sizes its KV cache "
                     "from free GPU memory")
    if cfg.thinking_token_budget is not None:
        notes.append(f"note: thinking_token_budget={cfg.thinking_token_budget} is openglm's server-wide default; "
                     f"{name} takes a thinking budget per request only")
    if cfg.session_cache.enabled:
        notes.append(f"note: session_cache.ttl_s={cfg.session_cache.ttl_s:g}: {name} keeps cached prefixes until "
                     "memory is needed (LRU), with no idle timeout")
    return notes


def vllm_command(cfg: DeployConfig, p: Plan, notes: list[str]) -> list[str]:
    lay = cfg.layout
    argv = ["vllm", "serve", p.model, "--served-model-name", cfg.name, "--host", cfg.host, "--port", str(cfg.port),
            "--tensor-parallel-size", str(lay.tp), "--pipeline-parallel-size", str(lay.pp)]
    if lay.dp > 1:
        argv += ["--data-parallel-size", str(lay.dp)]
    if lay.ep > 1:
        argv.append("--enable-expert-parallel")
        if lay.ep != lay.tp * lay.dp:
            notes.append(f"note: expert_parallel={lay.ep}: vLLM shards the experts over all tensor x data parallel "
                         f"ranks (EP = {lay.tp * lay.dp} here), not over a separate group")
    for flag, value in (("--max-model-len", cfg.max_model_len), ("--max-num-batched-tokens",
                        cfg.max_num_batched_tokens), ("--max-num-seqs", cfg.max_num_seqs),
                        ("--block-size", cfg.block_size)):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--dtype", p.dtype]
    if p.online_fp8:
        argv += ["--quantization", "fp8"]
    argv.append("--enable-prefix-caching" if cfg.session_cache.enabled else "--no-enable-prefix-caching")
    if cfg.speculative is not None:
        spec = {"method": "mtp", "num_speculative_tokens": cfg.speculative.num_speculative_tokens}
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if p.tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", p.tool_call_parser]
    if p.reasoning_parser:
        argv += ["--reasoning-parser", p.reasoning_parser]
    if p.recipe is not None and p.recipe.content_format:
        argv += ["--chat-template-content-format", p.recipe.content_format]
    if cfg.default_chat_template_kwargs:
        argv += ["--default-chat-template-kwargs", json.dumps(cfg.default_chat_template_kwargs, separators=(",", ":"))]
    return argv


def sglang_command(cfg: DeployConfig, p: Plan, notes: list[str]) -> list[str]:
    lay = cfg.layout
    argv = ["python", "-m", "sglang.launch_server", "--model-path", p.model, "--served-model-name", cfg.name,
            "--host", cfg.host, "--port", str(cfg.port), "--tp-size", str(lay.tp), "--pp-size", str(lay.pp)]
    if lay.dp > 1:
        argv += ["--dp-size", str(lay.dp)]
    if lay.ep > 1:
        argv += ["--ep-size", str(lay.ep)]
    # SGLang's chunked-prefill size is the per-step token budget of a prefill batch
    for flag, value in (("--context-length", cfg.max_model_len), ("--chunked-prefill-size",
                        cfg.max_num_batched_tokens), ("--max-running-requests", cfg.max_num_seqs),
                        ("--page-size", cfg.block_size)):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--dtype", p.dtype]
    if p.online_fp8:
        argv += ["--quantization", "fp8"]
    if not cfg.session_cache.enabled:
        argv.append("--disable-radix-cache")
    if cfg.speculative is not None:  # SGLang runs GLM's MTP layer as an EAGLE-style draft (NEXTN is an alias)
        n = cfg.speculative.num_speculative_tokens
        argv += ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(n), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(n + 1)]
    if p.tool_call_parser:
        argv += ["--tool-call-parser", p.tool_call_parser]
    if p.reasoning_parser:
        argv += ["--reasoning-parser", p.reasoning_parser]
    if cfg.default_chat_template_kwargs:
        notes.append(f"note: default_chat_template_kwargs={cfg.default_chat_template_kwargs}: SGLang has no "
                     "server-wide default; send chat_template_kwargs with each request")
    return argv


def launch_command(cfg: DeployConfig, engine: str) -> tuple[list[str], list[str]]:
    if engine not in ENGINES:
        raise HandoffError(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
    p, preset = plan(cfg)
    notes = p.notes
    p.tool_call_parser = _parser(cfg, p.recipe, engine, "tool_call_parser", notes)
    p.reasoning_parser = _parser(cfg, p.recipe, engine, "reasoning_parser", notes)
    argv = (vllm_command if engine == "vllm" else sglang_command)(cfg, p, notes)
    return argv, notes + _common_notes(cfg, engine) + _memory_notes(cfg, p, engine, preset)
