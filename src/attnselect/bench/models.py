"""Attention geometry of well-known models, for the CLI and benchmarks (per-layer, full heads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPreset:
    heads: int
    kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    source: str


MODELS: dict[str, ModelPreset] = {
    # d_qk = qk_nope_head_dim + qk_rope_head_dim = 128 + 64; v_head_dim = 128 (HF config.json).
    "deepseek-v3": ModelPreset(128, 128, 192, 128, "deepseek-ai/DeepSeek-V3 config.json"),
    "deepseek-v2-lite": ModelPreset(16, 16, 192, 128, "deepseek-ai/DeepSeek-V2-Lite config.json"),
    "kimi-k2": ModelPreset(64, 64, 192, 128, "moonshotai/Kimi-K2-Instruct config.json"),
    "llama-3-70b": ModelPreset(64, 8, 128, 128, "meta-llama/Meta-Llama-3-70B config.json"),
    # Absorbed MLA decode/prefill: q = [q_nope W_uk ; q_rope] (512 + 64), v = latent (512).
    "deepseek-v3-absorbed": ModelPreset(128, 1, 576, 512, "DeepSeek-V3 MLA with absorbed projections"),
}
