"""`openglm deploy`: deploy.yaml -> the vLLM / SGLang launch, parsed with the engines' own flag names and held
against the engines' GLM recipes.

The flag data below was read from the engines' argument parsers (restated as data, nothing vendored):
- vLLM 0.34.0, the PyPI wheel vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl (vllm/_version.py: commit
  62d4bc3c7; the github:vllm-project/vllm snapshot is over the fetch size limit): vllm/engine/arg_utils.py
  (EngineArgs.add_cli_args: ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, StructuredOutputsConfig
  and VllmConfig groups; a bool field gets argparse.BooleanOptionalAction, hence --no-enable-prefix-caching)
  and vllm/entrypoints/common/cli_args.py (FrontendArgs: host, port, enable_auto_tool_choice,
  tool_call_parser, chat_template_content_format = auto | string | openai). `vllm serve` takes the model as
  its positional model_tag. Parser names: vllm/tool_parsers/__init__.py and vllm/reasoning/__init__.py
  register glm45 and glm47 (both map to the GLM-4.7 parser classes there).
- SGLang 0.5.23, the PyPI wheel sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl (built 2026-10-30; the
  github:sgl-project/sglang snapshot is over the fetch size limit): python/sglang/srt/server_args.py and
  srt/arg_groups/fields/{model,parallel,schedule,memory,spec,serving}.py (flags derived from the field names,
  with aliases: --tp-size / --tensor-parallel-size, --ep-size / --expert-parallel-size, ...);
  --tool-call-parser choices: srt/function_call/parser_names.py (GLM ones: glm, glm45, glm47);
  --reasoning-parser choices: srt/parser/reasoning_parser_names.py (GLM: glm45 only).
The recipes: github:vllm-project/recipes at 8959cf64189c71d36e11c6a30335f923f261b1f7 (models/zai-org/GLM-*.yaml,
GLM/GLM5.md, GLM/GLM.md) and github:sgl-project/sgl-cookbook at 7b5bd9c05e3d86da5161ac2be9b91c19a34bf49d
(data/models/generated/*/glm*.yaml, docs/autoregressive/GLM/*.md); GLM-5.3-Flash from SGLang 0.5.23's
srt/parser/python_chat_template.py (its GLM-5.3 template features: reasoning glm45, tool calls glm47).
Cross-checked once by hand (not in this suite: the engines are not dependencies): every family's vLLM line,
and one with pp/dp/ep, block size, float16 and no prefix cache, parsed by vLLM 0.34.0's own `vllm serve`
parser (make_arg_parser + validate_parsed_serve_args, its tool/reasoning registries resolving glm45 and
glm47), and the SGLang lines by SGLang 0.5.23's ServerArgs.add_cli_args, which refuses `--reasoning-parser
glm47`.
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from openglm.cli import main
from openglm.deploy.config import load_deploy_config, parse_deploy_config
from openglm.deploy.fit import Split, check_fit
from openglm.deploy.handoff import HandoffError, launch_command
from openglm.deploy.recipes import RECIPES
from openglm.model.config import ModelConfig
from openglm.model.parallel import ParallelLayout, memory_report

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "deploy.yaml"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # both engines' --dtype choices
INT, JSON = int, json.loads
# flag names -> argparse keywords; "switch" for a flag without a value
VLLM = {
    ("--served-model-name",): dict(nargs="+"), ("--host",): {}, ("--port",): dict(type=INT),
    ("--tensor-parallel-size", "-tp"): dict(type=INT), ("--pipeline-parallel-size", "-pp"): dict(type=INT),
    ("--data-parallel-size", "-dp"): dict(type=INT), ("--max-model-len",): dict(type=INT),
    ("--max-num-batched-tokens",): dict(type=INT), ("--max-num-seqs",): dict(type=INT),
    ("--block-size",): dict(type=INT), ("--dtype",): dict(choices=DTYPES),
    ("--quantization", "-q"): dict(choices=("fp8",)),  # of vLLM's QuantizationMethods, the one the hand-off uses
    ("--kv-cache-dtype",): {}, ("--gpu-memory-utilization",): dict(type=float),
    ("--speculative-config", "-sc"): dict(type=JSON),
    ("--tool-call-parser",): dict(choices=("glm45", "glm47")),  # the GLM names of vLLM's tool-parser registry
    ("--reasoning-parser",): dict(choices=("glm45", "glm47")),
    ("--chat-template-content-format",): dict(choices=("auto", "string", "openai")),
    ("--enable-expert-parallel", "-ep"): "switch", ("--no-enable-expert-parallel",): "switch",
    ("--enable-prefix-caching",): "switch", ("--no-enable-prefix-caching",): "switch",
    ("--enable-auto-tool-choice",): "switch", ("--no-enable-auto-tool-choice",): "switch",
    ("--trust-remote-code",): "switch", ("--default-chat-template-kwargs",): dict(type=JSON),
}
SGLANG = {
    ("--model-path", "--model"): {}, ("--served-model-name",): {}, ("--host",): {}, ("--port",): dict(type=INT),
    ("--tp-size", "--tensor-parallel-size"): dict(type=INT), ("--pp-size", "--pipeline-parallel-size"): dict(type=INT),
    ("--dp-size", "--data-parallel-size"): dict(type=INT), ("--ep-size", "--expert-parallel-size", "--ep"):
    dict(type=INT), ("--context-length",): dict(type=INT), ("--chunked-prefill-size",): dict(type=INT),
    ("--max-prefill-tokens",): dict(type=INT), ("--max-running-requests",): dict(type=INT),
    ("--page-size",): dict(type=INT), ("--mem-fraction-static",): dict(type=float), ("--dtype",): dict(choices=DTYPES),
    ("--quantization",): dict(choices=("fp8",)),  # of QUANTIZATION_CHOICES, the one the hand-off uses
    ("--kv-cache-dtype",): {}, ("--disable-radix-cache",): "switch", ("--trust-remote-code",): "switch",
    ("--speculative-algorithm",): {}, ("--speculative-num-steps",): dict(type=INT),
    ("--speculative-eagle-topk",): dict(type=INT), ("--speculative-num-draft-tokens",): dict(type=INT),
    ("--tool-call-parser",): dict(choices=("auto", "glm", "glm45", "glm47")),  # "auto" + the GLM names
    ("--reasoning-parser",): dict(choices=("auto", "glm45")),
}
# The recipes, restated: family -> (checkpoint for quantization: fp8, tool-call parser, reasoning parser, vLLM's
# --chat-template-content-format, a layout on H200s that the recipes run)
RECIPE_LINES = {
    "glm-5": ("zai-org/GLM-5-FP8", "glm47", "glm45", "string", 8),
    "glm-5.1": ("zai-org/GLM-5.1-FP8", "glm47", "glm45", "string", 8),
    "glm-5.2": ("zai-org/GLM-5.2-FP8", "glm47", "glm45", None, 8),
    "glm-5.3-flash": ("zai-org/GLM-5.3-Flash", "glm47", "glm45", None, 8),
    "glm-4.7": ("zai-org/GLM-4.7-FP8", "glm47", "glm45", None, 4),
    "glm-4.7-flash": ("zai-org/GLM-4.7-Flash", "glm47", "glm45", None, 1),  # no FP8 checkpoint published
    "glm-4.6": ("zai-org/GLM-4.6-FP8", "glm45", "glm45", None, 4),
    "glm-4.5": ("zai-org/GLM-4.5-FP8", "glm45", "glm45", None, 4),
    "glm-4.5-air": ("zai-org/GLM-4.5-Air-FP8", "glm45", "glm45", None, 2),
}


def engine_parser(engine: str) -> argparse.ArgumentParser:
    """An argparse parser with the engine's flag names (no abbreviations, unknown flags are errors)."""
    parser = argparse.ArgumentParser(prog=engine, allow_abbrev=False, exit_on_error=False)
    if engine == "vllm":
        parser.add_argument("model_tag")
    for names, kwargs in (VLLM if engine == "vllm" else SGLANG).items():
        parser.add_argument(*names, **({"action": "store_true"} if kwargs == "switch" else kwargs))
    return parser


def parse_line(engine: str, argv: list[str]) -> argparse.Namespace:
    head = ["vllm", "serve"] if engine == "vllm" else ["python", "-m", "sglang.launch_server"]
    assert argv[:len(head)] == head, argv
    args, unknown = engine_parser(engine).parse_known_args(argv[len(head):])
    assert unknown == [], f"{engine} has no flag(s) {unknown}"
    return args


def given(argv: list[str]) -> set[str]:
    return {a for a in argv if a.startswith("--")}


def deploy(capsys, *args) -> tuple[int, str, str]:
    """`openglm deploy ARGS` in this process: (exit status, stdout, stderr)."""
    status = main(["deploy", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


def warnings(notes: list[str]) -> list[str]:
    return [n for n in notes if n.startswith("warning:")]


# ---- every family's line, parsed with each engine's flags and held against its recipe -------------------
@pytest.mark.parametrize("family", RECIPE_LINES)
def test_each_family_launch_parses_with_the_engine_flags_and_follows_its_recipe(family):
    checkpoint, tool, reasoning, content_format, tp = RECIPE_LINES[family]
    cfg = parse_deploy_config({"model": RECIPES[family].repo, "quantization": "fp8", "gpu": "H200",
                               "parallel_config": {"tensor_parallel": tp}, "max_model_len": 131072,
                               "max_num_batched_tokens": 16384, "speculative": {"num_speculative_tokens": 1}})
    v_argv, v_notes = launch_command(cfg, "vllm")
    v = parse_line("vllm", v_argv)
    assert v.model_tag == checkpoint and (v.tool_call_parser, v.reasoning_parser) == (tool, reasoning)
    assert v.enable_auto_tool_choice and v.chat_template_content_format == content_format
    assert v.dtype == "bfloat16" and v.tensor_parallel_size == tp
    assert (v.max_model_len, v.max_num_batched_tokens) == (131072, 16384)
    assert v.speculative_config == {"method": "mtp", "num_speculative_tokens": 1}
    # a published FP8 checkpoint is served as it is; only where none is published does the engine quantise
    assert v.quantization == (None if checkpoint.endswith(("-FP8", "5.3-Flash")) else "fp8")
    s_argv, s_notes = launch_command(cfg, "sglang")
    s = parse_line("sglang", s_argv)
    assert s.model_path == checkpoint and (s.tool_call_parser, s.reasoning_parser) == (tool, reasoning)
    assert (s.dtype, s.tp_size, s.context_length, s.chunked_prefill_size) == ("bfloat16", tp, 131072, 16384)
    assert s.quantization == v.quantization
    assert (s.speculative_algorithm, s.speculative_num_steps, s.speculative_num_draft_tokens) == ("EAGLE", 1, 2)
    # the recipes' layouts fit an H200 (GLM-5.3-Flash: no openglm preset of its shape here, so not estimated)
    assert warnings(v_notes) == warnings(s_notes) == []


def test_the_example_is_the_glm51_recipe_and_fits_its_gpu():
    for engine in ("vllm", "sglang"):
        argv, notes = launch_command(load_deploy_config(EXAMPLE), engine)
        args = parse_line(engine, argv)
        assert (args.tool_call_parser, args.reasoning_parser) == ("glm47", "glm45")
        assert warnings(notes) == [], notes
        assert any("89.9 GiB of FP8 weights per GPU" in n and "on H200" in n for n in notes), notes
    v = parse_line("vllm", launch_command(load_deploy_config(EXAMPLE), "vllm")[0])
    assert v.model_tag == "zai-org/GLM-5.1-FP8" and v.quantization is None
    assert v.chat_template_content_format == "string"
    assert v.max_model_len == 202752 and v.max_num_batched_tokens == 16384  # context apart from the step budget


def test_cli_prints_a_line_that_parses_and_notes_on_stderr():
    """The real entry point, once: stdout is the line alone, stderr the notes."""
    proc = subprocess.run([sys.executable, "-m", "openglm", "deploy", str(EXAMPLE), "--engine", "sglang"], env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    args = parse_line("sglang", shlex.split(proc.stdout))
    assert args.model_path == "zai-org/GLM-5.1-FP8" and args.ep_size == 8
    assert all(line.startswith(("note: ", "warning: ")) for line in proc.stderr.splitlines()), proc.stderr


# ---- the defects of the old hand-off ----------------------------------------------------------------
OLD_EXAMPLE = {  # the write-ups' deployment as examples/deploy.yaml had it
    "model": "zai-org/GLM-5.1", "served_model_name": "glm-5.1", "host": "0.0.0.0", "port": 8000,
    "parallel_config": {"tensor_parallel": 4, "expert_parallel": 2, "pipeline_parallel": 1},
    "max_num_batched_tokens": 202000, "max_num_seqs": 64, "block_size": 64, "quantization": "fp8",
    "dtype": "bfloat16", "speculative": {"method": "mtp", "num_speculative_tokens": 1},
}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_glm5_gets_the_glm47_tool_parser_not_glm45(engine):
    args = parse_line(engine, launch_command(parse_deploy_config({"model": "zai-org/GLM-5.1"}), engine)[0])
    assert args.tool_call_parser == "glm47" and args.reasoning_parser == "glm45"


def test_a_parser_against_the_recipe_is_kept_with_a_warning_and_an_unknown_one_refused():
    cfg = parse_deploy_config({**OLD_EXAMPLE, "tool_call_parser": "glm45", "reasoning_parser": "glm45"})
    argv, notes = launch_command(cfg, "vllm")
    assert parse_line("vllm", argv).tool_call_parser == "glm45"
    assert any(n.startswith("warning: tool_call_parser glm45: the engines' GLM-5.1 recipes use glm47") for n in notes)
    with pytest.raises(HandoffError, match="SGLang has no GLM parser of that name"):
        launch_command(parse_deploy_config({"model": "zai-org/GLM-4.7", "reasoning_parser": "glm47"}), "sglang")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_fp8_serves_the_published_fp8_checkpoint_not_bf16_plus_quantization(engine):
    argv, notes = launch_command(parse_deploy_config(OLD_EXAMPLE), engine)
    assert "zai-org/GLM-5.1-FP8" in argv and "zai-org/GLM-5.1" not in argv
    assert "--quantization" not in argv
    assert any("the FP8 checkpoint Z.ai publishes for GLM-5.1" in n for n in notes)


def test_old_layout_warns_that_it_does_not_fit_and_suggests_one(tmp_path, capsys):
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(OLD_EXAMPLE))
    status, _, err = deploy(capsys, str(path), "--engine", "vllm", "--gpu", "H200")
    assert status == 0, err
    [warning] = [line for line in err.splitlines() if "on H200" in line]
    # vLLM puts a quarter of the experts on each of the 4 GPUs: openglm info --parallel tp=4,ep=4
    assert warning.startswith("warning: layout dp=1,ep=2,tp=4,pp=1 on H200 (141 GB): 176.0 GiB of FP8 weights")
    assert "does not fit" in warning and "suggested: parallel_config: {tensor_parallel: 8}" in warning


def test_the_estimate_is_the_one_openglm_info_parallel_prints():
    cfg = ModelConfig.from_preset("glm-5")
    split = Split.of(cfg)
    for tp, ep in ((4, 2), (4, 4), (8, 8), (16, 16)):
        info = memory_report(cfg, ParallelLayout(tp=tp, ep=ep))["serve"]
        assert split.per_gpu(tp, ep) == pytest.approx(info["total_params_per_rank"], rel=1e-12)
    fit = check_fit(split, cfg, tp=8, expert_ranks=8, pp=1, bytes_per_param=1, gpu_gb=141)
    assert fit.fits and not fit.tight and fit.gib_per_gpu == pytest.approx(89.87, abs=0.01)
    assert not check_fit(split, cfg, 8, 8, 1, bytes_per_param=2, gpu_gb=141).fits  # BF16 needs two nodes


def test_an_unnamed_gpu_still_warns_when_no_gpu_could_hold_the_layout():
    notes = launch_command(parse_deploy_config({"model": "zai-org/GLM-5.1"}), "sglang")[1]
    [warning] = warnings(notes)
    assert "1,385.6 GiB of bfloat16 weights per GPU" in warning and "fits no GPU" in warning
    assert "on H200s: parallel_config: {tensor_parallel: 8, pipeline_parallel: 2}" in warning


def test_a_tensor_parallel_that_does_not_divide_the_heads_is_flagged():
    cfg = parse_deploy_config({"model": "zai-org/GLM-4.7-Flash", "parallel_config": {"tensor_parallel": 8}})
    assert any("tp=8 does not divide num_attention_heads=20" in w for w in warnings(launch_command(cfg, "vllm")[1]))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_step_token_budget_is_not_the_context_length(engine):
    argv, notes = launch_command(parse_deploy_config(OLD_EXAMPLE), engine)
    assert any(n.startswith("warning: max_num_batched_tokens=202000 is the tokens one scheduler step computes")
               for n in notes)
    ok = parse_deploy_config({**OLD_EXAMPLE, "max_num_batched_tokens": 16384, "max_model_len": 202752})
    assert not any("max_num_batched_tokens" in n for n in launch_command(ok, engine)[1])


def test_glm5_vllm_line_has_the_string_content_format():
    args = parse_line("vllm", launch_command(parse_deploy_config(OLD_EXAMPLE), "vllm")[0])
    assert args.chat_template_content_format == "string"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_minimal_deploy_yaml_hands_no_cpu_defaults_to_a_gpu_engine(engine, tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("model: zai-org/GLM-4.5-Air\n")
    argv = launch_command(load_deploy_config(path), engine)[0]
    args = parse_line(engine, argv)
    assert args.dtype == "bfloat16"
    absent = ({"--block-size", "--max-num-seqs", "--max-num-batched-tokens"} if engine == "vllm" else
              {"--page-size", "--max-running-requests", "--chunked-prefill-size"})
    assert not given(argv) & absent, argv


def test_float32_on_gpus_is_kept_with_a_warning():
    argv, notes = launch_command(parse_deploy_config({"model": "zai-org/GLM-4.5-Air", "dtype": "float32"}), "vllm")
    assert parse_line("vllm", argv).dtype == "float32"
    assert any(n.startswith("warning: dtype float32 on GPUs") for n in notes)


# ---- local checkpoints, other models ------------------------------------------------------------------
def test_a_local_fp8_checkpoint_is_served_as_it_is(tmp_path):
    ckpt = tmp_path / "GLM-5.1-local"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}))
    cfg = parse_deploy_config({"model": str(ckpt), "quantization": "fp8", "gpu": "H200",
                               "parallel_config": {"tensor_parallel": 8}})
    argv, notes = launch_command(cfg, "vllm")
    args = parse_line("vllm", argv)
    assert args.model_tag == str(ckpt) and args.quantization is None and args.tool_call_parser == "glm47"
    assert any(f"openglm info --checkpoint {ckpt} --parallel tp=8,ep=8" in n for n in notes), notes


def test_a_glm4_moe_folder_asks_for_its_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm4_moe"}))
    argv, notes = launch_command(parse_deploy_config({"model": str(tmp_path)}), "vllm")
    assert "--tool-call-parser" not in argv and any("set family: glm-4.5, glm-4.6 or glm-4.7" in n for n in notes)
    family = parse_deploy_config({"model": str(tmp_path), "family": "glm-4.7"})
    assert parse_line("vllm", launch_command(family, "vllm")[0]).tool_call_parser == "glm47"


def test_quantization_fp8_without_a_published_checkpoint_quantises_on_load():
    argv, notes = launch_command(parse_deploy_config({"model": "zai-org/GLM-4.7-Flash", "quantization": "fp8"}),
                                 "sglang")
    assert parse_line("sglang", argv).quantization == "fp8"
    assert any("no FP8 checkpoint is published for GLM-4.7-Flash" in n for n in notes)


def test_pipeline_and_data_parallel_and_no_session_cache_are_handed_off():
    cfg = parse_deploy_config({"model": "m", "parallel_config": {"tensor_parallel": 8, "pipeline_parallel": 2,
                                                                 "data_parallel": 2, "expert_parallel": 16},
                               "session_cache": {"enabled": False}, "max_model_len": 131072})
    v = parse_line("vllm", launch_command(cfg, "vllm")[0])
    assert (v.pipeline_parallel_size, v.data_parallel_size, v.enable_expert_parallel) == (2, 2, True)
    assert v.no_enable_prefix_caching and v.max_model_len == 131072
    s = parse_line("sglang", launch_command(cfg, "sglang")[0])
    assert (s.pp_size, s.dp_size, s.ep_size) == (2, 2, 16)
    assert s.disable_radix_cache and s.context_length == 131072


def test_int8_has_no_engine_equivalent_and_says_so(tmp_path, capsys):
    cfg = tmp_path / "d.yaml"
    cfg.write_text(yaml.safe_dump({"model": "m", "quantization": "int8"}))
    status, _, err = deploy(capsys, str(cfg), "--engine", "sglang")
    assert status == 1 and err.startswith("error: quantization int8"), err
    with pytest.raises(HandoffError):
        launch_command(load_deploy_config(cfg), "vllm")


@pytest.mark.parametrize("data, message", [
    ({"model": "m", "tensor_parallel": 4}, "unknown key(s) ['tensor_parallel']"),
    ({"served_model_name": "x"}, "`model` is required"),
    ({"model": "m", "parallel_config": {"tensor_parallel": 0}}, "tp=0 must be a positive integer"),
    ({"model": "m", "block_size": "16"}, "block_size must be a positive integer"),
    ({"model": "m", "speculative": {"method": "eagle"}}, "only 'mtp'"),
    ({"model": "m", "session_cache": {"ttl": 5}}, "session_cache: unknown key(s) ['ttl']"),
    ({"model": "m", "family": "glm-6"}, "family 'glm-6' is not one openglm has a recipe for"),
    ({"model": "m", "gpu": "RTX-9090"}, "gpu 'RTX-9090': not a GPU openglm knows"),
    (["model", "m"], "must be a mapping"),
])
def test_bad_deploy_config_names_what_is_wrong(tmp_path, data, message):
    cfg = tmp_path / "d.yaml"
    cfg.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=re.escape(message)):  # DeployConfigError, or LayoutError for the layout
        load_deploy_config(cfg)


def test_a_gpu_by_its_memory():
    cfg = parse_deploy_config({"model": "zai-org/GLM-4.5-Air", "gpu": "96GB", "quantization": "fp8"})
    assert any("on 96GB (96 GB)" in n for n in launch_command(cfg, "vllm")[1])


def test_cli_reports_a_bad_config_in_one_line(tmp_path, capsys):
    cfg = tmp_path / "d.yaml"
    cfg.write_text("model: m\nparallel_config: {tensor_parallel: 4, experts: 2}\n")
    status, _, err = deploy(capsys, str(cfg))
    assert status == 1
    assert err.strip().splitlines() == ["error: parallel_config: unknown key(s) ['experts'] (known: "
                                                "['data_parallel', 'expert_parallel', 'pipeline_parallel', "
                                                "'tensor_parallel'])"]


def test_run_without_the_engine_installed_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    status, out, err = deploy(capsys, str(EXAMPLE), "--engine", "vllm", "--run")
    assert status == 1 and "'vllm' is not on PATH" in err and out == ""


def test_thinking_defaults_go_to_vllm_and_are_noted_elsewhere():
    cfg = parse_deploy_config({"model": "m", "default_chat_template_kwargs": {"enable_thinking": False},
                               "thinking_token_budget": 512})
    argv, notes = launch_command(cfg, "vllm")
    assert parse_line("vllm", argv).default_chat_template_kwargs == {"enable_thinking": False}
    assert any("thinking_token_budget=512" in n for n in notes)
    argv, notes = launch_command(cfg, "sglang")
    assert "--default-chat-template-kwargs" not in argv and parse_line("sglang", argv)
    assert any("chat_template_kwargs with each request" in n for n in notes)
