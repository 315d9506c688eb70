"""The hand-off to GPU serving engines: a deploy.yaml as the equivalent vLLM or SGLang launch.

Each function returns (argv, notes): the command line, and one line per field the target engine
expresses differently or not at all (printed to stderr by `openglm deploy`). The flag names are those of
the engines' own argument parsers (tests/deploy/test_deploy.py records the source files and versions).
"""

from __future__ import annotations

import json

from openglm.deploy.config import DeployConfig

ENGINES = ("vllm", "sglang")


class HandoffError(ValueError):
    """A deploy.yaml field the chosen engine cannot express."""


def _common_notes(cfg: DeployConfig, engine: str) -> list[str]:
    notes = [f"num_kv_blocks={cfg.num_kv_blocks} is openglm's pool size; {engine} sizes its KV cache from free "
             "GPU memory"]
    if cfg.session_cache.enabled:
        notes.append(f"session_cache.ttl_s={cfg.session_cache.ttl_s:g}: {engine} keeps cached prefixes until memory "
                     "is needed (LRU), with no idle timeout")
    return notes


def vllm_command(cfg: DeployConfig) -> tuple[list[str], list[str]]:
    lay = cfg.layout
    argv = ["vllm", "serve", cfg.model, "--served-model-name", cfg.name, "--host", cfg.host, "--port", str(cfg.port),
            "--tensor-parallel-size", str(lay.tp), "--pipeline-parallel-size", str(lay.pp)]
    notes = _common_notes(cfg, "vLLM")
    if lay.dp > 1:
        argv += ["--data-parallel-size", str(lay.dp)]
    if lay.ep > 1:
        argv.append("--enable-expert-parallel")
        if lay.ep != lay.tp * lay.dp:
            notes.append(f"expert_parallel={lay.ep}: vLLM shards the experts over all tensor x data parallel ranks "
                         f"(EP = {lay.tp * lay.dp} here), not over a separate group")
    argv += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens), "--max-num-seqs", str(cfg.max_num_seqs),
             "--block-size", str(cfg.block_size), "--dtype", cfg.dtype]
    if cfg.max_model_len is not None:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.quantization == "fp8":
        argv += ["--quantization", "fp8"]
    elif cfg.quantization in ("int8", "int4"):
        raise HandoffError(f"quantization {cfg.quantization} (weight-only, openglm's CPU kernels) has no vLLM "
                           "equivalent for an unquantised checkpoint; use fp8, or a checkpoint quantised for it "
                           "(e.g. compressed-tensors)")
    argv.append("--enable-prefix-caching" if cfg.session_cache.enabled else "--no-enable-prefix-caching")
    if cfg.speculative is not None:
        spec = {"method": "mtp", "num_speculative_tokens": cfg.speculative.num_speculative_tokens}
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if cfg.tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", cfg.tool_call_parser]
    if cfg.reasoning_parser:
        argv += ["--reasoning-parser", cfg.reasoning_parser]
    return argv, notes


def sglang_command(cfg: DeployConfig) -> tuple[list[str], list[str]]:
    lay = cfg.layout
    argv = ["python", "-m", "sglang.launch_server", "--model-path", cfg.model, "--served-model-name", cfg.name,
            "--host", cfg.host, "--port", str(cfg.port), "--tp-size", str(lay.tp), "--pp-size", str(lay.pp)]
    notes = _common_notes(cfg, "SGLang")
    if lay.dp > 1:
        argv += ["--dp-size", str(lay.dp)]
    if lay.ep > 1:
        argv += ["--ep-size", str(lay.ep)]
    # SGLang's chunked-prefill size is the per-step token budget of a prefill batch
    argv += ["--chunked-prefill-size", str(cfg.max_num_batched_tokens), "--max-running-requests",
             str(cfg.max_num_seqs), "--page-size", str(cfg.block_size), "--dtype", cfg.dtype]
    if cfg.max_model_len is not None:
        argv += ["--context-length", str(cfg.max_model_len)]
    if cfg.quantization == "fp8":
        argv += ["--quantization", "fp8"]
    elif cfg.quantization in ("int8", "int4"):
        raise HandoffError(f"quantization {cfg.quantization} (weight-only) has no SGLang equivalent for an "
                           "unquantised checkpoint (its w8a8_int8 also quantises activations); use fp8")
    if not cfg.session_cache.enabled:
        argv.append("--disable-radix-cache")
    if cfg.speculative is not None:  # SGLang runs GLM's MTP layer as an EAGLE-style draft (NEXTN is an alias)
        n = cfg.speculative.num_speculative_tokens
        argv += ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(n), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(n + 1)]
    if cfg.tool_call_parser:
        argv += ["--tool-call-parser", cfg.tool_call_parser]
    if cfg.reasoning_parser:
        argv += ["--reasoning-parser", cfg.reasoning_parser]
    return argv, notes


def launch_command(cfg: DeployConfig, engine: str) -> tuple[list[str], list[str]]:
    if engine not in ENGINES:
        raise HandoffError(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
    return vllm_command(cfg) if engine == "vllm" else sglang_command(cfg)
