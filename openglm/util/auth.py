"""Bearer tokens, checked one way by both HTTP apps (the OpenAI-compatible server and the agent's task API).

A request's `Authorization: Bearer <token>` header is compared in constant time with the full-control
token and, where one is set, a read-only "view" token. Each app answers a refusal in its own format.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from enum import Enum


class Access(str, Enum):
    DENIED = "denied"
    VIEW = "view"  # read-only: GET and HEAD
    CONTROL = "control"


READ_METHODS = frozenset({"GET", "HEAD"})


def bearer_token(header: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header; "" when absent or another scheme."""
    scheme, _, token = (header or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _same(given: str, expected: str) -> bool:
    return secrets.compare_digest(given.encode(), expected.encode())


def access(header: str | None, token: str | None, view_token: str | None = None) -> Access:
    """What a request with this Authorization header may do. With no token configured at all every
    caller has control (an open server); otherwise `token` gives control, `view_token` read access."""
    if not token and not view_token:
        return Access.CONTROL
    given = bearer_token(header)
    if given and token and _same(given, token):
        return Access.CONTROL
    if given and view_token and _same(given, view_token):
        return Access.VIEW
    return Access.DENIED


def allows(level: Access, method: str) -> bool:
    """Whether `level` may make a request with this HTTP method."""
    return level is Access.CONTROL or (level is Access.VIEW and method.upper() in READ_METHODS)


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only (where it may go without a token)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname: it may resolve to anything
        return False


def read_token(path: str | None, env_name: str, flag: str) -> str | None:
    """A secret from the file `path` (the `flag` option), else from the environment variable `env_name`;
    None when neither is given. Never from the command line, where every user of the machine sees it
    (`ps`). ValueError, in one line, for a file that cannot be read or an empty secret."""
    if path is not None:
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read {flag} {path}: {exc.strerror}") from None
        if not value:
            raise ValueError(f"{flag} {path} is empty")
        return value
    value = os.environ.get(env_name)
    if value is not None and not value.strip():
        return None  # set but empty: no token, as before
    return value.strip() if value else None
