"""Why right kernels fail the self-check's gradient bound in packed training: slices' dq and dk errors taken apart on
the GPU (an H100 at 9cbe6e3 failed six kernels alike at thd 128/128 causal bf16 training on a packing of 114
sequences, results/h100_self_check_short_sequences_9cbe6e3.md).

    python benchmarks/self_check_probe.py [--lengths 1886,2,1,...] [--backend varlen_fa2] [--seed 0] [--out OUT]

For a packing of ``--lengths`` (16 heads, 128/128, causal, bf16, training; randn inputs and output gradient seeded by
``--seed``; default one of 1886 tokens, 49 of two and 64 of one, the packing of 114 sequences that attnselect.warmup
drew for the ladder's 2048-token rung, NewPackings.spanning, where the check failed), ``--backend`` forced through
attention() (the self-check off) runs forward and backward, and the slices the self-check judges on that packing
(attnselect.self_check.check_slices: the longest sequence, then sequence i with K/V head i) are judged as it judges
them (attnselect.correctness.compare), with each gradient error's parts: against the exact float32 gradients,
against a read-back of the exact output rounded (correctness criterion 2), against a read-back of the kernel's own
output (criterion 3), the naive bf16 reference's error and the rounding term, and whether criterion 2 would have
passed the slice. ``--device cpu`` runs it on the CPU (the backend attention() picks there).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import attnselect
from attnselect import correctness, self_check
from attnselect.spec.options import KernelCall, Packing

DEFAULT_LENGTHS = [1886] + [2] * 49 + [1] * 64  # 2048 tokens in 114 sequences: the packing that failed


def probe(
    lengths: list[int], *, backend: str | None, device: str, seed: int = 0, heads: int = 16, d: int = 128
) -> list:
    """One row per judged slice (see the module docstring)."""
    total = sum(lengths)
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(total, heads, d, device=device, dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for _ in range(3))  # fmt: skip
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    longest = max(lengths)
    out = attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
                               causal=True, backend=backend)  # fmt: skip
    dout = torch.randn(out.shape, device=device, dtype=torch.bfloat16, generator=g)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    call = KernelCall(mask="causal", window=None, scale=d**-0.5, dropout_p=0.0, return_lse=False)
    problem = attnselect.AttentionProblem.from_tensors(
        q, k, v, layout="thd", cu_seqlens_q=cu, max_seqlen_q=longest, max_seqlen_kv=longest, causal=True
    )
    rows = []
    for piece in self_check.check_slices(problem, Packing(cu, cu, longest, longest, cu, cu)):
        at, head = piece.sequence, piece.kv_head  # no grouped heads: the slice's query head is its K/V head
        rows_of = slice(int(cu[at]), int(cu[at + 1]))
        sq, sk, sv, sdo = (t[rows_of, head : head + 1].detach() for t in (q, k, v, dout))
        got = {n: t[rows_of, head : head + 1].detach() for n, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))}
        judgement = correctness.compare(sq, sk, sv, sdo, call, got)
        b = [t.unsqueeze(0) for t in (sq, sk, sv, sdo)]
        exact = dict(zip(("out", "lse", "dq", "dk", "dv"), correctness.reference(*b, call, torch.float32)))
        naive = dict(zip(("out", "lse", "dq", "dk", "dv"), correctness.reference(*b, call, torch.bfloat16)))
        rounded = correctness._read_back_reference(*b, call, exact, torch.float32)  # criterion 2's
        own = correctness._read_back_reference(*b, call, exact, torch.float32, returned=got["out"].unsqueeze(0))
        row = {"sequence": at, "head": head, "length": lengths[at], "passed": judgement.passed,
               "judged": judgement.to_dict()}  # fmt: skip
        for n in ("dq", "dk"):
            value = got[n].unsqueeze(0).float()
            row[n] = {
                "exact": (value - exact[n]).abs().max().item(),
                "read back (exact out rounded)": (value - rounded[n]).abs().max().item(),
                "read back (own out)": (value - own[n]).abs().max().item(),
                "naive": (naive[n].float() - exact[n]).abs().max().item(),
                "rounding": 2 * (exact[n].to(torch.bfloat16).float() - exact[n]).abs().max().item(),
                "max |exact|": exact[n].abs().max().item(),
            }
        errors, bounds = dict(row["judged"]["errors"]), row["judged"]["bounds"]
        errors.update({n: min(row[n]["exact"], row[n]["read back (exact out rounded)"]) for n in ("dq", "dk")})
        row["criterion 2 passed"] = all(errors[n] <= bounds[n] for n in errors)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--lengths", help="comma-separated sequence lengths (default: 1886, then 49 of two tokens and 64 of one)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", help="forced (default on CUDA: varlen_fa2; on the CPU: attention()'s choice)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else DEFAULT_LENGTHS
    backend = a.backend or ("varlen_fa2" if a.device == "cuda" else None)
    os.environ["ATTNSELECT_SELF_CHECK"] = "0"  # the probe judges; a failed check would stop a forced call
    rows = probe(lengths, backend=backend, device=a.device, seed=a.seed)
    for row in rows:
        print(json.dumps(row), flush=True)
    failed = {
        c: sum(not r[k] for r in rows) for c, k in (("criterion 2", "criterion 2 passed"), ("criterion 3", "passed"))
    }
    print(f"{backend}: {len(rows)} slices; failed under criterion 2: {failed['criterion 2']}, under criterion 3 "
          f"(attnselect's): {failed['criterion 3']}")  # fmt: skip
    if a.out:
        meta = {"device": attnselect.Target.current().describe(), "lengths": lengths, "backend": backend,
                "seed": a.seed, "failed": failed}  # fmt: skip
        with open(a.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
