"""`openglm deploy`: deploy.yaml -> the vLLM / SGLang launch, held against the engines' own flag names.

The flag sets below were read from the engines' argument parsers (read-only, not vendored):
- vLLM, commit 99d7eb5d6a512cfcc5a2b104f24ebf2d6cda772b: vllm/engine/arg_utils.py (EngineArgs.add_cli_args:
  ParallelConfig, CacheConfig, SchedulerConfig, ModelConfig, StructuredOutputsConfig and VllmConfig groups) and,
  at commit 789340fbad95a900ca3c467c9cee33b3d905fd61, vllm/entrypoints/openai/cli_args.py (FrontendArgs: host,
  port, enable_auto_tool_choice, tool_call_parser; `vllm serve` takes the model as its positional model_tag).
  Parser names: vllm/entrypoints/openai/tool_parsers/glm4_moe_tool_parser.py and
  vllm/reasoning/glm4_moe_reasoning_parser.py register "glm45".
- SGLang: python/sglang/srt/server_args.py, upstream version with the "Runtime options" tp_size/pp_size group,
  dp_size, ep_size, page_size, chunked_prefill_size, speculative_* and tool_call_parser/reasoning_parser fields
  (ServerArgs.add_cli_args: "--tensor-parallel-size"/"--tp-size", "--pipeline-parallel-size"/"--pp-size",
  "--data-parallel-size"/"--dp-size", "--expert-parallel-size"/"--ep-size"); the repository index's pinned copy
  (commit 469c63e54e7d94591617ef9590c6aa26d54dc1bb) predates these. "glm45" is in
  python/sglang/srt/function_call/function_call_parser.py (ToolCallParserEnum) and the reasoning DetectorMap.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from openglm.deploy.config import load_deploy_config, parse_deploy_config
from openglm.deploy.handoff import HandoffError, launch_command

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "deploy.yaml"

VLLM_FLAGS = {
    "--host", "--port", "--served-model-name", "--tensor-parallel-size", "--pipeline-parallel-size",
    "--data-parallel-size", "--enable-expert-parallel", "--max-num-batched-tokens", "--max-num-seqs",
    "--max-model-len", "--block-size", "--quantization", "--dtype", "--enable-prefix-caching",
    "--no-enable-prefix-caching", "--speculative-config", "--enable-auto-tool-choice", "--tool-call-parser",
    "--reasoning-parser", "--kv-cache-dtype", "--default-chat-template-kwargs",
}
SGLANG_FLAGS = {
    "--model-path", "--host", "--port", "--served-model-name", "--tp-size", "--tensor-parallel-size", "--pp-size",
    "--pipeline-parallel-size", "--dp-size", "--data-parallel-size", "--ep-size", "--expert-parallel-size",
    "--chunked-prefill-size", "--max-prefill-tokens", "--max-running-requests", "--context-length", "--page-size",
    "--quantization", "--dtype", "--disable-radix-cache", "--speculative-algorithm", "--speculative-num-steps",
    "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--tool-call-parser", "--reasoning-parser",
}
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def deploy(*args):
    return subprocess.run([sys.executable, "-m", "openglm", "deploy", *args], env=ENV, capture_output=True,
                          text=True, timeout=60)


def options(argv: list[str]) -> dict[str, str | None]:
    """--flag -> its value (None for a switch)."""
    out, i = {}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            out[argv[i]] = argv[i + 1] if has_value else None
            i += 2 if has_value else 1
        else:
            i += 1
    return out


def example_launch(engine: str, head: list[str], flags: set[str]):
    """`openglm deploy examples/deploy.yaml --engine ENGINE`: its options (all the engine's flags), stderr."""
    proc = deploy(str(EXAMPLE), "--engine", engine)
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    assert argv[:len(head)] == head
    opts = options(argv)
    assert set(opts) <= flags, set(opts) - flags
    return opts, proc.stderr


def test_vllm_launch_maps_every_field_to_vllm_flags():
    opts, stderr = example_launch("vllm", ["vllm", "serve", "zai-org/GLM-5.1"], VLLM_FLAGS)
    assert opts["--tensor-parallel-size"] == "4" and opts["--pipeline-parallel-size"] == "1"
    assert "--enable-expert-parallel" in opts
    assert opts["--max-num-batched-tokens"] == "202000" and opts["--max-num-seqs"] == "64"
    assert opts["--block-size"] == "64" and opts["--quantization"] == "fp8" and opts["--dtype"] == "bfloat16"
    assert "--enable-prefix-caching" in opts
    assert json.loads(opts["--speculative-config"]) == {"method": "mtp", "num_speculative_tokens": 1}
    assert opts["--tool-call-parser"] == "glm45" and opts["--reasoning-parser"] == "glm45"
    assert "--enable-auto-tool-choice" in opts
    assert (opts["--host"], opts["--port"], opts["--served-model-name"]) == ("0.0.0.0", "8000", "glm-5.1")
    # vLLM's EP spans all tp x dp ranks: the example's ep=2 under tp=4 is said, not silently changed
    assert "EP = 4 here" in stderr and "ttl_s=600" in stderr


def test_sglang_launch_maps_every_field_to_sglang_flags():
    opts, _ = example_launch("sglang", ["python", "-m", "sglang.launch_server"], SGLANG_FLAGS)
    assert opts["--model-path"] == "zai-org/GLM-5.1"
    assert (opts["--tp-size"], opts["--ep-size"], opts["--pp-size"]) == ("4", "2", "1")
    assert opts["--chunked-prefill-size"] == "202000" and opts["--max-running-requests"] == "64"
    assert opts["--page-size"] == "64" and opts["--quantization"] == "fp8"
    assert "--disable-radix-cache" not in opts
    assert (opts["--speculative-algorithm"], opts["--speculative-num-steps"], opts["--speculative-eagle-topk"],
            opts["--speculative-num-draft-tokens"]) == ("EAGLE", "1", "1", "2")
    assert opts["--tool-call-parser"] == "glm45" and opts["--reasoning-parser"] == "glm45"


def test_pipeline_and_data_parallel_and_no_session_cache_are_handed_off():
    cfg = parse_deploy_config({"model": "m", "parallel_config": {"tensor_parallel": 8, "pipeline_parallel": 2,
                                                                 "data_parallel": 2, "expert_parallel": 16},
                               "session_cache": {"enabled": False}, "max_model_len": 131072})
    v = options(launch_command(cfg, "vllm")[0])
    assert (v["--pipeline-parallel-size"], v["--data-parallel-size"]) == ("2", "2")
    assert "--no-enable-prefix-caching" in v and v["--max-model-len"] == "131072"
    s = options(launch_command(cfg, "sglang")[0])
    assert (s["--pp-size"], s["--dp-size"], s["--ep-size"]) == ("2", "2", "16")
    assert "--disable-radix-cache" in s and s["--context-length"] == "131072"


def test_int8_has_no_engine_equivalent_and_says_so(tmp_path):
    cfg = tmp_path / "d.yaml"
    cfg.write_text(yaml.safe_dump({"model": "m", "quantization": "int8"}))
    for engine in ("vllm", "sglang"):
        proc = deploy(str(cfg), "--engine", engine)
        assert proc.returncode == 1 and proc.stderr.startswith("error: quantization int8"), proc.stderr
        with pytest.raises(HandoffError):
            launch_command(load_deploy_config(cfg), engine)


@pytest.mark.parametrize("data, message", [
    ({"model": "m", "tensor_parallel": 4}, "unknown key(s) ['tensor_parallel']"),
    ({"served_model_name": "x"}, "`model` is required"),
    ({"model": "m", "parallel_config": {"tensor_parallel": 0}}, "tp=0 must be a positive integer"),
    ({"model": "m", "block_size": "16"}, "block_size must be a positive integer"),
    ({"model": "m", "speculative": {"method": "eagle"}}, "only 'mtp'"),
    ({"model": "m", "session_cache": {"ttl": 5}}, "session_cache: unknown key(s) ['ttl']"),
    (["model", "m"], "must be a mapping"),
])
def test_bad_deploy_config_names_what_is_wrong(tmp_path, data, message):
    cfg = tmp_path / "d.yaml"
    cfg.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=re.escape(message)):  # DeployConfigError, or LayoutError for the layout
        load_deploy_config(cfg)


def test_cli_reports_a_bad_config_in_one_line(tmp_path):
    cfg = tmp_path / "d.yaml"
    cfg.write_text("model: m\nparallel_config: {tensor_parallel: 4, experts: 2}\n")
    proc = deploy(str(cfg))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["error: parallel_config: unknown key(s) ['experts'] (known: "
                                                "['data_parallel', 'expert_parallel', 'pipeline_parallel', "
                                                "'tensor_parallel'])"]


def test_run_without_the_engine_installed_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "openglm", "deploy", str(EXAMPLE), "--engine", "vllm", "--run"],
                          env={**ENV, "PATH": "/nonexistent"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "'vllm' is not on PATH" in proc.stderr


def test_thinking_defaults_go_to_vllm_and_are_noted_elsewhere():
    cfg = parse_deploy_config({"model": "m", "default_chat_template_kwargs": {"enable_thinking": False},
                               "thinking_token_budget": 512})
    argv, notes = launch_command(cfg, "vllm")
    assert argv[argv.index("--default-chat-template-kwargs") + 1] == '{"enable_thinking":false}'
    assert any("thinking_token_budget=512" in n for n in notes)
    argv, notes = launch_command(cfg, "sglang")
    assert "--default-chat-template-kwargs" not in argv
    assert any("chat_template_kwargs with each request" in n for n in notes)
