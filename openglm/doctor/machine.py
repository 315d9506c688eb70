"""The machine: torch build, CPU instruction sets, the native kernels (a C compiler, built or not), threads against
cores, and memory against a model's weights at each dtype.

`probe()` gathers the facts; `check_machine(facts, params)` judges them, so a test can hand it any machine.
"""

from __future__ import annotations

import os
import platform
import shutil
import warnings
from dataclasses import dataclass, field
from importlib import metadata

import psutil
import torch

from openglm.doctor.report import Check, error, info, ok, warn
from openglm.model import native

GIB = 2**30
# bytes per weight: what `openglm serve --dtype` keeps resident (fp8/int8 weights are quantised after loading)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "int8/fp8": 1}
BUSY_LOAD = 1.5  # a load average above this many times the cores: other jobs hold the CPU


@dataclass
class MachineFacts:
    torch_version: str
    torch_pin: str | None  # the version openglm is tested with (its requirement), if pinned
    cuda: str | None  # the CUDA version torch was built for (None: a CPU build)
    gpus: int
    cpu: str
    flags: set[str] = field(default_factory=set)  # /proc/cpuinfo flags
    capability: str = ""  # torch's CPU kernel level: DEFAULT, AVX2, AVX512, AVX512_BF16, AMX ...
    compiler: str | None = None  # path of $CC (or cc), None when not on PATH
    cc_name: str = "cc"
    native_disabled: str | None = None  # the variable that turned the native kernels off
    native_built: dict[str, bool] = field(default_factory=dict)  # "decode"/"dsa" -> the library loaded
    native_warning: str = ""
    threads: int = 1
    cores: int = 1
    load: float = 0.0
    memory_total: int = 0
    memory_available: int = 0


def probe(env=None, build_kernels: bool = True) -> MachineFacts:
    """This machine's facts. `build_kernels`: compile (or load from the cache) the native kernels to see that they
    work (about a second the first time)."""
    env = os.environ if env is None else env
    cc = env.get("CC", "cc")
    disabled = next((k for k in ("OPENGLM_NATIVE", "OPENGLM_DECODE_NATIVE", "OPENGLM_DSA_NATIVE")
                     if env.get(k) == "0"), None)
    facts = MachineFacts(torch_version=torch.__version__, torch_pin=_torch_pin(), cuda=torch.version.cuda,
                         gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0, cpu=_cpu_name(),
                         flags=_cpu_flags(), capability=torch.backends.cpu.get_cpu_capability(),
                         compiler=shutil.which(cc), cc_name=cc, native_disabled=disabled,
                         threads=torch.get_num_threads(), cores=_cores(), load=os.getloadavg()[0],
                         memory_total=psutil.virtual_memory().total,
                         memory_available=psutil.virtual_memory().available)
    if build_kernels and facts.compiler and not disabled:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            facts.native_built = {"decode": native.decode_kernels() is not None,
                                  "dsa": native.dsa_kernels() is not None}
        facts.native_warning = " ".join(str(w.message) for w in caught if "native" in str(w.message))[:400]
    return facts


def check_machine(f: MachineFacts, params: int | None = None, model: str = "") -> list[Check]:
    """The machine's checks; with `params` (a model's parameter count), its weights against the memory."""
    out = [_torch(f), _isa(f), *_native(f), *_threads(f)]
    if params:
        out.append(check_memory(params, f.memory_available, f.memory_total, model))
    else:
        out.append(ok("machine.memory", f"memory: {size(f.memory_available)} available of {size(f.memory_total)}",
                      available=f.memory_available, total=f.memory_total))
    return out


def _torch(f: MachineFacts) -> Check:
    build = f"CUDA {f.cuda} build, {f.gpus} GPU(s)" if f.cuda else "CPU build"
    text = f"torch {f.torch_version} ({build})"
    if f.torch_pin and f.torch_version.split("+")[0] != f.torch_pin:
        return warn("machine.torch", f"{text}, but openglm is tested with torch {f.torch_pin}",
                    f"pip install torch=={f.torch_pin} --index-url https://download.pytorch.org/whl/cpu (the CPU "
                    "wheel; a CUDA wheel on a machine without a GPU only adds gigabytes)",
                    version=f.torch_version, pinned=f.torch_pin)
    if f.cuda and not f.gpus:
        return info("machine.torch", f"{text}: no GPU is visible, so everything runs on the CPU",
                    version=f.torch_version)
    return ok("machine.torch", text, version=f.torch_version, cuda=f.cuda)


def _isa(f: MachineFacts) -> Check:
    has = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"),
                                   ("avx512_vnni", "VNNI"), ("amx_bf16", "AMX-BF16")) if flag in f.flags]
    text = f"CPU: {f.cpu}; {', '.join(has) or 'no AVX2'}; torch kernels at {f.capability}"
    data = {"cpu": f.cpu, "isa": has, "capability": f.capability}
    if f.flags and "avx2" not in f.flags and platform.machine() in ("x86_64", "AMD64"):
        return warn("machine.isa", text + ": without AVX2 every matmul runs the slow generic kernels",
                    "run on a CPU with AVX2 (any x86 server since 2015) or AVX-512", **data)
    if f.flags and not {"avx512_bf16", "amx_bf16"} & f.flags:
        return info("machine.isa", text + ": no bf16 instructions, so bf16 matmuls are converted and may be no "
                    "faster than fp32 (compare --dtype float32 and bfloat16 here)", **data)
    return ok("machine.isa", text, **data)


def _native(f: MachineFacts) -> list[Check]:
    if f.native_disabled:
        return [info("machine.native_kernels", f"native kernels: off ({f.native_disabled}=0), decoding and DSA run "
                     "torch ops", f"unset {f.native_disabled} for the compiled kernels")]
    if f.compiler is None:
        return [warn("machine.compiler", f"no C compiler ({f.cc_name!r} is not on PATH): openglm's native decode and "
                     "DSA kernels cannot be built, so decoding runs torch ops (about 2x slower at batch 1)",
                     "install one (Debian/Ubuntu: apt-get install gcc; the Dockerfile does) or point $CC at it",
                     compiler=None)]
    out = [ok("machine.compiler", f"C compiler: {f.compiler}", compiler=f.compiler)]
    if f.native_built and not all(f.native_built.values()):
        failed = ", ".join(k for k, v in f.native_built.items() if not v)
        out.append(error("machine.native_kernels", f"native kernels failed to build: {failed} "
                         f"({f.native_warning or 'no detail'})",
                         "check that the compiler works (`cc --version`) and $OPENGLM_CFLAGS; meanwhile the torch-op "
                         "path runs (slower)", built=f.native_built))
    elif f.native_built:
        out.append(ok("machine.native_kernels", "native kernels: decode and DSA built and loaded",
                      built=f.native_built))
    return out


def _threads(f: MachineFacts) -> list[Check]:
    data = {"threads": f.threads, "cores": f.cores, "load": round(f.load, 2)}
    out = []
    if f.threads > f.cores:
        out.append(warn("machine.threads", f"torch uses {f.threads} threads on {f.cores} available cores: the threads "
                        "wait on each other", f"--threads {f.cores} (or OMP_NUM_THREADS={f.cores})", **data))
    else:
        out.append(ok("machine.threads", f"torch uses {f.threads} threads on {f.cores} available cores", **data))
    if f.load > BUSY_LOAD * f.cores:
        out.append(warn("machine.load", f"the machine is busy: load average {f.load:.1f} on {f.cores} cores, so "
                        "timings (the demo's calibration, benchmarks) will be off and extra threads only spin",
                        "run when it is quieter, or with --threads 1 on a shared box", **data))
    return out


def check_memory(params: int, available: int, total: int, model: str = "") -> Check:
    """A model's weights at each dtype against the memory available (what `serve --dtype` keeps resident)."""
    need = {dtype: params * b for dtype, b in DTYPE_BYTES.items()}
    table = ", ".join(f"{size(need[d])} {d}" for d in DTYPE_BYTES)
    text = (f"{model + ' ' if model else ''}weights ({count(params)} parameters): {table}; "
            f"{size(available)} available of {size(total)}")
    data = {"params": params, "need_bytes": need, "available": available, "total": total}
    if need["bfloat16"] > available:
        return error("machine.memory", text + ": too big to load here at any dtype openglm keeps resident",
                     "a machine with more memory, tensor/expert parallelism across machines (docs/scaling.md), or "
                     "a GPU engine with the FP8 checkpoint (`openglm deploy`)", **data)
    if need["float32"] > available:
        return warn("machine.memory", text + ": fits in bfloat16 only", "serve with --dtype bf16 (add "
                    "--quantization int8 to halve the weights again after loading)", **data)
    return ok("machine.memory", text, **data)


def size(n: float) -> str:
    return f"{n / GIB:,.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:,.1f} MiB"


def count(n: float) -> str:
    return f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M" if n >= 1e6 else f"{n:,.0f}"


def _torch_pin() -> str | None:
    try:
        reqs = metadata.requires("openglm") or []
    except metadata.PackageNotFoundError:
        return None
    pin = next((r.split("==", 1)[1].split(";")[0].strip() for r in reqs if r.replace(" ", "").startswith("torch==")),
               None)
    return pin


def _cpu_info() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read(1 << 20).splitlines()
    except OSError:
        return []


def _cpu_name() -> str:
    line = next((x for x in _cpu_info() if x.startswith("model name")), "")
    return line.split(":", 1)[1].strip() if line else (platform.processor() or platform.machine())


def _cpu_flags() -> set[str]:
    line = next((x for x in _cpu_info() if x.startswith("flags")), "")
    return set(line.split(":", 1)[1].split()) if line else set()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
