"""Checkpoints stay whole and shareable: every writer puts the tokenizer and chat template beside the weights, the
files get the umask's modes (another user, a container, an engine can read them), and a folder saved without a
tokenizer is served with `--tokenizer` (the error says so)."""

from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from openglm.cli import main
from openglm.model import GlmMoeDsaForCausalLM, ModelConfig, load_model, save_pretrained
from openglm.model.errors import CheckpointError
from openglm.tokenizer import TEMPLATE_FILE, Tokenizer, TokenizerError

SERVABLE = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", TEMPLATE_FILE)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny checkpoint with its tokenizer, as `openglm serve` takes it."""
    from openglm.engine.random_checkpoint import build_random_checkpoint

    return build_random_checkpoint(tmp_path_factory.mktemp("src") / "tiny")


@pytest.fixture(scope="module")
def weights_only(source, tmp_path_factory):
    """The same weights written the way the README's quick tour used to: no tokenizer."""
    path = tmp_path_factory.mktemp("bare") / "weights"
    save_pretrained(load_model(source), path)
    return path


@contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(folder: Path) -> set[tuple[str, int]]:
    return {(p.name, stat.S_IMODE(p.stat().st_mode)) for p in [folder, *folder.iterdir()]}


def test_convert_writes_the_tokenizer_and_template_beside_the_weights(source, tmp_path, capsys):
    assert main(["convert", str(source), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert main(["convert", str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--fp8", "--fp8-block", "8,8"]) == 0
    for out in (tmp_path / "bf16", tmp_path / "fp8"):
        assert all((out / name).is_file() for name in SERVABLE), sorted(p.name for p in out.iterdir())
        assert (out / TEMPLATE_FILE).read_text() == (source / TEMPLATE_FILE).read_text()
        tok = Tokenizer.from_checkpoint(out)
        assert tok.encode("def f(x):") == Tokenizer.from_checkpoint(source).encode("def f(x):")
    assert "warning" not in capsys.readouterr().err


def test_convert_of_a_folder_without_tokenizer_says_how_to_serve_it(weights_only, source, tmp_path, capsys):
    assert main(["convert", str(weights_only), str(tmp_path / "out")]) == 0
    assert "has weights only: serve it with --tokenizer PATH" in capsys.readouterr().err
    assert main(["convert", str(weights_only), str(tmp_path / "whole"), "--tokenizer", str(source)]) == 0
    assert (tmp_path / "whole" / TEMPLATE_FILE).is_file()
    assert main(["convert", str(weights_only), str(tmp_path / "x"), "--tokenizer", str(tmp_path)]) == 1
    assert "has no tokenizer.json" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("mask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_checkpoint_files_follow_the_umask(source, tmp_path, mask, folder_mode, file_mode):
    """The temp folder (0700) and temp files (0600) the writers go through used to be kept by the atomic rename."""
    model = load_model(source)
    with umask(mask):
        model.save_pretrained(tmp_path / "c", tokenizer=Tokenizer.from_checkpoint(source))
        save_pretrained(model, tmp_path / "sharded", max_shard_size=20_000, tokenizer=source)
    for folder in (tmp_path / "c", tmp_path / "sharded"):
        found = modes(folder)
        assert (folder.name, folder_mode) in found
        assert {m for name, m in found if name != folder.name} == {file_mode}, found


def test_model_save_pretrained_method_writes_a_servable_checkpoint(source, tmp_path):
    """The Hugging Face-style method is back (it calls openglm/model/save.py, which does not import model.py)."""
    from openglm.engine import EngineConfig, LLMEngine, SamplingParams

    torch.manual_seed(0)
    vocab = Tokenizer.from_checkpoint(source).vocab_size
    model = GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny", vocab_size=vocab))
    model.save_pretrained(tmp_path / "ckpt", tokenizer=source)
    engine = LLMEngine.from_pretrained(tmp_path / "ckpt", EngineConfig(num_kv_blocks=16))
    engine.add_request("def f(x):", SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(CheckpointError, match="has no tokenizer.json"):
        model.save_pretrained(tmp_path / "other", tokenizer=tmp_path)


def test_serving_a_folder_without_tokenizer_names_the_flag(weights_only, source):
    from openglm.deploy.config import DeployConfig
    from openglm.deploy.launch import build_engine

    with pytest.raises(TokenizerError, match=r"has no tokenizer \(tokenizer.json\): pass --tokenizer PATH"):
        build_engine(DeployConfig(model=str(weights_only)))
    engine = build_engine(DeployConfig(model=str(weights_only), tokenizer=str(source), num_kv_blocks=16))
    assert engine.tokenizer.encode("x = 1") == Tokenizer.from_checkpoint(source).encode("x = 1")


def test_generate_takes_a_tokenizer_flag(weights_only, source, capsys):
    assert main(["generate", str(weights_only), "--prompt", "def", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "pass --tokenizer PATH" in err and len(err.strip().splitlines()) == 1
    assert main(["generate", str(weights_only), "--prompt", "def", "--max-new-tokens", "2", "--tokenizer",
                 str(source)]) == 0
    assert capsys.readouterr().out.startswith("def")


def test_a_loaded_tokenizer_is_saved_with_its_own_config(source, tmp_path):
    """A checkpoint's tokenizer_config.json (its eos, its class) survives a save (it used to become openglm's)."""
    import json

    config = json.loads((source / "tokenizer_config.json").read_text())
    config.update(eos_token="<|user|>", tokenizer_class="SomethingElse", chat_template="{{ 'stale' }}")
    (tmp_path / "tok").mkdir()
    for name in ("tokenizer.json", TEMPLATE_FILE):
        (tmp_path / "tok" / name).write_bytes((source / name).read_bytes())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    Tokenizer.from_checkpoint(tmp_path / "tok").save(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert saved["eos_token"] == "<|user|>" and saved["tokenizer_class"] == "SomethingElse"
    assert "chat_template" not in saved  # the template lives in chat_template.jinja alone
    assert Tokenizer.from_checkpoint(tmp_path / "out").eos_token == "<|user|>"
