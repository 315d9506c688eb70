"""CLI commands of openglm.agent (filled in by its issue)."""


def register(subparsers):
    return None
