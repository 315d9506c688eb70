import json

from openglm.cli import main


def test_train_then_generate_from_the_command_line(corpus_dir, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "cli-run"
    args = ["train", "--preset", "tiny", "--data", str(corpus_dir), "--tokenizer", str(tokenizer_dir),
            "--out", str(out), "--steps", "4", "--seq-len", "32", "--batch-size", "4", "--dtype", "fp32",
            "--save-every", "4", "--eval-every", "4", "--log-every", "2", "--eval-windows", "4",
            "--set", "num_hidden_layers=2",
            "--set", 'indexer_types=["full","shared"]', "--no-progress", "--no-plots"]
    assert main(args) == 0
    assert "trained to step 4" in capsys.readouterr().out
    assert json.loads((out / "checkpoints" / "step_0000004" / "config.json").read_text())["num_hidden_layers"] == 2
    assert main(["generate", str(out), "--prompt", "def add(", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def add(")
    assert main(args[:-2] + ["--steps", "6", "--resume", "--no-progress"]) == 0  # continues 4 -> 6
    assert "trained to step 6" in capsys.readouterr().out


def test_bad_input_prints_one_clear_error(tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--no-progress"]) == 1
    assert "error: corpus" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 1
    assert "no checkpoint" in capsys.readouterr().err
