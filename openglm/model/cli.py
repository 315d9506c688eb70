"""CLI commands of openglm.model (filled in by its issue)."""


def register(subparsers):
    return None
