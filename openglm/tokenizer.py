"""The one tokenizer of openglm (training, generation, serving): byte-level BPE, GLM's chat protocol.

`train_tokenizer` writes the Hugging Face layout (`tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json`, `chat_template.jinja`), which loads unchanged in transformers'
`PreTrainedTokenizerFast`; `Tokenizer.from_checkpoint(path)` loads openglm's own files and any other
checkpoint's (eos from `tokenizer_config.json`, the chat template from `chat_template.jinja` or
`tokenizer_config.json["chat_template"]`, else openglm's GLM-5 template).

GLM's tokens: `[gMASK]<sop>` open a sequence, role tokens `<|system|>`, `<|user|>`, `<|assistant|>`,
`<|observation|>` head each chat turn, `<|endoftext|>` ends a document (and is the eos), `<|pad|>`
pads; these are special (dropped when decoding). The markers of reasoning and tool calls
(`<think>`, `</think>`, `<tool_call>`, `<arg_key>`, `<arg_value>`, `<tool_response>` and their closing
forms) are single added tokens that decode as text, so the server's output parsers see them. An
assistant turn ends at eos or the next speaker's role token: `stop_ids` holds eos, `<|user|>`,
`<|observation|>`.

Chat templates come from checkpoints, i.e. from strangers: they render in Jinja's immutable sandbox
(no attribute access to Python internals, no mutation of the messages), compiled once per template.
A render is bounded (`RenderBudget`): its seconds, all renders of one request together (checked at the template's
operations; the server's worker processes also arm a timer, which stops a loop that calls nothing), the characters
it writes (`max_chars`), and the size of what one operation makes (`'x' * 10**10`, a padding width, a power,
`range(10**9)`): over any of them, rendering stops with a `TemplateLimitError` naming the limit.
`apply_chat_template(tokenize=True)` gives the token ids of exactly the text `tokenize=False` renders,
with control tokens (added tokens: role tokens, markers) only where the template writes them: text
from the conversation (any message field, tool-call arguments, the tools) that spells a control token
is tokenized as plain text, so a user cannot forge a turn. How: the conversation's control-token
spellings are swapped for private-use placeholders of the same length and the template renders
again; where that changes nothing but the placeholders, each placeholder is tokenized as the plain
text it stands for. A spelling the template itself inspects (GLM templates split an assistant's
`<think>r</think>answer` content into reasoning and answer, GLM-4.6 checks for a trailing `/nothink`)
is left to the template, found by rendering again with fewer placeholders (a bounded number of renders).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
import string
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from openglm.util.files import write_atomic

EOS, PAD, GMASK, SOP = "<|endoftext|>", "<|pad|>", "[gMASK]", "<sop>"
ROLES = ("system", "user", "assistant", "observation")
SPECIAL_TOKENS = [EOS, PAD, GMASK, SOP] + [f"<|{r}|>" for r in ROLES]
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
           "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"]
N_BYTES = 256  # byte-level BPE always keeps the 256 single-byte tokens
TEMPLATE_FILE = "chat_template.jinja"

# openglm's own chat template: the GLM-5 format (our text; where it overlaps GLM-4.7's published template
# it renders the same). With tools, a first system turn lists them as JSON and shows the call format; an
# assistant turn is `<think>reasoning</think>` (or a bare `</think>` when its reasoning is cleared or
# thinking is off), the answer, then its tool calls; reasoning written inside the content
# (`<think>r</think>answer`) is moved out as GLM-4.7 does; the replies to one batch of calls share one
# `<|observation|>` turn. `clear_thinking` (default true) keeps reasoning only for turns after the last
# user message, i.e. within the current tool loop.
CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set thinking = enable_thinking is not defined or enable_thinking -%}
{%- set keep_reasoning = clear_thinking is defined and not clear_thinking -%}
[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>\
<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>
{%- endif -%}
{%- set users = namespace(i=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set users.i = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' or m.role == 'developer' -%}<|system|>{{ text(m.content) }}
{%- elif m.role == 'user' -%}<|user|>{{ text(m.content) }}
{%- elif m.role == 'assistant' -%}<|assistant|>
{%- set content = text(m.content) -%}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
{%- if m.reasoning_content is not string and '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{%- if reasoning.strip() and (keep_reasoning or loop.index0 > users.i) -%}
<think>{{ reasoning.strip() }}</think>
{%- else -%}</think>
{%- endif -%}
{{ content.strip() }}
{%- for call in m.tool_calls or [] -%}
{%- set f = call.function if call.function is defined else call -%}
<tool_call>{{ f.name }}
{%- for key, value in (f.arguments or {}).items() -%}
<arg_key>{{ key }}</arg_key><arg_value>{{ value if value is string \
else value | tojson(ensure_ascii=False) }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}
<tool_response>{{ text(m.content) }}</tool_response>
{%- else -%}{{ raise_exception('unknown chat role: ' ~ m.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{{ '<think>' if thinking else '</think>' }}{%- endif -%}
"""

MAX_TEMPLATE_PROBES = 64  # extra renders spent finding the control-token spellings a template inspects
PLACEHOLDER_POOL = range(0x100000, 0x10FFFE)  # Supplementary Private Use Area-B: one character per control token


class TokenizerError(ValueError):
    """Bad tokenizer input: vocabulary too small, missing files, empty training data, bad messages."""


class TemplateLimitError(TokenizerError):
    """A chat template went over its render budget: time, output size, or the size of one operation's result."""


DEFAULT_MAX_RENDER_CHARS = 1 << 26  # a render's output (and any string or list one operation makes), in characters
MAX_JSON_INDENT = 16


@dataclass
class RenderBudget:
    """What one request's renders of a chat template may cost: `seconds` of rendering (all its renders together;
    None: unbounded) and `max_chars` characters of output per render. `admit(text)` sees the rendered text before
    it is tokenised (a caller refuses there what cannot fit); `start`/`stop` bracket each render (the server's
    worker processes arm a timer there)."""

    seconds: float | None = None
    max_chars: int = DEFAULT_MAX_RENDER_CHARS
    used: float = 0.0  # seconds spent so far
    _started: float = 0.0

    def admit(self, text: str) -> None:
        """Refuse (raise) a rendered prompt before it is tokenised; the default admits everything."""

    def start(self) -> None:
        self._started = time.monotonic()

    def stop(self) -> None:
        self.used += time.monotonic() - self._started

    def check(self) -> None:
        if self.seconds is not None and self.used + time.monotonic() - self._started > self.seconds:
            raise self.timed_out()

    def timed_out(self) -> TemplateLimitError:
        return TemplateLimitError(f"the chat template ran longer than its limit of {self.seconds:g} s")

    def too_large(self, what: str) -> TemplateLimitError:
        return TemplateLimitError(f"the chat template made {what} larger than its limit of {self.max_chars} "
                                  f"characters")


def tokenizer_folder(checkpoint: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> Path:
    """Where the tokenizer of `checkpoint` is: `tokenizer` when given (a folder or its tokenizer.json), else the
    checkpoint folder itself; TokenizerError naming `--tokenizer` when that folder has none (weights saved alone)."""
    if tokenizer is not None:
        p = Path(tokenizer)
        folder = p.parent if p.is_file() else p
        if not (folder / "tokenizer.json").is_file():
            raise TokenizerError(f"--tokenizer {tokenizer}: no tokenizer.json there")
        return folder
    folder = Path(checkpoint)
    if not (folder / "tokenizer.json").is_file():
        raise TokenizerError(f"{folder} has no tokenizer (tokenizer.json): pass --tokenizer PATH, a folder that holds "
                             "one (e.g. the checkpoint it was trained or converted from), or save the weights with "
                             "their tokenizer: save_pretrained(model, path, tokenizer=...)")
    return folder


def min_vocab_size() -> int:
    return N_BYTES + len(SPECIAL_TOKENS) + len(MARKERS)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike | None = None,
                    model_max_length: int = 4096, show_progress: bool = False) -> "Tokenizer":
    """Train a byte-level BPE of `vocab_size` tokens (specials and markers included) on `texts`.

    Saves the Hugging Face files into `out_dir` when given; returns the loaded tokenizer.
    """
    from tokenizers import (  # heavy (Rust): loaded when training one
        AddedToken,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from tokenizers import Tokenizer as HFTokenizer

    if vocab_size < min_vocab_size():
        raise TokenizerError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs {N_BYTES} byte tokens plus "
            f"{len(SPECIAL_TOKENS)} special tokens ({', '.join(SPECIAL_TOKENS)}) and {len(MARKERS)} chat markers, "
            f"i.e. at least {min_vocab_size()}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKERS), special_tokens=SPECIAL_TOKENS, show_progress=show_progress,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    seen = _count_nonempty(texts)
    tok.train_from_iterator(seen, trainer=trainer)
    if seen.count == 0:
        raise TokenizerError("cannot train a tokenizer on an empty corpus (no non-empty texts)")
    # markers: one token each, kept when decoding (special=False), never split or normalised
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
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
    chat_template: str = CHAT_TEMPLATE
    eos_token: str = EOS
    config: dict = field(default_factory=dict)  # tokenizer_config.json, as read

    def __post_init__(self):
        from tokenizers import Tokenizer as HFTokenizer  # heavy (Rust tokenizers): loaded with a tokenizer

        # a second copy that reads control-token and marker text as plain text, for conversation content
        # (encode_special_tokens splits only special tokens, so every added token is made special there)
        spec = json.loads(self.hf.to_str())
        for added in spec.get("added_tokens") or []:
            added["special"] = True
        self._plain = HFTokenizer.from_str(json.dumps(spec))
        self._plain.encode_special_tokens = True

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load from a folder holding `tokenizer.json` (or the file itself); see the module docstring."""
        from tokenizers import Tokenizer as HFTokenizer  # heavy (Rust tokenizers): loaded with a tokenizer

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise TokenizerError(f"no tokenizer found: {file} does not exist")
        try:
            hf = HFTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(f"{file} is not a valid tokenizer.json: {exc}") from None
        config = _read_json(file.parent / "tokenizer_config.json")
        template_file = file.parent / TEMPLATE_FILE
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):  # transformers' named-template form: [{"name", "template"}]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{file.parent}: chat_template must be a string")
        tok = cls(hf, model_max_length=int(config.get("model_max_length") or 4096),
                  chat_template=template or CHAT_TEMPLATE, eos_token=_token_text(config.get("eos_token")) or EOS,
                  config=config)
        compile_template(tok.chat_template)  # a broken template is an error at load, not at the first request
        return tok

    # ---- ids of the special tokens
    def token_id(self, token: str) -> int:
        idx = self.hf.token_to_id(token)
        if idx is None:
            raise TokenizerError(f"special token {token!r} is missing from this tokenizer's vocabulary")
        return idx

    def _ids_of(self, tokens: Iterable[str]) -> list[int]:
        return [i for i in (self.hf.token_to_id(t) for t in tokens) if i is not None]

    @property
    def eos_ids(self) -> list[int]:
        """The end-of-document token(s) (empty for a vocabulary without one)."""
        return self._ids_of([self.eos_token])

    @property
    def eos_id(self) -> int:
        return self.token_id(self.eos_token)

    @property
    def pad_id(self) -> int:
        ids = self._ids_of([_token_text(self.config.get("pad_token")) or PAD]) or self.eos_ids
        return ids[0] if ids else 0

    @property
    def bos_ids(self) -> list[int]:
        """The sequence prefix `[gMASK]<sop>`."""
        return [self.token_id(GMASK), self.token_id(SOP)]

    @property
    def stop_ids(self) -> list[int]:
        """Token ids that end an assistant turn (eos or the next speaker's role token)."""
        return list(dict.fromkeys(self.eos_ids + self._ids_of(["<|user|>", "<|observation|>"])))

    def marker_id(self, marker: str) -> int | None:
        """The id of a chat marker (`</think>`, ...) when it is one token of this vocabulary."""
        return self.hf.token_to_id(marker)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: a text of c characters has at least
        c / max_token_chars tokens (a byte-level vocabulary entry is at least as long as the text it decodes to;
        a normalizer may fold a few characters into one, hence the margin when there is one)."""
        longest = max((len(t) for t in self.hf.get_vocab(with_added_tokens=True)), default=1)
        return max(1, longest) * (4 if self.hf.normalizer is not None else 1)

    def __len__(self) -> int:
        return self.vocab_size

    # ---- text <-> ids
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; control-token text in it becomes the control token (trusted text only)."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return self.bos_ids + ids if add_bos else ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of untrusted text: `<|user|>` typed by a user is the characters, not the token."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat
    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            budget: RenderBudget | None = None, **template_kwargs) -> str | list[int]:
        """Render `messages` (OpenAI chat messages, whole) and `tools` with the chat template.

        `template_kwargs` reach the template (GLM's `enable_thinking`, `clear_thinking`). With
        `tokenize=True` returns the token ids of that text in which conversation text never becomes a
        control token (see the module docstring). `budget` bounds the renders (default: output size only).
        """
        msgs = _template_messages(messages)
        budget = budget or RenderBudget()

        def render(swap=None) -> str:
            m, t = (msgs, tools) if swap is None else (_rebuild(msgs, swap), _rebuild(tools, swap))
            return _render(self.chat_template, m, t, add_generation_prompt, self._specials(), template_kwargs, budget)

        text = render()
        if not tokenize:
            return text
        budget.admit(text)
        return self._template_tokens(text, render, msgs, tools)

    def _template_tokens(self, text: str, render, msgs, tools) -> list[int]:
        found = _control_spellings(self._controls, (msgs, tools))
        if not found:
            return self.encode(text)
        used = {ch for s in _strings((msgs, tools)) for ch in s}
        marks = dict(zip(sorted({c for _, _, c in found}), (chr(c) for c in PLACEHOLDER_POOL if chr(c) not in used)))

        def render_with(chosen: set) -> str:
            counter = iter(range(1 << 62))
            return render(lambda s: _swap(s, next(counter), chosen, self._controls, marks))

        def unchanged(chosen: set) -> bool:
            return _restore(render_with(chosen), marks) == text

        everything = {(i, j) for i, j, _ in found}
        chosen = everything if unchanged(everything) else _inert(found, unchanged)
        ids: list[int] = []
        pattern = re.compile("|".join(f"(?:{re.escape(m)}){{{len(c)}}}" for c, m in marks.items()))
        final, pos = render_with(chosen), 0
        for m in pattern.finditer(final):
            control = next(c for c, mark in marks.items() if m.group(0) == mark * len(c))
            ids += self.encode(final[pos:m.start()]) + self.encode_plain(control)
            pos = m.end()
        return ids + self.encode(final[pos:])

    @functools.cached_property
    def _controls(self) -> re.Pattern:
        """Every added token's text (role tokens, markers), longest first."""
        texts = sorted({t.content for t in self.hf.get_added_tokens_decoder().values() if t.content}, key=len,
                       reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else re.compile(r"(?!x)x")

    def _specials(self) -> dict:
        return {k: _token_text(self.config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}

    # ---- files
    def save(self, out_dir: str | os.PathLike) -> Path:
        """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and chat_template.jinja. A tokenizer
        loaded from a checkpoint keeps that checkpoint's tokenizer_config.json entries (its eos, pad, class); the
        template is written to chat_template.jinja only, so the two can never disagree."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": SOP, "eos_token": EOS, "pad_token": PAD,
            "additional_special_tokens": [GMASK] + [f"<|{r}|>" for r in ROLES],
            "clean_up_tokenization_spaces": False,
            **{k: v for k, v in self.config.items() if k != "chat_template"},
            "model_max_length": self.model_max_length,
        }
        special_map = {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "additional_special_tokens")
                       if config.get(k) is not None}
        write_atomic(out / "tokenizer.json", self.hf.to_str())
        write_atomic(out / "tokenizer_config.json", json.dumps(config, indent=2))
        write_atomic(out / "special_tokens_map.json", json.dumps(special_map, indent=2))
        write_atomic(out / TEMPLATE_FILE, self.chat_template)
        return out


# ---- chat template rendering -------------------------------------------------------------------------
def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: tool-call arguments as a mapping (GLM templates iterate
    `arguments.items()`)."""
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise TokenizerError(f"messages[{i}] must be an object with a string 'role'")
        m = dict(msg)
        if m.get("tool_calls"):
            m["tool_calls"] = [_template_call(c, i, j) for j, c in enumerate(m["tool_calls"])]
        out.append(m)
    return out


def _template_call(call: dict, i: int, j: int) -> dict:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise TokenizerError(f"messages[{i}].tool_calls[{j}] needs a function with a string name")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise TokenizerError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise TokenizerError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")
    fn = {**fn, "arguments": args}
    return {**call, "function": fn} if "function" in call else fn


# ---- conversation text that spells a control token ----------------------------------------------------
def _strings(obj) -> Iterator[str]:
    """Every string in a JSON-like value (dict keys included), in a fixed order."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)


def _rebuild(obj, fn):
    """A copy of a JSON-like value with every string s (dict keys included, same order as `_strings`)
    replaced by fn(s)."""
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            key = _rebuild(k, fn)
            out[key] = _rebuild(v, fn)
        return out
    if isinstance(obj, (list, tuple)):
        return [_rebuild(v, fn) for v in obj]
    return obj


def _control_spellings(controls: re.Pattern, obj) -> list[tuple[int, int, str]]:
    """(string number, occurrence number, control text) of each control-token spelling in `obj`."""
    return [(i, j, m.group(0)) for i, s in enumerate(_strings(obj)) for j, m in enumerate(controls.finditer(s))]


def _swap(s: str, i: int, chosen: set, controls: re.Pattern, marks: dict) -> str:
    """String number `i` with its chosen control spellings replaced by same-length placeholders."""
    count = iter(range(1 << 62))
    return controls.sub(lambda m: marks[m.group(0)] * len(m.group(0)) if (i, next(count)) in chosen
                        else m.group(0), s)


def _restore(text: str, marks: dict) -> str:
    for control, mark in marks.items():
        text = text.replace(mark * len(control), control)
    return text


def _inert(found: list, unchanged) -> set:
    """The control spellings the template does not inspect: placeholders for them render the same text.
    Grows the set a string at a time, halving a group that changes the rendering; spellings left when
    the probe budget runs out get placeholders too (text, never a control token)."""
    by_string: dict[int, list] = {}
    for i, j, _ in found:
        by_string.setdefault(i, []).append((i, j))
    chosen: set = set()
    queue, probes = list(by_string.values()), 0
    while queue and probes < MAX_TEMPLATE_PROBES:
        group = queue.pop(0)
        probes += 1
        if unchanged(chosen | set(group)):
            chosen |= set(group)
        elif len(group) > 1:
            queue[:0] = [group[: len(group) // 2], group[len(group) // 2:]]
    return chosen | {o for group in queue for o in group}


_RENDERING = threading.local()  # the budget of the render running in this thread (the sandbox's hooks read it)


def _budget() -> RenderBudget:
    return getattr(_RENDERING, "budget", None) or RenderBudget()


def _render(template: str, messages, tools, add_generation_prompt, specials, kwargs, budget: RenderBudget) -> str:
    import jinja2  # only to render a chat template

    chunks, size = [], 0
    _RENDERING.budget = budget
    budget.start()
    try:
        for chunk in compile_template(template).generate(messages=messages, tools=tools or None,
                                                         add_generation_prompt=add_generation_prompt,
                                                         **{**specials, **kwargs}):
            size += len(chunk)
            if size > budget.max_chars:
                raise budget.too_large("an output")
            chunks.append(chunk)
            budget.check()
    except jinja2.TemplateError as exc:  # SecurityError included: a template reaching for internals
        raise TokenizerError(f"the chat template failed: {exc}") from None
    except OverflowError as exc:  # the sandbox's range() over its size limit, or an int too large for a float
        raise TemplateLimitError(f"the chat template went over a limit: {exc}") from None
    except RecursionError:
        raise TemplateLimitError("the chat template recursed too deeply") from None
    except MemoryError:
        raise TemplateLimitError("the chat template ran out of memory") from None
    except TokenizerError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template's own runtime error (1/0, a bad format string): one line
        raise TokenizerError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
    finally:
        budget.stop()
        _RENDERING.budget = None
    return "".join(chunks)


@functools.lru_cache(maxsize=8)
def compile_template(template: str):
    """Compile a chat template once, in Jinja's immutable sandbox (as transformers renders, minus its
    access to Python internals), with the render budget's checks on its operations."""
    import jinja2  # only to render a chat template

    env = _budgeted_sandbox()(trim_blocks=True, lstrip_blocks=True)
    env.policies["json.dumps_kwargs"] = {"ensure_ascii": False, "sort_keys": False}
    env.filters["tojson"] = _tojson
    for name in ("center", "indent", "format", "replace", "join", "wordwrap"):
        env.filters[name] = _bounded_filter(env.filters[name])
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"the chat template does not compile: {exc}") from None


@functools.cache
def _budgeted_sandbox():
    """Jinja's immutable sandbox whose every call, attribute and item access and arithmetic operator checks the
    render budget (time), and refuses an operation whose result would exceed its size before computing it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # only to render a chat template

    class BudgetedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context, operator, left, right):
            budget = _budget()
            budget.check()
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int) \
                            and len(seq) * times > budget.max_chars:
                        raise budget.too_large("a repeated string or list")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and right * abs(left).bit_length() > 1 << 16:
                raise budget.too_large("a power")
            elif operator == "%" and isinstance(left, str):
                _check_widths(budget, _printf_widths(left))
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own signature
            budget = _budget()
            budget.check()
            _check_call(budget, __obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            _budget().check()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _budget().check()
            return super().getitem(obj, argument)

    return BudgetedSandbox


PRINTF_WIDTHS = re.compile(r"%[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_widths(budget: RenderBudget, parts: list[str]) -> None:
    """Refuse printf/format widths or precisions that would pad beyond the budget ('*': taken from the arguments)."""
    for part in parts:
        if part == "*" or (part.isdigit() and int(part) > budget.max_chars):
            raise budget.too_large("a padded string")


def _printf_widths(text: str) -> list[str]:
    return [w for pair in PRINTF_WIDTHS.findall(text) for w in pair]


def _check_call(budget: RenderBudget, fn, args, kwargs) -> None:
    """Refuse a str method call whose result would exceed the budget (padding, tabs, replace, join, format)."""
    fn = getattr(fn, "__wrapped__", fn)  # the sandbox wraps str.format
    text, name = getattr(fn, "__self__", None), getattr(fn, "__name__", "")
    if not isinstance(text, str):
        return
    if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
        size = args[0]
    elif name == "expandtabs":
        tab = args[0] if args and isinstance(args[0], int) else kwargs.get("tabsize", 8)
        size = len(text) + text.count("\t") * (tab if isinstance(tab, int) else 8)
    elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        size = len(text) + (len(text) + 1) * max(0, len(args[1]) - len(args[0]))
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        size = sum(len(x) if isinstance(x, str) else 0 for x in args[0]) + len(text) * len(args[0])
    elif name in ("format", "format_map"):
        try:
            specs = [spec or "" for _, _, spec, _ in string.Formatter().parse(text)]
        except ValueError:
            return  # a malformed format string: str.format itself says so
        _check_widths(budget, [d for spec in specs for d in re.findall(r"\d+", spec)])
        return
    else:
        return
    if size > budget.max_chars:
        raise budget.too_large(f"a string ({name})")


def _bounded_filter(fn):
    """A Jinja filter refused before it runs when its result would exceed the render budget."""
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # an environment / context first

    @functools.wraps(fn)
    def bounded(*args, **kwargs):
        budget = _budget()
        budget.check()
        value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
        name = fn.__name__.removeprefix("do_")
        if name == "format" and isinstance(value, str):
            _check_widths(budget, _printf_widths(value))
        elif name in ("center", "indent", "wordwrap"):
            width = rest[0] if rest else kwargs.get("width", 0)
            lines = value.count("\n") + 1 if isinstance(value, str) else 1
            if (len(width) if isinstance(width, str) else width if isinstance(width, int) else 0) * lines \
                    > budget.max_chars:
                raise budget.too_large(f"a string ({name})")
        elif name in ("replace", "join"):
            method = getattr(value if name == "replace" else (rest[0] if rest else kwargs.get("d", "")), name, None)
            if isinstance(value, str) and name == "replace" and method is not None:
                _check_call(budget, method, rest[:2], {})
            elif name == "join" and isinstance(value, (list, tuple)) and method is not None:
                _check_call(budget, method, (value,), {})
        return fn(*args, **kwargs)

    return bounded


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # transformers' tojson: plain json.dumps (Jinja's own escapes <, >, & for HTML)
    if indent is not None and (len(indent) if isinstance(indent, str) else indent) > MAX_JSON_INDENT:
        raise TemplateLimitError(f"the chat template asked tojson for an indent over {MAX_JSON_INDENT}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _raise_template_error(msg: str):
    raise TokenizerError(msg)


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data

