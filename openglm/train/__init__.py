"""openglm.train: data, tokenizer training, the trainer, telemetry, checkpoints, generation, the demo.

    from openglm.train import TrainConfig, train
    result = train(TrainConfig(out_dir="runs/x", preset="tiny", max_steps=50))

Imports are lazy so `openglm --help` stays fast.
"""

from openglm.util.lazy import lazy_exports

_EXPORTS = {
    "TrainConfig": "openglm.train.config",
    "RECIPES": "openglm.train.config",
    "train": "openglm.train.trainer",
    "Trainer": "openglm.train.trainer",
    "TrainResult": "openglm.train.trainer",
    "TrainingDiverged": "openglm.train.trainer",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
