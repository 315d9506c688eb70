"""Hugging Face checkpoints: `load_model(path)` (writing them, `save_pretrained`, is save.py's; re-exported here).

Layout: config.json + model.safetensors, or shards model-0000i-of-0000n.safetensors listed in
model.safetensors.index.json. Loading treats every file as untrusted and checks, before memory-mapping
anything: the config (types, ranges, model type), the index (shards confined to the folder), each shard's
header (offsets within the file, so a truncated file is named), the dtypes (floating point only, one
checkpoint dtype except the tensors the model keeps in fp32), and the total size against available memory.
Then it reads each tensor (dequantising FP8 block-quantised weights, see fp8.py), rejects NaN/inf weights,
and names the first missing or unexpected tensor.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import psutil
import torch
from safetensors import SafetensorError, safe_open

from openglm.model import fp8, int4
from openglm.model.config import FP32_TENSORS, KEEP_FP32, ModelConfig
from openglm.model.errors import (
    CheckpointError,
    CheckpointPathError,
    CheckpointTooLargeError,
    ConfigError,
    CorruptShardError,
    MissingShardError,
    MissingTensorError,
    NonFiniteTensorError,
    TensorDTypeError,
    UnexpectedTensorError,
)
from openglm.model.families import family_of
from openglm.model.hf_names import HFNames, extra_layer, hf_name
from openglm.model.model import GlmMoeDsaForCausalLM, build_model
from openglm.model.quantized import QuantizedWeight
from openglm.model.rope import RotaryEmbedding
from openglm.model.save import INDEX, SINGLE, save_pretrained  # noqa: F401 - save_pretrained: re-exported
from openglm.util.dtypes import dtype_name
from openglm.util.files import restore_replaced_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# safetensors dtype -> (element bytes, torch dtype or None if openglm never loads it)
_ST_DTYPES = {"F64": (8, torch.float64), "F32": (4, torch.float32), "BF16": (2, torch.bfloat16),
              "F16": (2, torch.float16), "F8_E4M3": (1, torch.float8_e4m3fn), "F8_E5M2": (1, None),
              "I64": (8, None), "I32": (4, None), "I16": (2, None), "I8": (1, None), "U64": (8, None),
              "U32": (4, None), "U16": (2, None), "U8": (1, None), "BOOL": (1, None)}
_FLOAT = {"F64", "F32", "BF16", "F16"}
_ST_NAMES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}
MAX_HEADER_BYTES = 100 << 20
MAX_CONFIG_BYTES = 1 << 20  # a GLM config.json is a few KB; per-layer lists of MAX_LAYERS layers stay far below this
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
_JSON_KEY = re.compile(r'"((?:[^"\\\n]|\\.){1,200})"\s*:')


@dataclass
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def parse_quantization(qc) -> fp8.Fp8Config | int4.Int4Config | None:
    """The quantisation of a config.json's quantization_config: FP8 blocks, openglm's int4, or None."""
    if isinstance(qc, dict) and qc.get("quant_method") == int4.METHOD:
        return int4.parse(qc)
    return fp8.parse_quantization_config(qc)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder from a step folder, a run folder, or its checkpoints/ folder."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    for pointer in (p / "checkpoints" / "latest", p / "latest"):
        if pointer.is_file():
            target = pointer.parent / pointer.read_text().strip()
            restore_replaced_dir(target)  # a save killed between its renames
            if (target / "config.json").is_file():
                return target
            raise CheckpointError(f"{pointer} points at {target}, which is not a complete checkpoint")
    raise CheckpointError(f"no checkpoint at {p} (expected config.json, or checkpoints/latest in a run folder)")


def read_config_json(path) -> dict:
    """config.json of a checkpoint folder as a dict (CheckpointError naming the file if unreadable; ConfigError naming
    the key whose value makes the file larger than a config can need, read no further)."""
    restore_replaced_dir(path)  # a save killed between its renames
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise MissingShardError(f"{cfg_file}: no config.json (is {path} a Hugging Face checkpoint directory?)")
    with open(cfg_file, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        key = _last_key(raw.decode("utf-8", errors="replace"))
        raise ConfigError(f"{cfg_file}: {'the value of ' + repr(key) + ' makes ' if key else ''}the file "
                          f"{cfg_file.stat().st_size:,} bytes, more than a model config can need (at most "
                          f"{MAX_CONFIG_BYTES:,})")
    try:
        d = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({e})") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{cfg_file}: expected a JSON object, got {type(d).__name__}")
    return d


def _last_key(text: str) -> str | None:
    """The last `"key":` of a JSON text's beginning: the key whose value runs past where the text was cut."""
    keys = _JSON_KEY.findall(text)
    return keys[-1] if keys else None


def read_config(path, d: dict | None = None) -> ModelConfig:
    """The ModelConfig of a checkpoint folder (`d`: its config.json, when already read)."""
    d = read_config_json(path) if d is None else d
    try:
        return ModelConfig.from_hf_dict(d)
    except ConfigError as e:
        raise type(e)(f"{Path(path) / 'config.json'}: {e}") from None
    except TypeError as e:  # a key ModelConfig does not take in the 'openglm' section, and the like
        raise ConfigError(f"{Path(path) / 'config.json'}: {e}") from None


def shard_files(path) -> list[Path]:
    """The safetensors files of a checkpoint folder, each confined to the folder."""
    root = Path(path).resolve()
    if (root / INDEX).is_file():
        try:
            index = json.loads((root / INDEX).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{root / INDEX}: invalid JSON ({e})") from e
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CheckpointError(f"{root / INDEX}: expected {{\"weight_map\": {{tensor name: file name}}}}")
        files = [_confined(root, f) for f in dict.fromkeys(weight_map.values())]
    elif (root / SINGLE).is_file():
        files = [root / SINGLE]
    else:
        raise MissingShardError(f"{path}: neither {SINGLE} nor {INDEX} found")
    for f in files:
        if not f.is_file():
            raise MissingShardError(f"{f}: shard listed in {INDEX} is missing")
    return files


def _confined(root: Path, name: str) -> Path:
    rel = PurePosixPath(name)
    target = (root / name).resolve()
    if rel.is_absolute() or ".." in rel.parts or "\\" in name or (target != root and root not in target.parents):
        raise CheckpointPathError(f"{root / INDEX} lists shard {name!r}, which is outside the checkpoint folder "
                                  f"{root}; shards must be files inside it")
    return target


def read_header(file: Path) -> dict[str, TensorInfo]:
    """A safetensors file's tensor table, checked against the file's size without mapping it."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or n > min(size - 8, MAX_HEADER_BYTES):
            raise CorruptShardError(f"{file}: not a safetensors file or truncated ({size} bytes, header length "
                                    f"{n if n >= 0 else 'missing'})")
        try:
            meta = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptShardError(f"{file}: invalid safetensors header ({e})") from None
    if not isinstance(meta, dict):
        raise CorruptShardError(f"{file}: invalid safetensors header (not an object)")
    data_bytes = size - 8 - n
    out = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(info, dict) and info.get("dtype") in _ST_DTYPES and isinstance(info.get("shape"), list)
              and all(isinstance(d, int) and d >= 0 for d in info["shape"])
              and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
              and all(isinstance(o, int) for o in info["data_offsets"]))
        if not ok:
            raise CorruptShardError(f"{file}: tensor {name!r} has an invalid header entry {info!r}")
        t = TensorInfo(file, info["dtype"], tuple(info["shape"]))
        begin, end = info["data_offsets"]
        if not 0 <= begin <= end <= data_bytes or end - begin != t.numel * _ST_DTYPES[t.dtype][0]:
            raise CorruptShardError(f"{file}: tensor {name!r} needs bytes {begin}..{end} of {data_bytes} "
                                    "(the file is truncated or its header is wrong)")
        out[name] = t
    return out


def read_headers(files: list[Path]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        for name, info in read_header(f).items():
            if name in tensors:
                raise CorruptShardError(f"tensor {name!r} is stored twice: in {tensors[name].file} and {f}")
            tensors[name] = info
    return tensors


def checkpoint_dtype(tensors: dict[str, TensorInfo], declared: str | None,
                     quant: fp8.Fp8Config | int4.Int4Config | None) -> torch.dtype:
    """The one floating dtype of the checkpoint's weights (TensorDTypeError naming the first tensor that breaks
    the rules): floating tensors only; FP8 e4m3 only for weights with a block scale in an FP8 checkpoint; uint8
    codes only for weights with their bf16 scales in an int4 checkpoint; every other tensor in the dtype
    config.json declares (else that of the other tensors), except the tensors the model keeps in fp32, which may
    be fp32."""
    plain = {}
    is_int4 = isinstance(quant, int4.Int4Config)
    for name, t in tensors.items():
        if is_int4 and (t.dtype == "U8" or name.endswith(int4.SCALE_SUFFIX)):
            codes = name.removesuffix(int4.SCALE_SUFFIX)
            if codes not in tensors or tensors[codes].dtype != "U8" or codes + int4.SCALE_SUFFIX not in tensors:
                raise TensorDTypeError(f"tensor {name!r} in {t.file}: an int4 weight is uint8 codes NAME with bf16 "
                                       f"scales NAME{int4.SCALE_SUFFIX}, and one of the pair is missing")
            continue
        if name.endswith(fp8.SCALE_SUFFIX):
            base = tensors.get(name.removesuffix(fp8.SCALE_SUFFIX))
            if quant is None or base is None or base.dtype != "F8_E4M3" or t.dtype not in ("F32", "BF16"):
                raise TensorDTypeError(f"tensor {name!r} in {t.file}: a block scale needs an FP8 checkpoint "
                                       "(quantization_config) and an e4m3 weight of the same name")
        elif t.dtype == "F8_E4M3":
            if quant is None or name + fp8.SCALE_SUFFIX not in tensors:
                raise TensorDTypeError(f"tensor {name!r} in {t.file} is float8_e4m3 without "
                                       f"{'a quantization_config' if quant is None else name + fp8.SCALE_SUFFIX}")
        elif t.dtype not in _FLOAT:
            raise TensorDTypeError(f"tensor {name!r} in {t.file} has dtype {t.dtype}: checkpoint weights must be "
                                   "floating point (float32, bfloat16, float16)")
        else:
            plain[name] = t
    if declared is not None and declared not in DTYPES:
        raise ConfigError(f"config.json dtype={declared!r} is not one of {', '.join(DTYPES)}")
    counts = Counter(t.dtype for name, t in plain.items() if not name.endswith(FP32_TENSORS))
    main = {v: k for k, v in _ST_NAMES.items()}[declared] if declared else (
        counts.most_common(1)[0][0] if counts else "BF16")
    for name, t in plain.items():
        if t.dtype != main and not (t.dtype == "F32" and name.endswith(FP32_TENSORS)):
            why = f"config.json declares dtype {declared}" if declared else f"the other tensors are {_ST_NAMES[main]}"
            raise TensorDTypeError(f"tensor {name!r} in {t.file} is {_ST_NAMES.get(t.dtype, t.dtype)}, but {why}: "
                                   "a checkpoint holds one dtype")
    return _ST_DTYPES[main][1]


def load_model(path, dtype: torch.dtype | str | None = None, device: str = "cpu",
               max_memory: int | None = None) -> GlmMoeDsaForCausalLM:
    """Load a Hugging Face checkpoint directory (glm_moe_dsa, glm4_moe, glm4_moe_lite, glm5_next; bf16/fp16/fp32 or
    FP8 block-quantised) into GlmMoeDsaForCausalLM (or its family's subclass; eval mode). `dtype`: the weights'
    dtype (default: the checkpoint's; bf16/bfloat16, fp16/float16, fp32/float32 or a torch dtype). Every bad input
    raises a ModelError subclass naming the key, tensor or file; running out of memory anyway is
    CheckpointTooLargeError, one line."""
    try:
        return _load(path, dtype, device, max_memory)
    except CheckpointTooLargeError:
        raise
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        detail = f" ({' '.join(str(e).split())[-160:]})" if str(e) else ""
        raise CheckpointTooLargeError(f"ran out of memory loading checkpoint {path}{detail}: pick a smaller dtype "
                                      "(--dtype bf16), a quantised checkpoint, or a machine with more memory") from None


def out_of_memory(e: BaseException) -> bool:
    """Python's MemoryError, or torch's allocator failing (a RuntimeError on the CPU, OutOfMemoryError on a GPU)."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)


def _load(path, dtype, device, max_memory) -> GlmMoeDsaForCausalLM:
    raw = read_config_json(path)
    cfg = read_config(path, raw)
    quant = parse_quantization(raw.get("quantization_config"))
    if isinstance(dtype, str):
        try:
            dtype = DTYPES[dtype_name(dtype)]
        except ValueError as e:
            raise ConfigError(str(e)) from None
    files = shard_files(path)
    tensors = read_headers(files)
    names = family_of(cfg.model_type).hf_names.reading(tensors)
    check_sizes_against_weights(Path(path), cfg, tensors, names)  # before a model of the config's sizes is built
    declared = raw.get("dtype", raw.get("torch_dtype"))
    if declared is not None and not isinstance(declared, str):
        raise ConfigError(f"config.json dtype={declared!r} must be a string")
    # The dtype rules hold whatever dtype is asked for (tensors kept as stored are not the model's: not checked).
    stored = checkpoint_dtype({k: t for k, t in tensors.items() if not names.is_kept(k)}, declared, quant)
    target = dtype or stored
    _check_memory(Path(path), tensors, target, max_memory)
    n, nextn = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    mtp_found = {extra_layer(names.from_disk(k), n, nextn) for k in tensors if not names.is_kept(k)} - {None}
    if not mtp_found:  # a checkpoint without its next-n layers (transformers drops them): a model without them
        cfg = cfg.replace(num_nextn_predict_layers=0)
    with ExitStack() as stack:
        handles = {}
        for f in files:
            try:
                h = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            except (SafetensorError, OSError) as e:
                raise CorruptShardError(f"{f}: cannot open ({e})") from None
            handles.update({k: (h, f) for k in h.keys()})
        model, used = _fill(cfg, path, handles, quant, target, device, names)
        if isinstance(quant, int4.Int4Config):
            model._quantization = "int4"
        extra = [k for k in handles if k not in used]
        if extra:
            raise UnexpectedTensorError(f"checkpoint {path} has tensor(s) the config does not use: {extra[:5]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if hasattr(model.model, "rotary_emb"):
        model.model.rotary_emb = RotaryEmbedding(cfg).to(device)  # non-persistent buffer: rebuild off meta
    return model.eval()


def check_sizes_against_weights(path: Path, cfg: ModelConfig, tensors: dict[str, TensorInfo],
                                names: HFNames) -> None:
    """The config's layer count, expert count and embedding shape against the tensors the headers list (ConfigError
    naming the key): a config that names more of them than the weights hold is refused before anything is built
    per layer or per expert. `names`: the family's on-disk names (a multimodal checkpoint's text model sits under
    a prefix)."""
    layers, experts, text = set(), {}, {}
    for disk_name, info in tensors.items():
        name = names.from_disk(disk_name)
        text[name] = info
        m = _EXPERT.match(name)
        if m:
            layer, e = int(m.group(1)), int(m.group(2))
            experts[layer] = max(experts.get(layer, 0), e + 1)
        m = _LAYER.match(name)
        if m:
            layers.add(int(m.group(1)))
    where = f"{path / 'config.json'}"
    n = cfg.num_hidden_layers
    if n - 1 not in layers:
        held = f"layers 0..{max(layers)}" if layers else "no decoder layer"
        raise ConfigError(f"{where}: num_hidden_layers={n}, but the weights hold {held}")
    for layer in cfg.moe_layers:
        stacked = text.get(f"model.layers.{layer}.mlp.experts.gate_up_proj")
        count = stacked.shape[0] if stacked is not None and stacked.shape else experts.get(layer)
        if count is not None and count != cfg.n_routed_experts:
            raise ConfigError(f"{where}: n_routed_experts={cfg.n_routed_experts}, but layer {layer}'s weights hold "
                              f"{count} experts")
    embed = text.get("model.embed_tokens.weight")
    if embed is not None and embed.shape != (cfg.vocab_size, cfg.hidden_size):
        raise ConfigError(f"{where}: vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}, but "
                          f"model.embed_tokens.weight is {list(embed.shape)}")


def _fill(cfg, path, handles, quant, target, device, names: HFNames):
    """Build the model on meta and assign every tensor from the checkpoint; returns (model, names used)."""

    is_int4 = isinstance(quant, int4.Int4Config)

    def get(k):
        h, f = handles[k]
        try:
            t = h.get_tensor(k)
            if is_int4 and k + int4.SCALE_SUFFIX in handles:
                return int4.weight(k, t, handles[k + int4.SCALE_SUFFIX][0].get_tensor(k + int4.SCALE_SUFFIX), quant,
                                   target, str(f))
            if isinstance(quant, fp8.Fp8Config) and k + fp8.SCALE_SUFFIX in handles:
                scale = handles[k + fp8.SCALE_SUFFIX][0].get_tensor(k + fp8.SCALE_SUFFIX)
                t = fp8.dequantize(t, scale, quant.block, k)
        except SafetensorError as e:
            raise CorruptShardError(f"{f}: cannot read tensor {k!r} ({e})") from None
        if not torch.isfinite(t).all():
            raise NonFiniteTensorError(f"tensor {k!r} in {f} holds NaN or infinite values")
        return t

    with torch.device("meta"):
        model = build_model(cfg)
    state, quantized, used = {}, {}, set()
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        try:
            t, read = names.load_native(hf_name(name, cfg.num_hidden_layers), p.shape, lambda k: get(names.disk(k)),
                                        lambda k: names.disk(k) in handles)
        except KeyError as e:
            raise MissingTensorError(f"checkpoint {path} lacks tensor {names.disk(e.args[0])!r}") from None
        read = [names.disk(k) for k in read]
        used.update(read)
        used.update(k + s for k in read for s in (fp8.SCALE_SUFFIX, int4.SCALE_SUFFIX) if k + s in handles)
        if isinstance(t, QuantizedWeight):  # int4, read in place by the kernels: held as it is stored
            quantized[name] = t
            continue
        keep_fp32 = name.endswith(KEEP_FP32)
        state[name] = t.to(device=device, dtype=torch.float32 if keep_fp32 else target)
    for k in handles:
        if names.is_kept(k):  # as stored: no dequantisation, no cast, written back byte for byte
            try:
                model.vision_extra[k] = handles[k][0].get_tensor(k)
            except SafetensorError as e:
                raise CorruptShardError(f"{handles[k][1]}: cannot read tensor {k!r} ({e})") from None
            used.add(k)
            continue
        i = extra_layer(names.from_disk(k), cfg.num_hidden_layers, cfg.num_nextn_predict_layers)
        if i is not None and k.endswith(names.nextn_copies) and k not in used:
            model.mtp_extra[k] = get(k).to(device=device, dtype=target)
            used.update([k, k + fp8.SCALE_SUFFIX])
    if quant is not None and names.kept:  # what the source said of the tensors kept as stored, for an FP8 save
        model.kept_not_convert = [m for m in quant.modules_to_not_convert if names.is_kept(m)]
    for name, t in quantized.items():  # buffers under the parameters' names, as engine/quant.py holds them
        module, _, attr = name.rpartition(".")
        owner = model.get_submodule(module)
        delattr(owner, attr)
        owner.register_buffer(attr, t, persistent=False)
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=True)
    return model, used


def _check_memory(path: Path, tensors: dict[str, TensorInfo], dtype: torch.dtype, max_memory) -> None:
    """Refuse up front (from the headers, before mapping any file) when the weights would not fit."""
    size = torch.empty((), dtype=dtype).element_size()
    # int4 codes and their scales are held as stored; every other weight in `dtype`
    need = sum(t.numel * (_ST_DTYPES[t.dtype][0] if t.dtype == "U8" or name.endswith(int4.SCALE_SUFFIX) else size)
               for name, t in tensors.items() if not name.endswith(fp8.SCALE_SUFFIX))
    avail = max_memory if max_memory is not None else psutil.virtual_memory().available
    if need > avail:
        raise CheckpointTooLargeError(
            f"checkpoint {path} needs {need / 2**30:.2f} GiB of weights but only "
            f"{avail / 2**30:.2f} GiB of memory is available; refusing to load (pick a smaller dtype or machine)")
