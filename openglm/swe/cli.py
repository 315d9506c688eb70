"""CLI commands of openglm.swe (filled in by its issue)."""


def register(subparsers):
    return None
