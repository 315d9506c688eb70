"""openglm.deploy: how a server is started. A deployment (`DeployConfig`: deploy.yaml, or `openglm serve`'s
flags) becomes the engine's config (`engine_config`), an engine on one process or on torchrun ranks, and a
running server (`launch.serve`), or the equivalent vLLM / SGLang launch (`handoff`).

Nothing in the package graph imports it but the entry point (openglm/cli.py).
"""
