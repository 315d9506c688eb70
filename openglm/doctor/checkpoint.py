"""A checkpoint folder: what `openglm serve` would refuse (config, weights' headers against the config, tokenizer,
chat template) and what would load but misbehave (a template that writes control tokens the tokenizer does not
have, eos ids that disagree, a context the default KV pool cannot hold). No weight is read: only the headers.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from openglm.doctor.report import Check, error, info, ok, warn
from openglm.model.checkpoint import (
    check_sizes_against_weights,
    checkpoint_dtype,
    read_config,
    read_config_json,
    read_headers,
    shard_files,
)
from openglm.model.config import ModelConfig, export_warnings
from openglm.model.errors import MissingTensorError, ModelError
from openglm.model.families import family_of
from openglm.model.fp8 import SCALE_SUFFIX, parse_quantization_config
from openglm.model.hf_names import HFNames, hf_name
from openglm.model.model import build_model
from openglm.tokenizer import Tokenizer, TokenizerError, tokenizer_folder

# The spellings chat templates use for turn and sequence markers (GLM's, ChatML's, Llama's, the reasoning and tool
# markers): each must be one token of the tokenizer, or the model never sees the boundary it was trained on.
CONTROL = re.compile(r"<\|[^<>|\s]{1,40}\|>|\[[gG]?MASK\]|<sop>|<eop>|</?(?:think|tool_call|tool_response|arg_key|"
                     r"arg_value)>|\[/?INST\]|<s>|</s>|<start_of_turn>|<end_of_turn>")
SAMPLE_CHAT = [{"role": "system", "content": "You are a helpful assistant."},
               {"role": "user", "content": "Write a function that adds two numbers."},
               {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
               {"role": "user", "content": "Now subtract."}]
STORED_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1}
SERVE_POOL_TOKENS = 2048 * 16  # `openglm serve`'s default KV pool: --num-kv-blocks 2048 x --block-size 16


def check_checkpoint(path: Path, tokenizer: str | None = None) -> tuple[list[Check], ModelConfig | None]:
    """The checkpoint's checks and its config (None when config.json is unusable)."""
    out, cfg = [], None
    try:
        raw = read_config_json(path)
        cfg = read_config(path, raw)
        out.append(ok("checkpoint.config", f"config.json: {cfg.model_type}, {cfg.num_hidden_layers} layers, "
                      f"hidden {cfg.hidden_size}, {cfg.n_routed_experts} experts (top-{cfg.num_experts_per_tok}), "
                      f"vocab {cfg.vocab_size:,}"))
    except ModelError as e:
        out.append(error("checkpoint.config", f"serve would refuse it: {e}",
                         "fix that key of config.json (`openglm info --checkpoint` reads it; the loader's table of "
                         "bad inputs is in docs/model.md)"))
    if cfg is not None:
        out.append(_weights(path, raw, cfg))
    tok, tok_check = _tokenizer(path, tokenizer)
    out.append(tok_check)
    if tok is not None:
        if cfg is not None:
            out += [_vocab(cfg, tok), _eos(cfg, tok)]
        out.append(_template(tok))
    if cfg is not None:
        out += _context(cfg, tok)
        out += [info("checkpoint.export", f"vLLM/SGLang would not reproduce this model: {w}") for w in
                export_warnings(cfg)]
    return out, cfg


def _weights(path: Path, raw: dict, cfg: ModelConfig) -> Check:
    try:
        quant = parse_quantization_config(raw.get("quantization_config"))
        tensors = read_headers(shard_files(path))
        dtype = checkpoint_dtype(tensors, raw.get("dtype", raw.get("torch_dtype")), quant)
        names = family_of(cfg.model_type).hf_names.reading(tensors)
        check_sizes_against_weights(Path(path), cfg, tensors, names)
        _expected_tensors(cfg, tensors, names)
    except ModelError as e:
        return error("checkpoint.weights", f"serve would refuse it: {e}",
                     "the weights and config.json disagree or a file is damaged: write the checkpoint again (`openglm "
                     "convert SOURCE DEST` from a good copy), or restore the file named")
    size = sum(t.numel * STORED_BYTES.get(t.dtype, 4) for t in tensors.values())
    files = len({t.file for t in tensors.values()})
    kind = "FP8 blocks + " if quant is not None else ""
    return ok("checkpoint.weights", f"weights: {len(tensors):,} tensors in {files} file(s), {kind}"
              f"{str(dtype).removeprefix('torch.')}, {size / 2**20:,.1f} MiB (headers checked, values not read)",
              tensors=len(tensors), bytes=size, dtype=str(dtype).removeprefix("torch."))


def _expected_tensors(cfg: ModelConfig, tensors: dict, names: HFNames) -> None:
    """Every tensor the model needs, with its shape, is in the headers (the loader's check, on the meta device)."""
    layer = names.disk(f"model.layers.{cfg.num_hidden_layers}.")
    if not any(name.startswith(layer) for name in tensors):
        cfg = cfg.replace(num_nextn_predict_layers=0)  # a checkpoint without its next-n layers loads without them
    with torch.device("meta"):
        model = build_model(cfg)

    def get(name):
        return torch.empty(tensors[names.disk(name)].shape, device="meta")

    def has(name):
        return names.disk(name) in tensors and not name.endswith(SCALE_SUFFIX)

    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        try:
            names.load_native(hf_name(name, cfg.num_hidden_layers), p.shape, get, has)
        except KeyError as e:
            raise MissingTensorError(f"the checkpoint lacks tensor {names.disk(e.args[0])!r}") from None


def _tokenizer(path: Path, tokenizer: str | None) -> tuple[Tokenizer | None, Check]:
    try:
        folder = tokenizer_folder(path, tokenizer)
        tok = Tokenizer.from_checkpoint(folder)
    except TokenizerError as e:
        return None, error("checkpoint.tokenizer", f"serve and generate would refuse it: {e}",
                           "pass --tokenizer PATH (a folder with the tokenizer.json the model was trained with), or "
                           "write it beside the weights: `openglm convert SRC DEST --tokenizer PATH` copies it")
    where = "" if tokenizer is None else f" (from {folder})"
    return tok, ok("checkpoint.tokenizer", f"tokenizer{where}: {tok.vocab_size:,} tokens, eos {tok.eos_token!r}")


def _vocab(cfg: ModelConfig, tok: Tokenizer) -> Check:
    if tok.vocab_size > cfg.vocab_size:
        return error("checkpoint.vocab", f"the tokenizer has {tok.vocab_size:,} tokens but the model's vocab_size is "
                     f"{cfg.vocab_size:,}: ids past the embedding would be refused (or index out of range)",
                     "use the tokenizer the model was trained with", tokenizer=tok.vocab_size, model=cfg.vocab_size)
    return ok("checkpoint.vocab", f"vocabulary: tokenizer {tok.vocab_size:,} <= model {cfg.vocab_size:,}")


def _eos(cfg: ModelConfig, tok: Tokenizer) -> Check:
    if not tok.eos_ids:
        return error("checkpoint.eos", f"the tokenizer has no token for its eos {tok.eos_token!r}: generation would "
                     "never stop by itself", "fix eos_token in tokenizer_config.json (GLM: <|endoftext|>)")
    declared = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else \
        [] if cfg.eos_token_id is None else [cfg.eos_token_id]
    stops = set(tok.stop_ids)
    if declared and not stops & set(declared):
        names = ", ".join(f"{i} ({tok.hf.id_to_token(i)!r})" for i in declared[:4])
        return warn("checkpoint.eos", f"config.json's eos_token_id {names} is none of the tokenizer's stop tokens "
                    f"({', '.join(repr(tok.hf.id_to_token(i)) for i in sorted(stops))}): engines that read "
                    "config.json (transformers' generate, vLLM) stop elsewhere than openglm serve",
                    "set eos_token_id in config.json to the tokenizer's eos id "
                    f"({tok.eos_ids[0]}), or use the tokenizer the model was trained with")
    return ok("checkpoint.eos", f"stop tokens: {', '.join(repr(tok.hf.id_to_token(i)) for i in tok.stop_ids)}")


def _template(tok: Tokenizer) -> Check:
    try:
        text = tok.apply_chat_template(SAMPLE_CHAT, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template from a stranger can raise anything; serving would too
        return error("checkpoint.template", f"the chat template fails on a plain conversation: {e}",
                     "fix chat_template.jinja, or delete it to use openglm's GLM template")
    spellings = sorted(set(CONTROL.findall(text)))
    missing = [s for s in spellings if tok.hf.token_to_id(s) is None]
    if missing:
        return error("checkpoint.template", f"the chat template and the tokenizer disagree: the template writes "
                     f"{', '.join(map(repr, missing))}, which the tokenizer has no token for, so each becomes several "
                     "ordinary tokens and the model never sees the turn boundaries it was trained on (multi-turn "
                     "conversations fall apart)", "use one checkpoint's template and tokenizer together: copy "
                     "chat_template.jinja with tokenizer.json from the same source (`openglm convert SRC DEST "
                     "--tokenizer SRC`), or delete chat_template.jinja to use openglm's GLM template",
                     missing=missing)
    if not spellings:
        return warn("checkpoint.template", "the chat template writes no control token: turns are separated by plain "
                    "text only, which the model can confuse with the conversation's own text",
                    "use the template the model was trained with (GLM: [gMASK]<sop><|user|>...<|assistant|>)")
    return ok("checkpoint.template", f"chat template: its markers {', '.join(spellings)} are single tokens",
              markers=spellings)


def _context(cfg: ModelConfig, tok: Tokenizer | None) -> list[Check]:
    out = []
    if cfg.max_position_embeddings > SERVE_POOL_TOKENS:
        out.append(info("checkpoint.context", f"context: the model takes {cfg.max_position_embeddings:,} tokens, "
                        f"`openglm serve`'s default KV pool holds {SERVE_POOL_TOKENS:,} (2048 blocks x 16)",
                        "longer contexts: --num-kv-blocks N (N x 16 tokens) and the memory for it"))
    if tok is not None and tok.model_max_length < cfg.max_position_embeddings:
        out.append(info("checkpoint.context", f"tokenizer_config.json's model_max_length {tok.model_max_length:,} < "
                        f"the model's {cfg.max_position_embeddings:,} positions (openglm serve goes by the model's)"))
    return out
