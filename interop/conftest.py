"""Opt-in llama.cpp interop tests (`make interop`); outside `tests/`, so the default suite never collects them."""

import os


def pytest_addoption(parser):
    parser.addoption("--llama-cache", default=os.path.expanduser("~/.cache/openglm/llama-cpp"),
                     help="folder with the llama-cpp-python build (default: ~/.cache/openglm/llama-cpp)")
