"""CLI commands of openglm.retrieval (filled in by its issue)."""


def register(subparsers):
    return None
