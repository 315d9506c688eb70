"""GLM-5 (`glm_moe_dsa`): Multi-head Latent Attention with DeepSeek Sparse Attention, MoE.

- `mla.py`: MLA in absorbed form (attention on the cached latent), DSA layers selecting keys with the indexer;
- `indexer.py`: the DSA lightning indexer's parameters and projections;
- `sparse_dsa.py`: DSA by gathering (indexer scores, top-k per query, attention over the selected rows), with the
  native kernels of `dsa_kernels.c` for prefill;
- `decode_step.py`: a decode step's MLA layers as three native calls each (`decode_kernels.c`).
"""

from openglm.model.family import Family
from openglm.model.glm5.decode_step import DecodePlan
from openglm.model.glm5.mla import MLAttention
from openglm.model.hf_names import GLM_MOE

FAMILY = Family("glm_moe_dsa", MLAttention, GLM_MOE, DecodePlan)
