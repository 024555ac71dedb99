"""DeepSeek-V3 attention geometry in transformers: training tokens/s per attention implementation.

    python benchmarks/hf_deepseek.py --out results/h200_hf_deepseek      # writes .json and .md
    python benchmarks/hf_deepseek.py --smoke --out /tmp/hf_smoke          # tiny model, any device

A randomly initialised DeepseekV3ForCausalLM with the real attention geometry (16 heads, q_lora 1536,
kv_lora 512, d_qk = 128 + 64 = 192, d_v = 128) and two dense layers (the MoE is left out so attention
dominates), bf16 on CUDA, forward+backward of a causal LM loss on (batch, seqlen) tokens, for
attnselect's implementation against transformers' own ``sdpa`` and ``flex_attention``, the three timed
side by side with attnselect.choose.timing.time_steps (warm-up, then interleaved rounds of calls queued back to
back, so drift lands on all three alike; median and p20..p80).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from attnselect.choose.timing import time_steps
from attnselect.integrations import transformers as attnselect_hf
from attnselect.spec.target import Target


def model(implementation: str, smoke: bool, device, dtype):
    import transformers

    geometry = (
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            intermediate_size=96,
            vocab_size=97,
        )
        if smoke
        else dict(
            hidden_size=2048,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            intermediate_size=4096,
            vocab_size=32000,
        )
    )
    config = transformers.DeepseekV3Config(
        num_hidden_layers=2,
        first_k_dense_replace=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        max_position_embeddings=16384,
        attn_implementation=implementation,
        **geometry,
    )
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(config).to(device=device, dtype=dtype).train()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    import transformers

    target = Target.current()
    device = "cuda" if target.is_cuda else "cpu"
    dtype = torch.bfloat16 if target.is_cuda else torch.float32
    seqlens = [16] if a.smoke else a.seqlens
    implementations = [attnselect_hf.register(), "sdpa", "flex_attention"]
    rows = []
    for seqlen in seqlens:
        ids = torch.randint(3, 97 if a.smoke else 32000, (a.batch, seqlen), device=device)
        steps, errors = {}, {}
        for implementation in implementations:
            try:
                m = model(implementation, a.smoke, device, dtype)
                steps[implementation] = lambda m=m, ids=ids: m(ids, labels=ids).loss.backward()
            except Exception as exc:  # an implementation that fails is a finding, not a crash
                errors[implementation] = exc
        # Whole model steps: their host time counts, so no spin ahead of each turn.
        results = {
            **time_steps(steps, torch.device(device), warmup=2, repeats=3 if a.smoke else 12, rounds=3, spin=False),
            **errors,
        }
        for implementation in implementations:
            t = results[implementation]
            if isinstance(t, Exception):
                rows.append(
                    {"seqlen": seqlen, "implementation": implementation, "error": f"{type(t).__name__}: {str(t)[:200]}"}
                )
            else:
                rows.append(
                    {
                        "seqlen": seqlen,
                        "implementation": implementation,
                        "median_ms": t.median_ms,
                        "p20_ms": t.low_ms,
                        "p80_ms": t.high_ms,
                        "tokens_per_s": a.batch * seqlen / (t.median_ms * 1e-3),
                    }
                )
            print(rows[-1], flush=True)
        del steps
    report = {
        "meta": {
            "device": target.describe(),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "dtype": str(dtype).replace("torch.", ""),
            "batch": a.batch,
            "date": time.strftime("%Y-%m-%d"),
        },
        "rows": rows,
    }
    with open(a.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    lines = [
        "# DeepSeek-V3 attention geometry in transformers: forward+backward tokens/s\n",
        f"{report['meta']['device']}, transformers {transformers.__version__}, {report['meta']['dtype']}, "
        f"batch {a.batch}, 2 dense layers, {report['meta']['date']}; "
        "median of queued repeats in interleaved rounds (p20..p80). "
        "Produced by `benchmarks/hf_deepseek.py`.\n",
        "| seqlen | implementation | median ms (p20..p80) | tokens/s | vs sdpa |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        sdpa = next(
            (x for x in rows if x["seqlen"] == r["seqlen"] and x["implementation"] == "sdpa" and "median_ms" in x), None
        )
        if "error" in r:
            lines.append(f"| {r['seqlen']} | {r['implementation']} | failed: {r['error']} | | |")
        else:
            ratio = f"{sdpa['median_ms'] / r['median_ms']:.2f}x" if sdpa else "-"
            lines.append(
                f"| {r['seqlen']} | {r['implementation']} | {r['median_ms']:.2f} ({r['p20_ms']:.2f}.."
                f"{r['p80_ms']:.2f}) | {r['tokens_per_s']:.0f} | {ratio} |"
            )
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
