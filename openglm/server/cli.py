"""CLI commands of openglm.server (filled in by its issue)."""


def register(subparsers):
    return None
