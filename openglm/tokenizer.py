"""Byte-level BPE tokenizer: training, saving in the Hugging Face layout, loading, chat template.

The files written by `train_tokenizer` (`tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json`) load unchanged in transformers' `PreTrainedTokenizerFast`; inside
openglm everything goes through `load_tokenizer(path)`, which returns a small `Tokenizer` wrapper
used by the trainer, the inference engine and the server.

Special tokens follow GLM: `[gMASK]<sop>` open a sequence, role tokens `<|system|>`, `<|user|>`,
`<|assistant|>`, `<|observation|>` head each chat turn, `<|endoftext|>` ends a document (and is the
eos), `<|pad|>` pads. An assistant turn ends when the model emits the next role token or eos, so
`Tokenizer.stop_ids` holds eos, `<|user|>` and `<|observation|>`.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from openglm.util.files import write_atomic

EOS, PAD, GMASK, SOP = "<|endoftext|>", "<|pad|>", "[gMASK]", "<sop>"
ROLES = ("system", "user", "assistant", "observation")
SPECIAL_TOKENS = [EOS, PAD, GMASK, SOP] + [f"<|{r}|>" for r in ROLES]
N_BYTES = 256  # byte-level BPE always keeps the 256 single-byte tokens

# GLM-style chat template (Jinja, as transformers renders it):
#   [gMASK]<sop><|system|>\n{system}<|user|>\n{question}<|assistant|>\n{answer}...
# `add_generation_prompt` appends `<|assistant|>\n` so the model writes the next answer.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'observation'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TokenizerError(ValueError):
    """Bad tokenizer input: vocabulary too small, missing files, empty training data."""


def min_vocab_size() -> int:
    return N_BYTES + len(SPECIAL_TOKENS)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike | None = None,
                    model_max_length: int = 4096, show_progress: bool = False) -> "Tokenizer":
    """Train a byte-level BPE of `vocab_size` tokens (specials included) on `texts`.

    Saves the three Hugging Face files into `out_dir` when given; returns the loaded wrapper.
    """
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers  # heavy (Rust tokenizers): loaded when training one

    if vocab_size < min_vocab_size():
        raise TokenizerError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs {N_BYTES} byte tokens plus "
            f"{len(SPECIAL_TOKENS)} special tokens ({', '.join(SPECIAL_TOKENS)}), i.e. at least {min_vocab_size()}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=show_progress,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    seen = _count_nonempty(texts)
    tok.train_from_iterator(seen, trainer=trainer)
    if seen.count == 0:
        raise TokenizerError("cannot train a tokenizer on an empty corpus (no non-empty texts)")
    wrapper = Tokenizer(tok, model_max_length=model_max_length)
    if out_dir is not None:
        wrapper.save(out_dir)
    return wrapper


class _count_nonempty:
    """Iterator over the non-empty texts that remembers how many it yielded."""

    def __init__(self, texts: Iterable[str]):
        self.texts, self.count = texts, 0

    def __iter__(self) -> Iterator[str]:
        for t in self.texts:
            if t:
                self.count += 1
                yield t


@dataclass
class Tokenizer:
    """What the rest of openglm needs from a tokenizer (wraps a `tokenizers.Tokenizer`)."""

    hf: object  # tokenizers.Tokenizer
    model_max_length: int = 4096

    # ---- ids of the special tokens
    def token_id(self, token: str) -> int:
        idx = self.hf.token_to_id(token)
        if idx is None:
            raise TokenizerError(f"special token {token!r} is missing from this tokenizer's vocabulary")
        return idx

    @property
    def eos_id(self) -> int:
        return self.token_id(EOS)

    @property
    def pad_id(self) -> int:
        return self.token_id(PAD)

    @property
    def bos_ids(self) -> list[int]:
        """The sequence prefix `[gMASK]<sop>`."""
        return [self.token_id(GMASK), self.token_id(SOP)]

    @property
    def stop_ids(self) -> list[int]:
        """Token ids that end an assistant turn (eos or the next speaker's role token)."""
        return [self.eos_id, self.token_id("<|user|>"), self.token_id("<|observation|>")]

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    # ---- text <-> ids
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return self.bos_ids + ids if add_bos else ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str | list[int]:
        """Render `messages` ([{role, content}]) with the GLM chat template (same output as transformers)."""
        text = _render_chat(messages, add_generation_prompt)
        return self.encode(text) if tokenize else text

    # ---- files
    def save(self, out_dir: str | os.PathLike) -> Path:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json (each atomically)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        specials = {"bos_token": SOP, "eos_token": EOS, "pad_token": PAD}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            "additional_special_tokens": [GMASK] + [f"<|{r}|>" for r in ROLES],
            "model_max_length": self.model_max_length,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        }
        special_map = {**specials, "additional_special_tokens": config["additional_special_tokens"]}
        write_atomic(out / "tokenizer.json", self.hf.to_str())
        write_atomic(out / "tokenizer_config.json", json.dumps(config, indent=2))
        write_atomic(out / "special_tokens_map.json", json.dumps(special_map, indent=2))
        return out


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer from a folder holding `tokenizer.json` (or the file itself)."""
    from tokenizers import Tokenizer as HFTokenizer  # heavy (Rust tokenizers): loaded with a tokenizer

    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise TokenizerError(f"no tokenizer found: {file} does not exist")
    max_len = 4096
    cfg_file = file.parent / "tokenizer_config.json"
    if cfg_file.is_file():
        max_len = int(json.loads(cfg_file.read_text()).get("model_max_length", max_len))
    tok = Tokenizer(HFTokenizer.from_file(str(file)), model_max_length=max_len)
    missing = [t for t in SPECIAL_TOKENS if tok.hf.token_to_id(t) is None]
    if missing:
        raise TokenizerError(f"{file} lacks openglm's special tokens {missing}")
    return tok


def _render_chat(messages: list[dict], add_generation_prompt: bool) -> str:
    return _chat_template().render(messages=messages, add_generation_prompt=add_generation_prompt)


@functools.cache
def _chat_template():
    """The chat template, compiled once per process rather than on every render."""
    import jinja2  # only to render a chat template

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    return env.from_string(CHAT_TEMPLATE)


def _raise_template_error(msg: str):
    raise TokenizerError(msg)
