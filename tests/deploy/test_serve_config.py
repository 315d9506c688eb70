"""`openglm serve`: CHECKPOINT with flags and deploy.yaml are two spellings of one deployment, and one builder
(`engine_config`) turns either into the EngineConfig the server runs."""

import dataclasses

import pytest
import yaml

from openglm.cli import build_parser
from openglm.deploy.cli import serve_config
from openglm.deploy.config import DeployConfigError, engine_config, load_deploy_config, unused_fields
from openglm.engine import EngineConfig


def serve_args(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_flags_and_deploy_yaml_build_the_same_engine(tmp_path):
    (tmp_path / "ckpt").mkdir()
    flags = serve_config(serve_args(str(tmp_path / "ckpt"), "--block-size", "8", "--num-kv-blocks", "64",
                                    "--max-num-seqs", "4", "--max-num-batched-tokens", "96", "--max-model-len", "200",
                                    "--session-ttl", "30", "--quantization", "int8", "--dtype", "bfloat16",
                                    "--num-speculative-tokens", "2", "--port", "9001"))
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"model": "ckpt", "port": 9001, "block_size": 8, "num_kv_blocks": 64,
                                    "max_num_seqs": 4, "max_num_batched_tokens": 96, "max_model_len": 200,
                                    "session_cache": {"ttl_s": 30}, "quantization": "int8", "dtype": "bfloat16",
                                    "speculative": {"num_speculative_tokens": 2}}))
    config = load_deploy_config(path)
    assert engine_config(flags) == engine_config(config) == EngineConfig(
        block_size=8, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=96, max_model_len=200,
        session_ttl=30.0, quantization="int8", dtype="bfloat16", num_speculative_tokens=2)
    assert (flags.name, flags.port) == (config.name, config.port) == ("ckpt", 9001)


def test_the_flags_defaults_are_the_deployment_defaults(tmp_path):
    """No engine flag given: the same engine as a deploy.yaml naming only the model."""
    path = tmp_path / "deploy.yaml"
    path.write_text("model: m\n")
    assert dataclasses.replace(serve_config(serve_args("m")), served_model_name=None) == load_deploy_config(path)


def test_tuning_keys_left_out_are_openglms_defaults_for_its_engine(tmp_path):
    """deploy.yaml leaves them None (so a GPU hand-off gets the engine's own); openglm's CPU engine fills them."""
    path = tmp_path / "deploy.yaml"
    path.write_text("model: m\n")
    cfg = load_deploy_config(path)
    assert (cfg.block_size, cfg.dtype, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.num_kv_blocks) == (None,) * 5
    engine = engine_config(cfg)
    assert (engine.block_size, engine.dtype, engine.max_num_batched_tokens, engine.max_num_seqs,
            engine.num_kv_blocks) == (16, "float32", 2048, 32, 2048)


def test_tensor_parallel_ranks_run_without_speculation_and_say_so(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("model: m\nspeculative: {num_speculative_tokens: 3}\n")
    cfg = load_deploy_config(path)
    assert engine_config(cfg).num_speculative_tokens == 3 and not unused_fields(cfg)
    assert engine_config(cfg, world=2).num_speculative_tokens == 0
    assert "single-process" in unused_fields(cfg, world=2)[0]


@pytest.mark.parametrize("argv, message", [([], "give a CHECKPOINT folder or --config"),
                                           (["ckpt", "--config", "d.yaml"], "not both"),
                                           (["ckpt", "--block-size", "0"], "block_size must be a positive integer"),
                                           (["ckpt", "--num-speculative-tokens", "-1"], "positive integer")])
def test_a_bad_serve_command_names_what_is_wrong(argv, message):
    with pytest.raises(DeployConfigError, match=message):
        serve_config(serve_args(*argv))


def test_thinking_defaults_from_flags_and_deploy_yaml(tmp_path):
    """vLLM's --default-chat-template-kwargs (JSON) and the thinking budget, as flags and as deploy.yaml keys."""
    flags = serve_config(serve_args("m", "--default-chat-template-kwargs", '{"enable_thinking": false}',
                                    "--thinking-token-budget", "64"))
    path = tmp_path / "deploy.yaml"
    path.write_text("model: m\ndefault_chat_template_kwargs: {enable_thinking: false}\nthinking_token_budget: 64\n")
    config = load_deploy_config(path)
    assert (flags.default_chat_template_kwargs, flags.thinking_token_budget) == \
        (config.default_chat_template_kwargs, config.thinking_token_budget) == ({"enable_thinking": False}, 64)


def test_the_template_switches_are_the_servers():
    from openglm.deploy.config import TEMPLATE_SWITCHES
    from openglm.server.protocol import ChatTemplateKwargs

    assert set(TEMPLATE_SWITCHES) == set(ChatTemplateKwargs.model_fields)


@pytest.mark.parametrize("argv, message", [
    (["m", "--default-chat-template-kwargs", '{"enable_thinking": "no"}'], "enable_thinking must be true or false"),
    (["m", "--default-chat-template-kwargs", '{"reasoning_effort": "low"}'], "unknown key"),
    (["m", "--thinking-token-budget", "-3"], "thinking_token_budget must be a non-negative integer")])
def test_bad_thinking_defaults_name_what_is_wrong(argv, message):
    with pytest.raises(DeployConfigError, match=message):
        serve_config(serve_args(*argv))


def test_template_kwargs_that_are_not_a_json_object_are_refused(capsys):
    for text in ("{enable_thinking: false}", "[1]"):
        with pytest.raises(SystemExit):
            serve_args("m", "--default-chat-template-kwargs", text)
        assert "--default-chat-template-kwargs" in capsys.readouterr().err
