"""One rank of tests/integrations/test_megatron.py's context-parallel test: attnselect's Megatron core attention
with context_parallel_size = N over a gloo group (CPU tensors, float64), dense sbhd and packed thd with Megatron's
global PackedSeqParams, against the single-process attention's shard; prints one JSON line per case."""

import datetime
import json
import os
import sys
import types

import torch
import torch.distributed as dist

import attnselect
from attnselect.context_parallel import shard


def core_attention(n: int, group, heads: int, d_qk: int, d_v: int):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from attnselect.integrations.megatron import CoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=heads * d_qk, num_attention_heads=heads, kv_channels=d_qk,
                               attention_dropout=0.0, context_parallel_size=n)  # fmt: skip
    return CoreAttention(config, 1, AttnMaskType.causal, "self", k_channels=d_qk, v_channels=d_v,
                         cp_comm_type="p2p", pg_collection=types.SimpleNamespace(cp=group))  # fmt: skip


def check(n: int, rank: int, group, layout: str) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams

    heads, d_qk, d_v = 2, 48, 32
    g = torch.Generator().manual_seed(3)
    lengths = [2 * n, 6 * n, 4 * n]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    rows = (sum(lengths),) if layout == "thd" else (4 * n, 2)
    q, k = (torch.randn(*rows, heads, d_qk, generator=g, dtype=torch.float64) for _ in range(2))
    v, d_out = (torch.randn(*rows, heads, d_v, generator=g, dtype=torch.float64) for _ in range(2))
    core = core_attention(n, group, heads, d_qk, d_v)
    packed = dict(cu_seqlens_q=cu) if layout == "thd" else {}
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attnselect.attention(*full, layout=layout, causal=True, scale=core.softmax_scale, **packed)
    (ref * d_out).sum().backward()

    def local(x):
        return shard(x, cp_size=n, rank=rank, layout=layout, cu_seqlens=cu if layout == "thd" else None)[0]

    parts = [local(t).requires_grad_() for t in (q, k, v)]
    params = None
    if layout == "thd":  # Megatron's packed parameters hold the global boundaries and lengths
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                                 max_seqlen_kv=max(lengths))  # fmt: skip
    out = core(*parts, None, packed_seq_params=params)
    out = out.view(*out.shape[:-1], heads, d_v)
    (out * local(d_out)).sum().backward()
    errors = {"out": (out - local(ref.detach())).abs().max().item()}
    for name, mine, theirs in zip("qkv", parts, full):
        errors[f"d{name}"] = (mine.grad - local(theirs.grad)).abs().max().item()
    return errors


def main(rank: int, world: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    group = dist.new_group(list(range(world)))
    for layout in ("sbhd", "thd"):
        print(json.dumps({"rank": rank, "case": layout, "errors": check(world, rank, group, layout)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
