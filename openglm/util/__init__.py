"""Small helpers shared by every package (a leaf: imports nothing else of openglm).

`lazy` (lazy package exports), `files` (atomic writes), `strict` (strict loading of typed configs
from dicts), `ports` (default ports shared by servers and clients), `proc` (running a command with a
timeout that kills its process group), `git` (every git call, one patch-apply), `auth` (bearer tokens).
"""
