"""openglm.train: data, tokenizer training, the trainer, telemetry, checkpoints, generation, the demo.

    from openglm.train import TrainConfig, train
    result = train(TrainConfig(out_dir="runs/x", preset="tiny", max_steps=50))

Imports are lazy so `openglm --help` stays fast.
"""

_LAZY = {"TrainConfig": "openglm.train.config", "RECIPES": "openglm.train.config", "train": "openglm.train.trainer",
         "Trainer": "openglm.train.trainer", "TrainResult": "openglm.train.trainer",
         "TrainingDiverged": "openglm.train.trainer"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'openglm.train' has no attribute {name!r}")
