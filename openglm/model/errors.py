"""Exceptions of openglm.model: each names the offending key, tensor or file."""

from __future__ import annotations


class ModelError(Exception):
    """Base class of every error raised by openglm.model."""


class ConfigError(ModelError, ValueError):
    """A config value is unknown, inconsistent, or one the code cannot honour."""


class UnknownModelTypeError(ConfigError):
    """config.json names a `model_type` other than `glm_moe_dsa`."""


class CheckpointError(ModelError, ValueError):
    """A checkpoint directory cannot be read or written, or does not fit the current run."""


class MissingShardError(CheckpointError, FileNotFoundError):
    """A file listed in the index (or config.json itself) is absent."""


class MissingTensorError(CheckpointError, KeyError):
    """The checkpoint lacks a tensor the model needs."""

    def __str__(self):  # KeyError would repr() the message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnexpectedTensorError(CheckpointError, KeyError):
    """The checkpoint has a tensor the model does not know."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(CheckpointError, ValueError):
    """A tensor's shape differs from the one the config implies."""


class CheckpointTooLargeError(CheckpointError, MemoryError):
    """Loading would need more memory than is available (refused before reading)."""


class TokenIdError(ModelError, IndexError):
    """input_ids contain ids outside [0, vocab_size)."""


class CorruptShardError(CheckpointError, ValueError):
    """A safetensors file is truncated or its header is invalid (names the file and tensor)."""


class CheckpointPathError(CheckpointError, ValueError):
    """The index lists a shard outside the checkpoint folder (absolute path, `..`, or a symlink out)."""


class TensorDTypeError(CheckpointError, TypeError):
    """A tensor is not floating point, or not in the checkpoint's one dtype."""


class NonFiniteTensorError(CheckpointError, ValueError):
    """A weight holds NaN or infinity."""


class QuantizationError(CheckpointError, ValueError):
    """quantization_config, or an FP8 weight / block scale, that openglm cannot read."""
