"""GLM-5.3-Flash's checkpoint names, as data: the multimodal `Glm5NextForConditionalGeneration` files hold the
text model under `model.language_model.` (its next-n layer as `model.language_model.layers.{num_hidden_layers}`),
`lm_head.weight` at the top, and the vision tower under `model.visual.`, which openglm keeps as stored.

Inside the text model the on-disk names are the native ones: per-expert `mlp.experts.{e}.{gate,up,down}_proj`
(stacked in memory as for every GLM MoE), the KDA layer's `self_attn.{q,k,v}_conv1d.weight`,
`self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}` and the hyper-connections' `hc_{attn,ffn}_{fn,base,scale}` (which
transformers renames in memory and back on save).
"""

from openglm.model.hf_names import GLM_MOE, HFNames

GLM5_NEXT = HFNames(stacked=GLM_MOE.stacked, nextn_copies=GLM_MOE.nextn_copies,
                    prefixes=(("model.", "model.language_model."),), kept=("model.visual.",),
                    fp8_not_convert=("model.language_model.embed_tokens",))
