"""Compile openglm's Triton kernels ahead of time for NVIDIA GPUs, on a machine without one.

Triton's compiler (Python -> TTIR -> TTGIR -> LLVM -> PTX) runs on the CPU, and the triton wheel bundles ptxas
and cuobjdump, so each kernel can be built into a cubin for sm_80 (A100) or sm_90 (H100/H200) here, with the
tile sizes its launcher picks at GLM-5's widths, and its resource use read back: registers per thread, local
memory (spills) and shared memory. Run with TRITON_INTERPRET unset (the kernels must be defined as compiled
kernels); prints one JSON object per line. `tests/kernels/test_compile.py` runs it for sm_90;

    env -u TRITON_INTERPRET .venv/bin/python tests/kernels/aot_compile.py --all 80 90

compiles every configuration for both.

Argument values stand in for a launch: pointers are aligned (divisibility 16, as a fresh allocation is) and
integer arguments divisible by 16 get the same hint, which is how Triton specialises a real launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from openglm.kernels import dsa, moe

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
GLM5 = dict(hidden=6144, inter=2048, experts=256, top_k=8, heads=64, rank=512, rope=64, index_heads=32,
            index_dim=128, topk=2048, keys=32768, page=64)


def compile_one(job: tuple) -> dict:
    name, label, arch, args, constexprs, options = job
    fn = {"_gate_up_kernel": moe._gate_up_kernel, "_down_kernel": moe._down_kernel,
          "_index_scores_kernel": dsa._index_scores_kernel, "_sparse_mla_kernel": dsa._sparse_mla_kernel}[name]
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
            continue
        value = args[arg]
        if isinstance(value, str):  # a pointer: "*bf16", ...
            signature[arg] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32" if abs(value) < 2 ** 31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    t0 = time.perf_counter()
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(kv.split(":", 1) for kv in next(ln for ln in usage.splitlines() if "REG:" in ln).split() if ":" in kv)
    return {"kernel": name, "config": label, "arch": f"sm_{arch}", "registers": int(fields["REG"]),
            "spill_bytes": int(fields["STACK"]) + int(fields.get("LOCAL", 0)), "shared_bytes": kernel.metadata.shared,
            "seconds": round(time.perf_counter() - t0, 2)}


def moe_jobs(arch: int, label: str, n_tokens: int, quant: bool) -> list[tuple]:
    g = GLM5
    m = n_tokens * g["top_k"]
    t = moe.choose_tiles(m, g["experts"], torch.bfloat16, 128 if quant else None)
    w = "*fp8e4nv" if quant else "*bf16"
    scale = dict(s_ptr="*fp32", stride_se=32 * 48, stride_sn=48, stride_sk=1, SB_N=128, SB_K=128) if quant else \
        dict(s_ptr="*bf16", stride_se=0, stride_sn=0, stride_sk=0, SB_N=1, SB_K=1)
    common = dict(w_ptr=w, ids_ptr="*i32", expert_ptr="*i32", M=m, TOP_K=g["top_k"], **scale)
    options = dict(num_warps=t.num_warps, num_stages=t.num_stages)
    gate_up = dict(common, x_ptr="*bf16", stride_x=g["hidden"], stride_we=2 * g["inter"] * g["hidden"],
                   stride_wn=g["hidden"], act_ptr="*bf16", stride_act=g["inter"], INTER=g["inter"], HIDDEN=g["hidden"])
    down = dict(common, act_ptr="*bf16", stride_act=g["inter"], stride_we=g["hidden"] * g["inter"],
                stride_wn=g["inter"], route_ptr="*fp32", out_ptr="*fp32", stride_out=g["hidden"],
                HIDDEN=g["hidden"], INTER=g["inter"])
    ce = dict(QUANT=quant, EVEN_K=True, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
              DOT_DTYPE=tl.bfloat16, PRECISION="tf32")
    tiles = f"{label} {'fp8 128x128' if quant else 'bf16'} {t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps}"
    return [("_gate_up_kernel", tiles, arch, gate_up, ce, options), ("_down_kernel", tiles, arch, down, ce, options)]


def dsa_jobs(arch: int, dtype: torch.dtype) -> list[tuple]:
    g = GLM5
    hi, di, d = g["index_heads"], g["index_dim"], g["rank"] + g["rope"]
    config = dsa.index_config(hi, di, dtype)
    qtype = "*fp32" if dtype == torch.float32 else "*bf16"
    index_args = dict(q_ptr=qtype, stride_qb=hi * di, stride_qt=hi * di, stride_qh=di, w_ptr="*fp32", stride_wb=hi,
                      stride_wt=hi, k_ptr="*bf16", stride_k=di, table_ptr="*i32", stride_table=g["keys"] // g["page"],
                      page=g["page"], valid_ptr="*fp32", stride_valid=0, out_ptr="*fp32", stride_ob=g["keys"],
                      stride_ot=g["keys"], NQ=32, N_KEYS=g["keys"], FIRST=g["keys"] - 1, HI=hi, DI=di)
    options = {k: config.pop(k) for k in ("num_warps", "num_stages")}
    name = "fp32 products (tf32x3)" if dtype == torch.float32 else "bf16 products"
    jobs = [("_index_scores_kernel", name, arch, index_args, dict(config, HAS_VALID=False), options)]
    att = dsa.attention_config(g["rank"], g["rope"], dtype)
    options = {k: att.pop(k) for k in ("num_warps", "num_stages")}
    ptr = "*fp32" if dtype == torch.float32 else "*bf16"
    att_args = dict(q_ptr=ptr, stride_qb=g["heads"] * d, stride_qt=g["heads"] * d, stride_qh=d, kv_ptr=ptr, pe_ptr=ptr,
                    stride_kv=g["rank"], stride_pe=g["rope"], table_ptr="*i32", stride_table=g["keys"] // g["page"],
                    page=g["page"], slot_ptr="*i32", stride_sb=g["topk"], stride_st=g["topk"], o_ptr=ptr,
                    stride_ob=g["heads"] * g["rank"], stride_ot=g["heads"] * g["rank"], stride_oh=g["rank"], T=3,
                    H=g["heads"], K=g["topk"], scale_log2=0.1)
    jobs.append(("_sparse_mla_kernel", "fp32" if dtype == torch.float32 else "bf16", arch, att_args, att, options))
    return jobs


def jobs(archs: list[int], every: bool) -> list[tuple]:
    """The bf16 serving path (experts for decode and prefill, both indexer precisions a bf16 model uses, bf16
    attention, FP8 experts for prefill); with `every`, also fp32 attention and FP8 experts for decode."""
    out = []
    for arch in archs:
        out += moe_jobs(arch, "decode", 32, False) + moe_jobs(arch, "prefill", 4096, False)
        index_fp32, attention_fp32 = dsa_jobs(arch, torch.float32)
        out += dsa_jobs(arch, torch.bfloat16) + [index_fp32] + ([attention_fp32] if every else [])
        if arch >= 89:  # e4m3 conversions need sm_89+
            out += moe_jobs(arch, "prefill", 4096, True) + (moe_jobs(arch, "decode", 32, True) if every else [])
    return out


def main(argv: list[str]) -> int:
    """argv: [--all] [ARCH ...] (default: sm_90)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("aot_compile: unset TRITON_INTERPRET (the kernels must be defined as compiled kernels)", file=sys.stderr)
        return 2
    every = "--all" in argv
    archs = [int(a) for a in argv if a != "--all"] or [90]
    with ProcessPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        for result in pool.map(compile_one, jobs(archs, every)):
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
