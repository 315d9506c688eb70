"""The one set of dtype spellings every command and config accepts: `bf16`/`bfloat16`, `fp32`/`float32`,
`fp16`/`float16` (any case), each named by torch's full name. No torch import: the CLIs check flags before
loading it."""

from __future__ import annotations

import argparse

SPELLINGS = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
             "float": "float32", "float16": "float16", "fp16": "float16", "half": "float16"}
SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
ACCEPTED = "bf16/bfloat16, fp32/float32, fp16/float16"


def dtype_name(text, allowed: tuple[str, ...] = ("bfloat16", "float32", "float16"), what: str = "dtype") -> str:
    """torch's full name of a dtype spelling ('bf16' -> 'bfloat16'); ValueError naming `what` and the accepted
    spellings for anything else, or for a dtype outside `allowed` (full names)."""
    name = SPELLINGS.get(text.strip().lower()) if isinstance(text, str) else None
    if name is None:
        raise ValueError(f"{what} {text!r} is not a dtype openglm knows (use {ACCEPTED})")
    if name not in allowed:
        raise ValueError(f"{what} {text!r} ({name}) is not supported here (choose from "
                         f"{', '.join(f'{SHORT[a]}/{a}' for a in allowed)})")
    return name


def argparse_dtype(allowed: tuple[str, ...] = ("bfloat16", "float32", "float16")):
    """An argparse `type=` that accepts every spelling of `allowed` and returns the full name."""
    def parse(text: str) -> str:
        try:
            return dtype_name(text, allowed)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("dtype ")) from None

    parse.__name__ = "dtype"
    return parse
