"""The training recipe as a typed dataclass; named recipes are data in `RECIPES`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from openglm.util.dtypes import SHORT, dtype_name
from openglm.util.strict import from_dict


@dataclass
class TrainConfig:
    # where and what
    out_dir: str = "runs/train"
    data: str = "stdlib"  # "stdlib", a folder of text/code files, or a .jsonl with a "text" field
    preset: str = "small"  # ModelConfig preset
    model_overrides: dict = field(default_factory=dict)  # ModelConfig fields to override
    tokenizer: str | None = None  # folder with tokenizer.json; None: train one on the corpus
    vocab_size: int | None = None  # tokenizer size when training one; None: the preset's vocab_size
    val_fraction: float = 0.05
    # batch: every optimizer step sees batch_size * grad_accum * world_size sequences of seq_len tokens
    seq_len: int = 256
    batch_size: int = 8  # micro-batch per process
    grad_accum: int = 1
    # optimisation
    max_steps: int = 200
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global-norm clipping; 0 = off
    dtype: str = "bf16"  # autocast compute dtype: bf16 or fp32 (also bfloat16, float32); weights, optimizer stay fp32
    activation_checkpointing: int = 0  # recompute activations, keeping one of every k layers; 0 = off
    mtp_loss_weight: float = 0.3  # weight of the next-n (MTP) layer's loss on token t+2 (DeepSeek-V3's 0.3); 0 = off
    router_bias_rate: float = 1e-3  # aux-loss-free balancing: per-step nudge of the routers' score bias
    offload_optimizer: bool = False  # keep AdamW state on the CPU when training on an accelerator
    device: str = "cpu"
    parallel: str = ""  # "dp=N,ep=M": FSDP2 over N ranks + experts split M ways (under torchrun); "": DDP-style
    threads: int | None = None  # torch CPU threads; None: torch's default (all cores)
    seed: int = 0
    # telemetry and checkpoints
    log_every: int = 10
    eval_every: int = 50
    eval_windows: int = 32  # validation sequences per evaluation
    save_every: int = 100
    keep_checkpoints: int = 2
    collapse_share: float = 0.9  # an expert chosen by more than this fraction of tokens ...
    collapse_patience: int = 3  # ... for this many consecutive log intervals triggers the warning
    time_budget_s: float | None = None  # stop early (with a checkpoint) after this much training time
    progress: bool = True
    plots: bool = True

    def __post_init__(self):
        self.dtype = SHORT[dtype_name(self.dtype, ("bfloat16", "float32"), "TrainConfig.dtype")]  # bf16 or fp32
        for name in ("seq_len", "batch_size", "grad_accum", "max_steps", "log_every", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return from_dict(cls, d, "TrainConfig field(s)")

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


# Fields that must match when resuming (the rest, e.g. max_steps or log_every, may change).
RESUME_MUST_MATCH = ("data", "seq_len", "batch_size", "grad_accum", "seed", "val_fraction")

# Named recipes (data). "demo" is what `openglm demo` runs: small preset, stdlib, a few minutes on 2 cores.
RECIPES: dict[str, dict] = {
    # seq_len 128 = the small preset's index_topk: DSA attention is then exactly dense (and fastest on CPU);
    # a 4096-token BPE halves the LM-head cost of the preset's 8192 at ~9% more tokens per file.
    "demo": dict(preset="small", data="stdlib", vocab_size=4096, seq_len=128, batch_size=16, grad_accum=1,
                 max_steps=1500, lr=3e-3, warmup_steps=30, min_lr_ratio=0.1, dtype="bf16", router_bias_rate=1e-2,
                 log_every=10, eval_every=100, eval_windows=64, save_every=100, out_dir="runs/demo"),
}
