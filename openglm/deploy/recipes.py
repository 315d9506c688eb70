"""The engines' published GLM recipes, as data: per model family the checkpoint ids, the tool-call and
reasoning parsers, and the chat-template content format that vLLM and SGLang are launched with; and the
memory of the GPUs a deployment can name.

Sources (the values are facts restated, not copied text):
- vLLM recipes (github.com/vllm-project/recipes, models/zai-org/GLM-*.yaml and GLM/GLM5.md, GLM/GLM.md):
  GLM-5, GLM-5.1, GLM-5.2 and GLM-4.7 use `--tool-call-parser glm47 --reasoning-parser glm45`; GLM-4.5 and
  GLM-4.6 use glm45 for both; GLM-5 and GLM-5.1 add `--chat-template-content-format string`; every family
  but GLM-4.7-Flash has a Z.ai FP8 checkpoint named `<repo>-FP8`.
- SGLang's GLM cookbook (github.com/sgl-project/sgl-cookbook) and SGLang 0.5.23 itself: the same tool-call
  parsers; for reasoning SGLang has only glm45 (its cookbook's GLM-4.7 page names a glm47 reasoning parser
  that 0.5.23's --reasoning-parser choices do not hold). GLM-5.3-Flash (`glm5_next`) gets reasoning glm45 and
  tool calls glm47 from SGLang's built-in GLM-5.3 template; vLLM 0.34 registers the model and its MTP layer;
  neither engine has a GLM-5.3-Flash recipe page yet. Its published checkpoint (zai-org/GLM-5.3-Flash) is
  FP8-quantised.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GlmRecipe:
    family: str  # the name deploy.yaml's `family:` takes
    repo: str  # the Hugging Face id of the BF16 checkpoint (GLM-5.3-Flash: its only, FP8 one)
    fp8_repo: str | None  # the published FP8 checkpoint; None: none is published
    preset: str  # the openglm preset of this shape (the per-GPU memory estimate)
    tool_call_parser: str  # vLLM and SGLang
    reasoning_parser: str
    content_format: str | None = None  # vLLM --chat-template-content-format, where the recipe sets it

    @property
    def title(self) -> str:
        return self.repo.split("/")[-1]


RECIPES: dict[str, GlmRecipe] = {r.family: r for r in (
    GlmRecipe("glm-5", "zai-org/GLM-5", "zai-org/GLM-5-FP8", "glm-5", "glm47", "glm45", "string"),
    GlmRecipe("glm-5.1", "zai-org/GLM-5.1", "zai-org/GLM-5.1-FP8", "glm-5", "glm47", "glm45", "string"),
    GlmRecipe("glm-5.2", "zai-org/GLM-5.2", "zai-org/GLM-5.2-FP8", "glm-5", "glm47", "glm45"),
    GlmRecipe("glm-5.3-flash", "zai-org/GLM-5.3-Flash", "zai-org/GLM-5.3-Flash", "glm-5.3-flash", "glm47", "glm45"),
    GlmRecipe("glm-4.7", "zai-org/GLM-4.7", "zai-org/GLM-4.7-FP8", "glm-4.7", "glm47", "glm45"),
    GlmRecipe("glm-4.7-flash", "zai-org/GLM-4.7-Flash", None, "glm-4.7-flash", "glm47", "glm45"),
    GlmRecipe("glm-4.6", "zai-org/GLM-4.6", "zai-org/GLM-4.6-FP8", "glm-4.6", "glm45", "glm45"),
    GlmRecipe("glm-4.5", "zai-org/GLM-4.5", "zai-org/GLM-4.5-FP8", "glm-4.5", "glm45", "glm45"),
    GlmRecipe("glm-4.5-air", "zai-org/GLM-4.5-Air", "zai-org/GLM-4.5-Air-FP8", "glm-4.5-air", "glm45", "glm45"),
)}
# A local checkpoint's config.json model_type, where it names one family's recipe (glm4_moe is GLM-4.5, 4.6
# and 4.7, whose tool-call parsers differ: such a folder needs `family:`).
MODEL_TYPES = {"glm_moe_dsa": "glm-5", "glm5_next": "glm-5.3-flash", "glm4_moe_lite": "glm-4.7-flash"}

# GPU memory in GB (10^9 bytes) as the vendors state it; `gpu: 96GB` names any other.
GPUS = {"A100": 80, "H100": 80, "H800": 80, "H20": 96, "H200": 141, "B200": 180, "B300": 288, "GB200": 186,
        "L40S": 48, "MI300X": 192, "MI325X": 256, "MI355X": 288}
_GB = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*GB\s*$", re.IGNORECASE)


def gpu_memory_gb(name: str) -> float:
    """GB of memory of a GPU named in deploy.yaml or --gpu: a known model, or 'NNGB'."""
    for known, gb in GPUS.items():
        if name.strip().upper() == known:
            return float(gb)
    m = _GB.match(name)
    if m and float(m.group(1)) > 0:
        return float(m.group(1))
    raise ValueError(f"gpu {name!r}: not a GPU openglm knows ({', '.join(GPUS)}); give its memory instead, "
                     "e.g. gpu: 96GB")


@dataclass(frozen=True)
class FamilyMatch:
    recipe: GlmRecipe | None
    how: str  # one line: how the family was found, or why none was


def _checkpoint_config(model: str) -> dict | None:
    path = Path(model) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and isinstance(data.get("text_config"), dict):  # multimodal layouts
        return {**data["text_config"], **{k: v for k, v in data.items() if k != "text_config"}}
    return data if isinstance(data, dict) else None


def find_family(model: str, family: str | None) -> FamilyMatch:
    """The recipe of the model a deployment serves: deploy.yaml's `family`, else the model id's name
    (`zai-org/GLM-5.1-FP8` is GLM-5.1), else a local checkpoint's model_type."""
    if family is not None:
        return FamilyMatch(RECIPES[family], f"family {family} (deploy.yaml)")
    name = model.rstrip("/").split("/")[-1].lower().removesuffix("-fp8")
    for recipe in RECIPES.values():
        if name == recipe.title.lower():
            return FamilyMatch(recipe, f"{recipe.title} (from the model name {model})")
    config = _checkpoint_config(model)
    model_type = (config or {}).get("model_type")
    if model_type in MODEL_TYPES:
        recipe = RECIPES[MODEL_TYPES[model_type]]
        return FamilyMatch(recipe, f"{recipe.title} (config.json model_type {model_type}; set family: to choose "
                                   "another of its family)")
    if model_type == "glm4_moe":
        return FamilyMatch(None, f"{model} is glm4_moe, which is GLM-4.5, 4.6 or 4.7: set family: glm-4.5, "
                                 "glm-4.6 or glm-4.7 (their tool-call parsers differ: glm45 / glm47)")
    return FamilyMatch(None, f"{model} is not a GLM checkpoint openglm has a recipe for: set family: "
                             f"({', '.join(RECIPES)}) for the recipe's parsers and memory check")


def checkpoint_quantization(model: str) -> str | None:
    """The quant_method a local checkpoint's config.json declares ('fp8', ...), or None."""
    config = _checkpoint_config(model) or {}
    q = config.get("quantization_config")
    return q.get("quant_method") if isinstance(q, dict) else None
