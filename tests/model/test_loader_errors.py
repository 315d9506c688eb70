"""The loader's bad-input table: every untrusted input gets its own exception naming the key, tensor or file.

Each row of ROWS is one row of the table in docs/model.md ("Bad checkpoints"), and
`test_docs_table_matches_rows` keeps the two in step.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from openglm.model import GlmMoeDsaForCausalLM, ModelConfig, load_model, save_pretrained
from openglm.model import checkpoint as ckpt
from openglm.model.errors import (
    CheckpointError,
    CheckpointPathError,
    CheckpointTooLargeError,
    ConfigError,
    CorruptShardError,
    MissingShardError,
    MissingTensorError,
    NonFiniteTensorError,
    QuantizationError,
    ShapeMismatchError,
    TensorDTypeError,
    UnexpectedTensorError,
    UnknownModelTypeError,
)

VICTIM = "model.layers.1.mlp.experts.3.up_proj.weight"
DOC = Path(__file__).resolve().parents[2] / "docs" / "model.md"


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    save_pretrained(GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny")), tmp_path / "c", max_shard_size=20_000)
    return tmp_path / "c"


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def shard_of(path, name=VICTIM):
    return path / json.loads((path / ckpt.INDEX).read_text())["weight_map"][name]


def edit_tensors(path, fn, name=VICTIM):
    shard = shard_of(path, name)
    tensors = load_file(str(shard))
    fn(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def edit_index(path, fn):
    index = json.loads((path / ckpt.INDEX).read_text())
    fn(index["weight_map"])
    (path / ckpt.INDEX).write_text(json.dumps(index))


def truncate(path):
    shard = shard_of(path)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])


def move_shard_out(path, prefix):
    shard = shard_of(path)
    outside = path.parent / "elsewhere.safetensors"
    shard.rename(outside)
    edit_index(path, lambda wm: wm.update({k: (prefix + str(outside) if prefix == "/" else "../elsewhere.safetensors")
                                           if v == shard.name else v for k, v in wm.items()}))


def symlink_out(path):
    shard = shard_of(path)
    outside = path.parent / "elsewhere.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)


def fp8_without_scale(path):
    edit_config(path, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [8, 8]})
    edit_tensors(path, lambda t: t.update({VICTIM: t[VICTIM].to(torch.float8_e4m3fn)}))


def fp8_bad_scale(path):
    fp8_without_scale(path)
    edit_tensors(path, lambda t: t.update({VICTIM + "_scale_inv": torch.ones(3, 3)}))


def as_int4(path):
    """The checkpoint rewritten as int4 (`openglm convert --int4`): VICTIM becomes uint8 codes [32, 32] with bf16
    scales [32, 2] (groups of 32)."""
    from openglm.model.int4 import Int4Config

    save_pretrained(load_model(path), path, max_shard_size=20_000, quantization=Int4Config(32))


def int4_bad_scale(path):
    as_int4(path)
    edit_tensors(path, lambda t: t.update({VICTIM + "_scale": torch.ones(32, 3, dtype=torch.bfloat16)}))


def int4_nan_scale(path):
    as_int4(path)
    edit_tensors(path, lambda t: t[VICTIM + "_scale"].__setitem__((0, 0), float("nan")))


def int4_group(path):
    as_int4(path)
    edit_config(path, quantization_config={**json.loads((path / "config.json").read_text())["quantization_config"],
                                           "group_size": 48})


def scale_without_fp8_config(path):
    edit_tensors(path, lambda t: t.update({VICTIM: t[VICTIM].to(torch.float8_e4m3fn),
                                           VICTIM + "_scale_inv": torch.ones(4, 8)}))


def without_layer_lists(path, **changes):
    """config.json without its per-layer lists (nothing then caps the layer count), plus `changes`."""
    cfg = json.loads((path / "config.json").read_text())
    for key in ("mlp_layer_types", "indexer_types", "index_topk_pattern"):
        cfg.pop(key, None)
    cfg["openglm"].pop("attention_kinds", None)
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


def edit_openglm(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg["openglm"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


# (id, input, exception, message pattern, how to make the bad checkpoint)
ROWS = [
    ("model-type", "`model_type` not one of glm_moe_dsa, glm4_moe, glm4_moe_lite", UnknownModelTypeError,
     r"model_type='llama' is not supported", lambda p: edit_config(p, model_type="llama")),
    ("no-config", "the folder has no config.json", MissingShardError, r"no config\.json",
     lambda p: (p / "config.json").unlink()),
    ("config-not-object", "config.json holds a list, not an object", ConfigError,
     r"config\.json: expected a JSON object", lambda p: (p / "config.json").write_text("[1, 2]")),
    ("config-invalid-json", "config.json is not JSON", CheckpointError, r"config\.json: invalid JSON",
     lambda p: (p / "config.json").write_text("{oops")),
    ("string-int", '`hidden_size: "64"`', ConfigError, r"hidden_size='64': expected int",
     lambda p: edit_config(p, hidden_size="64")),
    ("null-int", "`vocab_size: null`", ConfigError, r"vocab_size=None: expected int",
     lambda p: edit_config(p, vocab_size=None)),
    ("string-bool", '`tie_word_embeddings: "false"`', ConfigError, r"tie_word_embeddings='false': expected bool",
     lambda p: edit_config(p, tie_word_embeddings="false")),
    ("string-float", '`rms_norm_eps: "1e-5"`', ConfigError, r"rms_norm_eps='1e-5': expected float",
     lambda p: edit_config(p, rms_norm_eps="1e-5")),
    ("nan-float", "`rms_norm_eps: NaN`", ConfigError, r"rms_norm_eps=nan: expected float",
     lambda p: edit_config(p, rms_norm_eps=float("nan"))),
    ("negative", "`max_position_embeddings: -1`", ConfigError, r"max_position_embeddings=-1 must be > 0",
     lambda p: edit_config(p, max_position_embeddings=-1)),
    ("too-many-layers", "`num_hidden_layers: 1000000000` (and no per-layer lists)", ConfigError,
     r"num_hidden_layers=1000000000 must be in \[1, 1024\]",
     lambda p: without_layer_lists(p, num_hidden_layers=10**9)),
    ("too-many-experts", "`n_routed_experts: 100000000`", ConfigError,
     r"n_routed_experts=100000000 is beyond what openglm accepts \(at most 8,192\)",
     lambda p: edit_config(p, n_routed_experts=10**8)),
    ("huge-config", "config.json over 1 MiB (a 10^8-character `index_topk_pattern`)", ConfigError,
     r"the value of 'index_topk_pattern' makes the file 100,[\d,]+ bytes, more than a model config can need",
     lambda p: edit_config(p, index_topk_pattern="F" * 10**8)),
    ("query-chunk", "`attn_query_chunk: -4`", ConfigError, r"attn_query_chunk=-4 must be >= 1",
     lambda p: edit_openglm(p, attn_query_chunk=-4)),
    ("rope-theta", "`rope_theta: 1e308`", ConfigError, r"rope_theta=1e\+308 must be a number in \(0, 3\.4e\+38\]",
     lambda p: edit_config(p, rope_parameters={"rope_type": "default", "rope_theta": 1e308})),
    ("layers-vs-weights", "`num_hidden_layers` above the layers the weights hold", ConfigError,
     r"num_hidden_layers=500, but the weights hold layers 0\.\.2",
     lambda p: without_layer_lists(p, num_hidden_layers=500)),
    ("experts-vs-weights", "`n_routed_experts` other than the experts the weights hold", ConfigError,
     r"n_routed_experts=64, but layer 1's weights hold 8 experts", lambda p: edit_config(p, n_routed_experts=64)),
    ("kv-heads", "`num_key_value_heads` != heads in an MLA model", ConfigError,
     r"num_key_value_heads=2 must equal num_attention_heads=4", lambda p: edit_config(p, num_key_value_heads=2)),
    ("rope-type", "a `rope_type` other than default / yarn", ConfigError, r"rope_type='longrope' is not supported",
     lambda p: edit_config(p, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4})),
    ("token-id", "`eos_token_id` outside the vocabulary", ConfigError, r"eos_token_id=999 is outside the vocabulary",
     lambda p: edit_config(p, eos_token_id=999)),
    ("engine-key", "`indexer_rope_interleave: false` (NeoX indexer RoPE)", ConfigError,
     r"indexer_rope_interleave=False is not supported", lambda p: edit_config(p, indexer_rope_interleave=False)),
    ("quant-config", "`quantization_config` other than fp8 e4m3 blocks or openglm_int4", QuantizationError,
     r"quantization_config\.quant_method='awq'", lambda p: edit_config(p, quantization_config={"quant_method": "awq"})),
    ("index-dotdot", "index entry `../elsewhere.safetensors`", CheckpointPathError,
     r"'\.\./elsewhere\.safetensors', which is outside the checkpoint folder", lambda p: move_shard_out(p, "..")),
    ("index-absolute", "index entry with an absolute path", CheckpointPathError, r"outside the checkpoint folder",
     lambda p: move_shard_out(p, "/")),
    ("index-symlink", "shard that is a symlink out of the folder", CheckpointPathError,
     r"outside the checkpoint folder", symlink_out),
    ("missing-shard", "shard listed in the index is absent", MissingShardError, r"shard listed in .* is missing",
     lambda p: shard_of(p).unlink()),
    ("truncated", "truncated safetensors file", CorruptShardError,
     r"model-\d+-of-\d+\.safetensors: tensor .* truncated", truncate),
    ("int-tensor", "an int64 tensor", TensorDTypeError, rf"tensor '{re.escape(VICTIM)}' .* has dtype I64",
     lambda p: edit_tensors(p, lambda t: t.update({VICTIM: t[VICTIM].long()}))),
    ("uint8-tensor", "a uint8 tensor", TensorDTypeError, r"has dtype U8: checkpoint weights must be floating point",
     lambda p: edit_tensors(p, lambda t: t.update({VICTIM: t[VICTIM].to(torch.uint8)}))),
    ("mixed-dtype", "one fp16 tensor in an fp32 checkpoint", TensorDTypeError,
     r"is float16, but config\.json declares dtype float32: a checkpoint holds one dtype",
     lambda p: edit_tensors(p, lambda t: t.update({VICTIM: t[VICTIM].half()}))),
    ("mixed-dtype-undeclared", "one fp16 tensor, config.json without `dtype`", TensorDTypeError,
     r"is float16, but the other tensors are float32: a checkpoint holds one dtype", lambda p: (
         edit_config(p, dtype=None), edit_tensors(p, lambda t: t.update({VICTIM: t[VICTIM].half()})))),
    ("nan-weight", "NaN in a weight", NonFiniteTensorError, rf"tensor '{re.escape(VICTIM)}' .* NaN",
     lambda p: edit_tensors(p, lambda t: t[VICTIM].__setitem__((0, 0), float("nan")))),
    ("fp8-no-scale", "an e4m3 weight without its `weight_scale_inv`", TensorDTypeError,
     r"float8_e4m3 without .*up_proj\.weight_scale_inv", fp8_without_scale),
    ("fp8-scale-shape", "a block scale of the wrong shape", QuantizationError,
     r"up_proj\.weight_scale_inv' has shape \(3, 3\)", fp8_bad_scale),
    ("scale-no-quant", "a block scale in a checkpoint without quantization_config", TensorDTypeError,
     r"a block scale needs an FP8 checkpoint", scale_without_fp8_config),
    ("int4-no-scale", "int4 codes without their `weight_scale`", TensorDTypeError,
     r"an int4 weight is uint8 codes NAME with bf16 scales NAME_scale, and one of the pair is missing",
     lambda p: (as_int4(p), edit_tensors(p, lambda t: t.pop(VICTIM + "_scale")))),
    ("int4-scale-shape", "int4 scales that do not fit the codes and group size", QuantizationError,
     r"up_proj\.weight' in .*: int4 codes \(32, 32\) torch\.uint8 and scales .* \(32, 3\) .* do not fit group_size 32",
     int4_bad_scale),
    ("int4-nan-scale", "a NaN int4 scale", QuantizationError, r"up_proj\.weight_scale' in .* NaN or infinite scales",
     int4_nan_scale),
    ("int4-group", "an int4 `group_size` other than 32, 64, 128", QuantizationError,
     r"quantization_config\.group_size=48: expected one of 32, 64, 128", int4_group),
    ("missing-tensor", "a tensor the config needs is absent", MissingTensorError, re.escape(VICTIM),
     lambda p: edit_tensors(p, lambda t: t.pop(VICTIM))),
    ("unexpected-tensor", "a tensor the model does not have", UnexpectedTensorError, r"bogus",
     lambda p: edit_tensors(p, lambda t: t.update({"model.layers.1.mlp.bogus.weight": torch.zeros(2)}))),
    ("undeclared-layer", "a layer past num_hidden_layers + num_nextn_predict_layers", UnexpectedTensorError,
     r"'model\.layers\.3\.eh_proj\.weight' belongs to layer 3, .*num_nextn_predict_layers=0",
     lambda p: edit_tensors(p, lambda t: t.update({"model.layers.3.eh_proj.weight": torch.zeros(64, 128)}))),
    ("shape", "a tensor of the wrong shape", ShapeMismatchError, r"experts\.3\.up_proj.*\(5, 64\)",
     lambda p: edit_tensors(p, lambda t: t.update({VICTIM: torch.zeros(5, 64)}))),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_raises_its_error(row, saved):
    _, _, exc, pattern, make = row
    make(saved)
    with pytest.raises(exc, match=pattern):
        load_model(saved)


def test_too_large_is_refused_before_any_mmap(saved, monkeypatch):
    def no_mmap(*a, **k):
        raise AssertionError("safe_open called before the size check")

    monkeypatch.setattr(ckpt, "safe_open", no_mmap)
    with pytest.raises(CheckpointTooLargeError, match=r"needs .* GiB .* refusing to load"):
        load_model(saved, max_memory=1000)


def test_trainer_state_is_not_unpickled_arbitrarily(tmp_path):
    from openglm.train.checkpoint import CheckpointError as TrainCheckpointError
    from openglm.train.checkpoint import load_trainer_state

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    torch.save({"step": 1, "x": Payload()}, tmp_path / "trainer_state.pt")
    with pytest.raises(TrainCheckpointError, match="trainer_state.pt: not a trainer state openglm can read safely"):
        load_trainer_state(tmp_path)
    assert not (tmp_path / "pwned").exists()
    torch.save({"step": 3, "rng": {"torch": torch.get_rng_state()}, "optimizer": {"lr": 0.1}},
               tmp_path / "trainer_state.pt")
    assert load_trainer_state(tmp_path)["step"] == 3


TRAIN = ["train", "--preset", "tiny", "--data", "{data}", "--vocab-size", "300", "--seq-len", "16", "--out", "{out}",
         "--resume", "{ckpt}", "--no-progress"]


@pytest.mark.parametrize("argv", [["generate", "{ckpt}", "--prompt", "x"], ["serve", "{ckpt}"], TRAIN],
                         ids=["generate", "serve", "train-resume"])
def test_cli_prints_one_line_without_traceback(argv, saved, tmp_path):
    import subprocess
    import sys

    from openglm.tokenizer import train_tokenizer

    edit_tensors(saved, lambda t: t.update({VICTIM: t[VICTIM].long()}))
    train_tokenizer([f"def f{i}(x): return x" for i in range(50)], 300).save(saved)  # generate/serve read it first
    (saved / "trainer_state.pt").write_bytes(b"\x80\x02garbage")  # train --resume reads this before the weights
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 4}) + "\n" for i in range(40)))
    args = [a.format(ckpt=saved, out=tmp_path / "run", data=data) for a in argv]
    r = subprocess.run([sys.executable, "-m", "openglm", *args], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert r.returncode != 0
    # train logs its data preparation first (progress lines, not errors)
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith(("training a ", "data "))]
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert "trainer_state.pt" in lines[0] or "has dtype I64" in lines[0]


def test_malformed_int4_checkpoint_is_refused_in_one_line(saved):
    import subprocess
    import sys

    int4_bad_scale(saved)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-m", "openglm", "convert", str(saved), str(saved.parent / "out")],
                       capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert "int4 codes (32, 32)" in lines[0] and "do not fit group_size 32" in lines[0]


def test_train_cli_guard_turns_load_errors_into_one_line(saved, capsys):
    from openglm.train.cli import _guarded

    edit_tensors(saved, lambda t: t.update({VICTIM: t[VICTIM].long()}))
    assert _guarded(lambda: load_model(saved)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has dtype I64" in err[0]


def test_docs_table_matches_rows():
    text = DOC.read_text()
    table = text[text.index("### Bad checkpoints"):]
    documented = re.findall(r"^\| `([a-z0-9-]+)` \|", table, flags=re.M)
    assert documented == [r[0] for r in ROWS]
    for row_id, _, exc, _, _ in ROWS:
        line = next(line for line in table.splitlines() if line.startswith(f"| `{row_id}` |"))
        assert f"`{exc.__name__}`" in line, line
