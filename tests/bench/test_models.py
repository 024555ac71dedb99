"""The model presets (attnselect.bench.models): each model's documented attention geometry, as valid problems."""

from __future__ import annotations

import pytest
import torch

from attnselect import AttentionProblem
from attnselect.bench.models import MODELS

# (heads, kv heads, d_qk, d_v) from each model's config.json: MLA's d_qk is qk_nope_head_dim + qk_rope_head_dim
# (128 + 64), its d_v v_head_dim (128); absorbed MLA takes kv_lora_rank + rope (512 + 64) against the latent (512).
DOCUMENTED = {
    "deepseek-v3": (128, 128, 128 + 64, 128),
    "deepseek-v2-lite": (16, 16, 128 + 64, 128),
    "kimi-k2": (64, 64, 128 + 64, 128),
    "llama-3-70b": (64, 8, 128, 128),
    "deepseek-v3-absorbed": (128, 1, 512 + 64, 512),
}


def test_every_preset_has_its_models_documented_geometry():
    assert {name: (m.heads, m.kv_heads, m.head_dim_qk, m.head_dim_v) for name, m in MODELS.items()} == DOCUMENTED
    assert all(m.source for m in MODELS.values())


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_every_preset_makes_a_valid_problem(name, training):
    m = MODELS[name]
    problem = AttentionProblem(
        2, 1024, 1024, m.heads, m.kv_heads, m.head_dim_qk, m.head_dim_v, torch.bfloat16, mask="causal",
        training=training,
    )  # fmt: skip
    assert problem.heads_q % problem.heads_kv == 0  # grouped K/V heads: each serves a whole group of query heads
    assert problem.different_head_dims == (name != "llama-3-70b")  # MLA: d_qk != d_v
