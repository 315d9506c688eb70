"""Small helpers shared by every package (a leaf: imports nothing else of openglm).

`lazy` (lazy package exports), `files` (atomic writes), `dataclasses` (strict loading of typed
configs from dicts).
"""
