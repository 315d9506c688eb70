"""A tiny project with one injected bug, for the docs' SWE and retrieval examples."""


def add(a, b):
    """Return the sum of a and b."""
    return a - b  # the bug: should be a + b


def mean(values):
    """Arithmetic mean of a non-empty list."""
    total = 0
    for v in values:
        total = add(total, v)
    return total / len(values)
