"""The engine's view of a checkpoint's tokenizer: encode, decode, eos ids and the chat template.

Wraps the checkpoint's `tokenizer.json` in a plain `tokenizers.Tokenizer` (so checkpoints without
openglm's special tokens work too; eos and pad come from `tokenizer_config.json`, else openglm's
defaults). The chat template is the checkpoint's own
(`chat_template` in `tokenizer_config.json`, rendered with Jinja like transformers does); without
one the documented default is openglm's GLM template (`openglm.tokenizer.CHAT_TEMPLATE`).
"""

from __future__ import annotations

import json
from pathlib import Path


class EngineTokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer  # heavy (Rust tokenizers): loaded with a tokenizer

        from openglm import tokenizer as otok

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"checkpoint {path} has no tokenizer.json")
        self.hf = Tokenizer.from_file(str(file))
        cfg_file = path / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template = self.config.get("chat_template") or otok.CHAT_TEMPLATE
        eos = self.config.get("eos_token") or otok.EOS
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_ids = [i for i in [self.hf.token_to_id(eos)] if i is not None]
        # tokens that end an assistant turn: eos and the next speaker's role token
        roles = [self.hf.token_to_id(t) for t in ("<|user|>", "<|observation|>")]
        self.chat_stop_ids = self.eos_ids + [i for i in roles if i is not None]
        pad = self.hf.token_to_id(otok.PAD)
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        import jinja2  # optional: only for a checkpoint's own chat template

        def raise_exception(msg):
            raise ValueError(msg)

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **_special_strings(self.config))


def _special_strings(config: dict) -> dict:
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = config.get(key)
        out[key] = value.get("content") if isinstance(value, dict) else value
    return out
