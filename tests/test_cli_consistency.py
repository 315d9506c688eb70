"""One CLI: every command that takes a checkpoint takes a run folder too, one set of dtype spellings is accepted
everywhere, and the published model names are preset names."""

from __future__ import annotations

import json

import pytest

from openglm.cli import build_parser, main


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A training run's folder: checkpoints/step_N (a whole checkpoint) and the `latest` pointer."""
    from openglm.engine.random_checkpoint import build_random_checkpoint

    run = tmp_path_factory.mktemp("run") / "demo"
    build_random_checkpoint(run / "checkpoints" / "step_0000004")
    (run / "checkpoints" / "latest").write_text("step_0000004\n")
    return run


def test_every_command_that_takes_a_checkpoint_accepts_a_run_folder(run_folder, tmp_path, capsys):
    """`info --checkpoint` used to refuse the run folder that `generate` and `serve` accept."""
    from openglm.deploy.config import DeployConfig
    from openglm.deploy.launch import build_engine

    assert main(["info", "--checkpoint", str(run_folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total_params"] > 0
    assert main(["convert", str(run_folder), str(tmp_path / "out"), "--dtype", "bf16"]) == 0
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert main(["generate", str(run_folder), "--prompt", "def", "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    assert build_engine(DeployConfig(model=str(run_folder), num_kv_blocks=16)).model_config.vocab_size > 0
    assert main(["doctor", str(run_folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target"]["kind"] == "run"
    assert {c["id"]: c["level"] for c in report["checks"]}["checkpoint.weights"] == "ok"


@pytest.mark.parametrize("spelling, name", [("bf16", "bfloat16"), ("BF16", "bfloat16"), ("bfloat16", "bfloat16"),
                                            ("fp32", "float32"), ("float32", "float32"), ("fp16", "float16"),
                                            ("float16", "float16")])
def test_one_dtype_spelling_set_everywhere(spelling, name):
    """`convert --dtype bf16` used to be refused while `train --dtype bf16` was the documented spelling."""
    from openglm.deploy.config import DeployConfig, parse_deploy_config
    from openglm.engine.config import EngineConfig
    from openglm.train.config import TrainConfig

    parser = build_parser()
    assert parser.parse_args(["convert", "a", "b", "--dtype", spelling]).dtype == name
    assert parser.parse_args(["serve", "ckpt", "--dtype", spelling]).dtype == name
    assert DeployConfig(model="m", dtype=spelling).dtype == name
    assert parse_deploy_config({"model": "m", "dtype": spelling}).dtype == name
    assert EngineConfig(dtype=spelling).dtype == name
    if name == "float16":
        with pytest.raises(ValueError, match=r"TrainConfig.dtype 'fp16' \(float16\) is not supported here|"
                                             r"TrainConfig.dtype 'float16' \(float16\) is not supported here"):
            TrainConfig(dtype=spelling)
    else:
        assert TrainConfig(dtype=spelling).dtype == {"bfloat16": "bf16", "float32": "fp32"}[name]


def test_a_dtype_nobody_knows_is_one_line_naming_the_spellings(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["convert", "a", "b", "--dtype", "fp64"])
    assert "use bf16/bfloat16, fp32/float32, fp16/float16" in capsys.readouterr().err


@pytest.mark.parametrize("alias, preset", [("glm-5.1", "glm-5"), ("GLM-5.1", "glm-5"), ("zai-org/GLM-5.1-FP8", "glm-5"),
                                           ("zai-org/GLM-5", "glm-5"), ("glm5", "glm-5"),
                                           ("zai-org/GLM-4.5-Air", "glm-4.5-air"), ("GLM-4.7-Flash", "glm-4.7-flash"),
                                           ("zai-org/GLM-4.6-FP8", "glm-4.6")])
def test_preset_aliases_for_the_published_names(alias, preset, capsys):
    """`info --preset glm-5.1` used to be an unknown preset."""
    assert main(["info", "--preset", alias, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert main(["info", "--preset", preset, "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    assert got["total_params"] == want["total_params"] and got["active_params"] == want["active_params"]


def test_an_unknown_preset_lists_the_names(capsys):
    assert main(["info", "--preset", "glm-9"]) == 1
    err = capsys.readouterr().err
    assert "unknown preset 'glm-9'" in err and "glm-4.7-flash" in err and "GLM-5.1" in err


def test_train_takes_an_alias_too(tmp_path):
    from openglm.train.config import TrainConfig
    from openglm.train.prepare import build_model_config

    cfg = build_model_config(TrainConfig(preset="GLM-5.1", out_dir=str(tmp_path)), None)
    assert cfg.num_hidden_layers == 78 and cfg.n_routed_experts == 256
