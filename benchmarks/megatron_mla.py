"""A megatron-core MLA self-attention layer on packed input: Megatron's V pad (stock) against native V (patched).

    python benchmarks/megatron_mla.py --out results/h200_megatron_mla    # GPU machine, megatron-core carried

The layer (DeepSeek-V3 attention geometry: 16 heads, q/k 128 + 64 rope, v 128, kv_lora 512, bf16) runs
with attnselect's core attention on the 32k-token / 18-sequence packing of benchmarks/thd_bench.py,
forward+backward, timed with attnselect.choose.timing.time_steps (interleaved rounds of queued repeats, median
and p20..p80): with megatron-core's own _prepare_mla_core_attention_value (V zero-padded to 192 on packed
input) and with attnselect.integrations.megatron's replacement (V stays 128 wide); and the core attention
alone on the very tensors the layer handed it in each arm (their shapes and strides are reported). Both arms
pay Megatron's packed-RoPE host syncs (rope_utils .tolist()), so the ratio understates the kernel gain.
The tests in tests/integrations/test_megatron.py build the layer with :func:`mla_layer`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def init_model_parallel() -> None:
    """One-process model parallelism (tensor and pipeline size 1), as Megatron's own unit tests set it up."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(123)


def mla_layer(integration, patched: bool, hidden: int = 1024, **config_fields):
    """An MLASelfAttention with attnselect's core attention; ``patched``: V stays native on packed input;
    ``config_fields`` go into its MLATransformerConfig."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
        rope_type="rope",
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        transformer_impl="local",
        **config_fields,
    )
    spec = integration.layer_spec(get_gpt_layer_local_spec(multi_latent_attention=True))
    model_parallel_cuda_manual_seed(0)  # weights draw from Megatron's tracker: the same layer every time
    layer = build_module(spec.submodules.self_attention, config=config, layer_number=1).cuda()
    integration._mla._prepare_mla_core_attention_value = (
        integration._prepare_value if patched else integration._STOCK_PREPARE_VALUE
    )
    return layer


def packed_params(lengths):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
    )


def capture_qkv(seen: dict, key):
    """A forward pre-hook (with_kwargs=True) that keeps the first query, key and value a module gets in seen[key]."""

    def hook(module, args, kwargs):
        names = ("query", "key", "value")
        named = dict(zip(names, args)) | {n: kwargs[n] for n in names if n in kwargs}
        seen.setdefault(key, tuple(named[n].detach() for n in names))
        return None  # the call goes on unchanged

    return hook


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import megatron.core

    from attnselect.choose.timing import time_steps
    from attnselect.integrations import megatron as integration
    from attnselect.spec.target import Target
    from thd_bench import packings

    init_model_parallel()
    name, lengths = next(iter(packings("issue").items()))
    params = packed_params(lengths)
    arms = {False: "padded to 192 (stock)", True: "native 128 (patched)"}
    layers, seen = {}, {}
    for patched in arms:
        layers[patched] = mla_layer(integration, patched)
        # What reaches the core attention, to time it alone and to say what it ran.
        layers[patched].core_attention.register_forward_pre_hook(capture_qkv(seen, patched), with_kwargs=True)
    x = torch.randn(sum(lengths), 1, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def layer_step(patched):
        def step():
            integration._mla._prepare_mla_core_attention_value = (
                integration._prepare_value if patched else integration._STOCK_PREPARE_VALUE
            )
            out, _ = layers[patched](x, None, packed_seq_params=params)
            out.backward(torch.ones_like(out))

        return step

    def core_step(patched):
        q, k, v = (
            torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t).requires_grad_()
            for t in seen[patched]
        )  # same strides as the layer handed over
        core = layers[patched].core_attention

        def step():
            out = core(q, k, v, None, packed_seq_params=params)
            out.backward(torch.ones_like(out))

        return step

    for patched in arms:  # one call each fills `seen`
        layer_step(patched)()
    steps = {("layer", p): layer_step(p) for p in arms} | {("core attention", p): core_step(p) for p in arms}
    # Layer steps: their host time counts (no spin); three rounds, as when the committed results were made.
    timings = time_steps(steps, torch.device("cuda"), warmup=3, repeats=15, rounds=3, spin=False)
    rows = []
    for (part, patched), t in timings.items():
        if isinstance(t, Exception):
            raise t
        v = seen[patched][2]
        rows.append(
            {
                "part": part,
                "v": arms[patched],
                "v_shape": list(v.shape),
                "v_stride": list(v.stride()),
                "median_ms": t.median_ms,
                "p20_ms": t.low_ms,
                "p80_ms": t.high_ms,
            }
        )
        print(rows[-1], flush=True)
    integration._mla._prepare_mla_core_attention_value = integration._STOCK_PREPARE_VALUE
    meta = {
        "device": Target.current().describe(),
        "megatron_core": megatron.core.__version__,
        "packing": name,
        "date": time.strftime("%Y-%m-%d"),
    }
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        "# megatron-core MLA layer, packed input: V padded (stock) against native (patched)\n",
        f"{meta['device']}, megatron-core {meta['megatron_core']}, {name}, forward+backward, "
        f"{meta['date']}; the layer and its core attention alone (on the inputs the layer handed it), both "
        "arms timed side by side in interleaved rounds. Produced by `benchmarks/megatron_mla.py`.\n",
        "| part | V | V shape (stride) | median ms | p20..p80 ms |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['part']} | {r['v']} | {r['v_shape']} ({r['v_stride']}) | {r['median_ms']:.3f} | "
        f"{r['p20_ms']:.3f}..{r['p80_ms']:.3f} |"
        for r in rows
    ]
    for part in ("layer", "core attention"):
        stock, native = (next(r for r in rows if r["part"] == part and r["v"] == arms[p]) for p in arms)
        lines.append(
            f"\n{part}: native V is {stock['median_ms'] / native['median_ms']:.2f}x the speed of the stock pad."
        )
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
