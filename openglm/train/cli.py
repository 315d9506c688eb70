"""CLI commands of openglm.train (filled in by its issue)."""


def register(subparsers):
    return None
