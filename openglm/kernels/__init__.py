"""GPU kernels (Triton) for the two hot spots of a GLM-5 layer, as plain tensor-in / tensor-out functions.

- `kernels.moe.fused_experts`: the routed experts as two grouped GEMMs over the expert-sorted (token, expert)
  assignments, with the epilogues fused: SiLU(gate) * up after the first, the routing-weight scale and the
  scatter-add into the output after the second. bf16 / fp32 weights, or int8 / FP8 (e4m3) weights with block
  scales (the GLM FP8 checkpoints' 128 x 128 blocks, or one scale per row as `--quantization` stores them).
- `kernels.dsa`: DeepSeek sparse attention on MLA's latent cache: the lightning indexer's scores (heads summed
  in the kernel, never materialised per head) with the top-k on the device, and attention over each query's
  selected latent rows (online softmax, fp32 accumulation), both reading the cache through a block table,
  which covers the engine's paged pool and a contiguous cache alike.

Importing `openglm.kernels.moe` or `.dsa` imports `triton` (the optional `gpu` extra); nothing on the CPU path
imports them (the model's dispatch, `openglm/model/gpu.py`, does so only for CUDA tensors). On a machine
without a GPU the same kernels run in Triton's interpreter on CPU tensors when `TRITON_INTERPRET=1` is set
before they are imported (what the test suite does): slow, but it checks the kernels' arithmetic everywhere.
This package imports nothing of openglm: the model's reference ops live in `openglm.model`, and the tests
compare against them.
"""
