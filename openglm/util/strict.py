"""Strict loading of typed configs from JSON-like dicts: a key the dataclass does not have is an
error that names it, never silently ignored."""

from __future__ import annotations

from dataclasses import fields


def field_names(cls) -> list[str]:
    return [f.name for f in fields(cls)]


def check_keys(raw: dict, cls, what: str, error: type[Exception] = ValueError) -> None:
    """Raise `error` naming the keys of `raw` that are not fields of the dataclass `cls`.
    `what` says what the keys are, e.g. "TrainConfig field(s)" or "resilience.stuck key(s)"."""
    known = field_names(cls)
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise error(f"unknown {what} {unknown}; known: {known}")


def from_dict(cls, raw: dict, what: str, error: type[Exception] = ValueError):
    """`cls(**raw)` after `check_keys`."""
    check_keys(raw, cls, what, error)
    return cls(**raw)
