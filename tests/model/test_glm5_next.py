"""GLM-5.3-Flash (`glm5_next`): logits parity with transformers 5.23.0's Glm5NextForConditionalGeneration (fp32,
text input) through checkpoints in both directions, on padded batches and with the hybrid cache; the pooled DSA
selection against transformers' indexer; the multimodal checkpoint layout (vision tensors kept byte for byte, FP8)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from openglm.cli import main
from openglm.model import ModelConfig, load_model
from openglm.model.checkpoint import save_pretrained
from openglm.model.fp8 import Fp8Config
from openglm.model.glm5_next import Glm5NextForCausalLM

TOL = 1e-4
KDA, DSA = "linear_attention", "indexed_attention"
# A vision tower small enough to build in milliseconds (openglm keeps its tensors, never runs it).
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64,
              projection_intermediate_size=16)
# Every layer kind: KDA; DSA with its own and with a shared indexer; dense and MoE MLPs; >= 2 streams; groups with
# an incomplete tail. The variants change the stream count, group size, gate form (bounded or softplus), conv width.
CONFIGS = {
    "preset": {},
    "hc3-kpool2-softplus-gate": dict(hc_mult=3, index_kpool=2, index_topk=6, linear_lower_bound=None,
                                     linear_conv_kernel_dim=3, hc_sinkhorn_iters=5),
    "kpool8-4-layers": dict(num_hidden_layers=4, layer_types=[KDA, DSA, DSA, KDA], index_kpool=8, index_topk=16,
                            indexer_types=["full", "full", "shared", "full"],
                            mlp_layer_types=["dense", "sparse", "sparse", "dense"]),
}


def config(name: str = "preset", **changes) -> ModelConfig:
    return ModelConfig.from_preset("tiny-glm5-next", vision_config=VISION, **{**CONFIGS[name], **changes})


def hf_config(cfg: ModelConfig):
    from transformers import Glm5NextConfig

    d = cfg.to_hf_dict()
    for key in ("openglm", "model_type", "architectures"):
        d.pop(key)
    hcfg = Glm5NextConfig(**d)
    hcfg._attn_implementation = hcfg.text_config._attn_implementation = "eager"
    return hcfg


def pair(cfg: ModelConfig, direction: str, tmp_path, randomize, seed: int = 0):
    """(transformers model, openglm model) with the same random weights, handed over as a checkpoint: written by
    transformers and loaded by openglm ("theirs->ours"), or the other way round ("ours->theirs")."""
    from transformers import Glm5NextForConditionalGeneration as HFModel

    torch.manual_seed(seed)
    if direction == "theirs->ours":
        hf = HFModel(hf_config(cfg)).eval()
        randomize(hf, seed)
        hf.save_pretrained(tmp_path / "hf")
        return hf, load_model(tmp_path / "hf")
    ours = Glm5NextForCausalLM(cfg).eval()
    randomize(ours, seed)
    save_pretrained(ours, tmp_path / "ours")
    hf = HFModel.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    return hf, ours


def batch(vocab: int, lengths: list[int], left: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, T - n:] = 1 if left else 0
        mask[i, :n] = mask[i, :n] if left else 1
    return ids.masked_fill(mask == 0, 0), mask


def max_diff(a, b, mask):
    return (a - b).abs()[mask.bool()].max().item()


@pytest.mark.parametrize("direction", ["theirs->ours", "ours->theirs"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers_on_a_padded_batch(name, direction, tmp_path, randomize):
    cfg = config(name)
    hf, ours = pair(cfg, direction, tmp_path, randomize)
    ids, mask = batch(cfg.vocab_size, [30, 23, 11])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        out = ours(ids, attention_mask=mask).logits
    assert ref.abs().max() > 1.0  # not a comparison of near-zero tensors
    assert max_diff(ref, out, mask) <= TOL


def test_right_padding_and_no_mask_match(tmp_path, randomize):
    cfg = config()
    hf, ours = pair(cfg, "theirs->ours", tmp_path, randomize, seed=1)
    ids, mask = batch(cfg.vocab_size, [26, 15], left=False, seed=1)
    with torch.no_grad():
        assert max_diff(hf(input_ids=ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits,
                        mask) <= TOL
        assert max_diff(hf(input_ids=ids).logits, ours(ids).logits, torch.ones_like(mask)) <= TOL


def test_prefill_then_16_decode_steps_equal_the_full_forward(tmp_path, randomize):
    """The hybrid cache (KDA state + conv window, DSA latents and indexer entries) on a left-padded batch: the
    logits of a 14-token prefill then 16 one-token steps equal one forward over all 30 tokens, ours and
    transformers' (its DynamicCache)."""
    from transformers import DynamicCache

    cfg = config()
    hf, ours = pair(cfg, "theirs->ours", tmp_path, randomize, seed=2)
    ids, mask = batch(cfg.vocab_size, [30, 21], seed=2)
    with torch.no_grad():
        full = ours(ids, attention_mask=mask).logits
        ref = hf(input_ids=ids, attention_mask=mask).logits
        cache, steps = ours.new_cache(), []
        steps.append(ours(ids[:, :14], attention_mask=mask[:, :14], cache=cache).logits)
        for t in range(14, 30):
            steps.append(ours(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits)
        hf_cache, hf_steps = DynamicCache(config=hf.config.text_config), []
        hf_steps.append(hf(input_ids=ids[:, :14], attention_mask=mask[:, :14], past_key_values=hf_cache,
                           use_cache=True).logits)
        for t in range(14, 30):
            hf_steps.append(hf(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=hf_cache,
                               use_cache=True).logits)
    stepped, hf_stepped = torch.cat(steps, 1), torch.cat(hf_steps, 1)
    assert cache.get_seq_length() == 30 and len(cache.states) == 2  # the two KDA layers
    assert max_diff(full, stepped, mask) <= TOL
    assert max_diff(ref, stepped, mask) <= TOL
    assert max_diff(hf_stepped, stepped, mask) <= TOL


def test_chunked_prefill_carries_the_state_across_chunks():
    torch.manual_seed(3)
    ours = Glm5NextForCausalLM(config()).eval()
    ids = torch.randint(3, 256, (2, 150))  # more than one KDA chunk (64 tokens) per piece
    with torch.no_grad():
        full = ours(ids).logits
        cache = ours.new_cache()
        pieces = [ours(ids[:, a:b], cache=cache).logits for a, b in ((0, 70), (70, 73), (73, 150))]
    assert (full - torch.cat(pieces, 1)).abs().max() <= 1e-5


def test_shared_layers_reuse_the_selection_and_sparsity_matters():
    """Guards against a vacuous parity: with index_topk < the sequence the pooled DSA differs from dense attention,
    and a 'shared' layer attends over its full predecessor's slots (not its own)."""
    torch.manual_seed(4)
    cfg = config(index_n_heads=2)
    ours = Glm5NextForCausalLM(cfg).eval()
    ids = torch.randint(3, 256, (2, 40))
    dense = Glm5NextForCausalLM(cfg.replace(index_topk=1024)).eval()
    dense.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (ours(ids).logits - dense(ids).logits).abs().max() > 1e-2
    assert ours.model.layers[2].self_attn.indexer is None and ours.model.layers[1].self_attn.selection_shared


@pytest.mark.parametrize("kpool,tail", [(4, True), (2, True), (8, False)])
def test_pooled_selection_equals_the_transformers_indexer(kpool, tail):
    """`sparse_dsa.pooled_topk_slots` (via the model's indexer) keeps the same key set per query as transformers'
    Glm5NextTextIndexer, on a left-padded batch and with few index heads (exact zero-score ties are common)."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    from openglm.model.glm5.sparse_dsa import pooled_topk_slots
    from openglm.model.glm5_next.attention import PooledIndexer

    cfg = config(index_kpool=kpool, index_topk=2 * kpool, index_kpool_always_select_tail=tail, index_n_heads=2)
    torch.manual_seed(kpool)
    ref = Glm5NextTextIndexer(hf_config(cfg).text_config, 1)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    ours = PooledIndexer(cfg)
    ours.load_state_dict(ref.state_dict())
    _, mask = batch(cfg.vocab_size, [37, 30, 5], seed=kpool)
    x, q_resid = torch.randn(3, 37, cfg.hidden_size), torch.randn(3, 37, cfg.q_lora_rank)
    with torch.no_grad():
        expected = ref(x, q_resid, mask.bool(), None)
        entries = ours.entries(x)
        q, w = ours.queries(x, None, ours.wq_b(q_resid))
        got = pooled_topk_slots(q, entries["index_k"], entries["index_gate"], ours.index_kpool_compress_ape, w,
                                cfg.index_topk, kpool, scale=ours.softmax_scale, key_mask=mask.bool(),
                                query_mask=mask.bool(), select_tail=tail)
    def key_sets(slots):
        return [[sorted(set(row.tolist()) - {-1}) for row in seq] for seq in slots]
    assert key_sets(got) == key_sets(expected)
    assert sum(len(s) for seq in key_sets(got) for s in seq) < mask.sum() * 37 / 2  # really a sparse selection


def test_multimodal_layout_and_vision_tensors_round_trip_byte_identical(tmp_path, randomize):
    """Load a transformers-written checkpoint (vision tower included), save it with openglm, convert it to bf16:
    the text model is in `model.language_model.*` every time and the vision tensors are the same bytes."""
    from transformers import Glm5NextForConditionalGeneration as HFModel

    cfg = config(num_nextn_predict_layers=0)
    torch.manual_seed(5)
    hf = HFModel(hf_config(cfg)).eval()
    randomize(hf, 5)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "ours")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    src = load_file(str(tmp_path / "hf" / "model.safetensors"))
    vision = [k for k in src if k.startswith("model.visual.")]
    assert len(vision) > 10 and len(ours.vision_extra) == len(vision)
    for out in ("ours", "bf16"):
        written = load_file(str(tmp_path / out / "model.safetensors"))
        assert set(written) == set(src)
        for k in vision:
            assert written[k].dtype == src[k].dtype
            assert torch.equal(written[k].view(torch.uint8), src[k].view(torch.uint8))
    assert load_file(str(tmp_path / "bf16" / "model.safetensors"))["lm_head.weight"].dtype == torch.bfloat16
    cfg_json = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg_json["model_type"] == "glm5_next" and cfg_json["vision_config"]["depth"] == 1
    assert cfg_json["text_config"]["layer_types"] == cfg.layer_types
    assert load_model(tmp_path / "ours").config == ours.config


def test_next_n_layer_is_stored_after_the_decoder_layers_and_trains(tmp_path):
    cfg = config(num_nextn_predict_layers=1)
    torch.manual_seed(6)
    ours = Glm5NextForCausalLM(cfg).eval()
    save_pretrained(ours, tmp_path / "c")
    names = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert "model.language_model.layers.5.eh_proj.weight" in names
    assert "model.language_model.layers.5.self_attn.indexer.index_kpool_compress_gate" in names
    loaded = load_model(tmp_path / "c")
    ids = torch.randint(3, 256, (2, 20))
    with torch.no_grad():
        a, b = ours(ids, mtp=True), loaded(ids, mtp=True)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.mtp_logits, b.mtp_logits)
    out = ours.train()(ids, mtp=True, aux=True)
    (out.logits.logsumexp(-1).mean() + out.mtp_logits.logsumexp(-1).mean()).backward()
    assert ours.model.mtp_layers[0].self_attn.q_a_proj.weight.grad.abs().sum() > 0


def test_transformers_loads_ours_with_a_next_n_layer(tmp_path, randomize):
    """transformers skips the next-n layer's tensors (layers.{num_hidden_layers}) and computes the same logits."""
    cfg = config(num_nextn_predict_layers=1)
    hf, ours = pair(cfg, "ours->theirs", tmp_path, randomize, seed=7)
    ids, mask = batch(cfg.vocab_size, [21, 12], seed=7)
    with torch.no_grad():
        assert max_diff(hf(input_ids=ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits,
                        mask) <= TOL


def test_fp8_checkpoint_matches_the_dequantised_reference(tmp_path, randomize):
    from transformers import FineGrainedFP8Config
    from transformers import Glm5NextForConditionalGeneration as HFModel

    cfg = config()
    torch.manual_seed(8)
    ours = Glm5NextForCausalLM(cfg).eval()
    randomize(ours, 8)
    save_pretrained(ours, tmp_path / "fp8", quantization=Fp8Config((8, 8)))
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["model.language_model.layers.0.self_attn.f_b_proj.weight"] == "F8_E4M3"
    assert dtypes["model.language_model.layers.4.mlp.experts.3.up_proj.weight"] == "F8_E4M3"
    assert dtypes["model.language_model.embed_tokens.weight"] == "F32"
    assert dtypes["model.language_model.layers.0.hc_attn_fn"] == "F32"
    loaded = load_model(tmp_path / "fp8")
    ref = HFModel.from_pretrained(tmp_path / "fp8", quantization_config=FineGrainedFP8Config(dequantize=True),
                                  attn_implementation="eager", dtype=torch.float32).eval()
    ids, mask = batch(cfg.vocab_size, [25, 18], seed=8)
    with torch.no_grad():
        got = loaded(ids, attention_mask=mask).logits
        assert max_diff(ref(input_ids=ids, attention_mask=mask).logits, got, mask) <= TOL
        assert max_diff(ours(ids, attention_mask=mask).logits, got, mask) > 1e-3  # e4m3 really rounded the weights


def test_a_flat_text_only_checkpoint_loads(tmp_path):
    """A checkpoint whose text tensors are not nested under model.language_model (a text-only export) loads."""
    from safetensors.torch import save_file

    cfg = config()
    torch.manual_seed(9)
    ours = Glm5NextForCausalLM(cfg).eval()
    save_pretrained(ours, tmp_path / "c")
    t = load_file(str(tmp_path / "c" / "model.safetensors"))
    save_file({k.replace("model.language_model.", "model."): v for k, v in t.items()},
              str(tmp_path / "c" / "model.safetensors"))
    ids = torch.randint(3, 256, (1, 12))
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "c")(ids).logits, ours(ids).logits)


def test_cache_type_is_checked():
    from openglm.model import DynamicCache

    ours = Glm5NextForCausalLM(config())
    with pytest.raises(TypeError, match="HybridCache"):
        ours(torch.tensor([[5, 6]]), cache=DynamicCache())


def test_fp8_save_of_a_multimodal_checkpoint_says_the_vision_tower_is_not_quantised(tmp_path, randomize):
    """openglm never quantises the tensors it keeps as stored: an FP8 save lists them under modules_to_not_convert,
    so transformers loads the (unquantised) vision tower as it is, and FP8 -> FP8 keeps the source's word on them."""
    from transformers import Glm5NextForConditionalGeneration as HFModel

    cfg = config()
    torch.manual_seed(10)
    HFModel(hf_config(cfg)).save_pretrained(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "fp8"), "--fp8", "--fp8-block", "8,8"]) == 0
    qc = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert {"model.visual.", "model.language_model.embed_tokens"} <= set(qc["modules_to_not_convert"])
    src = load_file(str(tmp_path / "hf" / "model.safetensors"))
    out = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    assert all(torch.equal(out[k], src[k]) for k in src if k.startswith("model.visual."))
    assert main(["convert", str(tmp_path / "fp8"), str(tmp_path / "again"), "--fp8", "--fp8-block", "8,8"]) == 0
    again = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert again["modules_to_not_convert"] == qc["modules_to_not_convert"]
