"""llama.cpp interop: an openglm checkpoint, converted by llama.cpp's own converter, continues a prompt
greedily with the same tokens in llama.cpp as in openglm.

    python interop/llama_cpp_check.py [--cache DIR] [--types glm4_moe,glm4_moe_lite,glm_moe_dsa] [--tokens N]

Needs a llama-cpp-python 0.3.36 build (see `make interop`, which builds it from the source distribution into
~/.cache/openglm/llama-cpp): the wheel installed under CACHE/site and the unpacked sdist under CACHE, whose
vendor/llama.cpp/convert_hf_to_gguf.py (and gguf-py) do the conversion. Per model type it
  1. builds a small random openglm model and saves it (safetensors + a byte-level BPE tokenizer carrying the
     GLM special tokens llama.cpp's GLM vocab code looks up),
  2. runs convert_hf_to_gguf.py --outtype f32 on it (the only shim: the tokenizer's pre-tokenizer hash, unknown
     to llama.cpp, is reported as "glm4"; the token ids are fed directly, so the pre-tokenizer is never used),
  3. evaluates the prompt's token ids in llama.cpp and openglm and extends both greedily (argmax).
llama.cpp runs the DSA indexer densely, so the glm_moe_dsa model has index_topk >= prompt + continuation
length, where DSA equals dense attention; it also uses GLM-5's real attention widths (qk 192+64, v 256,
kv_lora 512, indexer 4 x 128: llama.cpp's GLM-DSA graph asserted on smaller ones).
Prints one line per model type and exits non-zero if any continuation differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from openglm.model import GlmMoeDsaForCausalLM, ModelConfig, save_pretrained

GLM_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                "<|assistant|>", "<|observation|>"]
VOCAB = 384
TYPES = {
    "glm4_moe": dict(model_type="glm4_moe", vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                     moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, use_qk_norm=True, attention_bias=True, n_routed_experts=8, n_shared_experts=1,
                     num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=1.5,
                     num_nextn_predict_layers=1,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                     bos_token_id=None, eos_token_id=None, pad_token_id=None),
    "glm4_moe_lite": dict(model_type="glm4_moe_lite", vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                          moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                          q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                          n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                          routed_scaling_factor=1.8, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                          num_nextn_predict_layers=1),
    # GLM-5's attention widths (llama.cpp's GLM-DSA graph needs them), everything else small.
    "glm_moe_dsa": dict(model_type="glm_moe_dsa", vocab_size=VOCAB, hidden_size=256, intermediate_size=256,
                        moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                        q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                        index_n_heads=4, index_head_dim=128, index_topk=2048, indexer_types=["full"] * 3,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                        routed_scaling_factor=1.5, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                        num_nextn_predict_layers=1),
}
PROMPT = [5, 77, 123, 42, 260, 9, 301, 17, 88, 150, 3, 211]


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer (transformers' fast-tokenizer files) with the GLM special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 24, special_tokens=GLM_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n" * 50, "import os, sys\n" * 50], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)


def make_checkpoint(model_type: str, folder: Path, seed: int = 0) -> GlmMoeDsaForCausalLM:
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(ModelConfig(**TYPES[model_type])).eval()
    with torch.no_grad():  # spread weights so the logits' top-2 gaps dwarf float rounding differences
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif not name.endswith("norm.weight"):
                p.normal_(0, 0.05)
    save_pretrained(model, folder)
    write_tokenizer(folder)
    return model


def convert(sdist: Path, folder: Path, out: Path, outtype: str = "f32") -> None:
    """llama.cpp's converter, unmodified, run through a two-line shim for the tokenizer hash."""
    llama = sdist / "vendor" / "llama.cpp"
    shim = ("import sys; sys.path[:0] = [{llama!r}, {gguf!r}]; import conversion.base as b; "
            "b.TextModel.get_vocab_base_pre = lambda self, tok: 'glm4'; "
            "import convert_hf_to_gguf as c; c.main()").format(llama=str(llama), gguf=str(llama / "gguf-py"))
    cmd = [sys.executable, "-c", shim, str(folder), "--outfile", str(out), "--outtype", outtype]
    print("$ python convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", outtype, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=llama)
    if r.returncode:
        raise SystemExit(f"convert_hf_to_gguf.py failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")


def greedy_openglm(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return out


def greedy_llama_cpp(gguf_file: Path, prompt: list[int], n: int) -> list[int]:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_file), n_ctx=256, n_threads=2, n_batch=64, verbose=False, logits_all=True)  # scores of every row
    llm.eval(prompt)
    out = []
    for _ in range(n):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        llm.eval([nxt])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/openglm/llama-cpp"),
                    help="folder holding the llama-cpp-python build (default: ~/.cache/openglm/llama-cpp)")
    ap.add_argument("--types", default=",".join(TYPES), help=f"model types to check (default: {','.join(TYPES)})")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens to compare (default: 16)")
    ap.add_argument("--keep", default=None, help="keep the checkpoints and GGUF files in this folder (default: temp)")
    args = ap.parse_args(argv)
    cache = Path(args.cache)
    sys.path.insert(0, str(cache / "site"))
    sdist = next(cache.glob("llama_cpp_python-*/"), None)
    if sdist is None:
        raise SystemExit(f"no unpacked llama-cpp-python sdist in {cache} (run `make interop`)")
    work = Path(args.keep or tempfile.mkdtemp(prefix="openglm-interop-"))
    failed = 0
    for model_type in args.types.split(","):
        folder, gguf_file = work / model_type, work / f"{model_type}.gguf"
        model = make_checkpoint(model_type, folder)
        convert(sdist, folder, gguf_file)
        ours = greedy_openglm(model, PROMPT, args.tokens)
        theirs = greedy_llama_cpp(gguf_file, PROMPT, args.tokens)
        same = ours == theirs
        failed += not same
        print(json.dumps({"model_type": model_type, "prompt": PROMPT, "openglm": ours, "llama.cpp": theirs,
                          "equal": same}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
