"""The self-check's gradient bound against a model of a fused kernel, on the CPU, as a GPU's references would set it.

    python benchmarks/self_check_model.py [--seeds 100] [--out results/cpu_self_check_model]

A fused kernel's causal attention written out in float32 (FlashAttention-2/-4, cuDNN): the forward multiplies V by
the softmax's numerators exp(s - max) rounded to bf16 (the matrix units' 16-bit operands) and divides by their
unrounded sum; the backward recomputes P in float32 and reads back the output it returned for D = rowsum(dO * O); its
dS is rounded to bf16 before the matrix products, and its gradients on return. Each of those roundings can be turned
off (``rounded numerators``, ``rounded dS``). On one-head causal slices of 2 to 16 tokens (randn bf16, 128/128) its
dq and dk are judged as attnselect.correctness judges them, with one change: the naive bf16 reference is the one a GPU
computes (each op's result rounded to bf16, its matrix products accumulated in float32), since the CPU's own bf16
products err far more and set a bound no GPU sets. Rows: slices failed under the read-back of the exact output rounded
(criterion 2) and of the output the kernel returned (criterion 3).
"""

from __future__ import annotations

import argparse
import json

import torch

from attnselect import correctness
from attnselect.spec.options import KernelCall

CAUSAL = KernelCall(mask="causal", window=None, scale=128**-0.5, dropout_p=0.0, return_lse=False)
BF16 = torch.bfloat16


def _bf16(t):
    return t.to(BF16).float()


def fused(q, k, v, dout, *, numerators: bool, ds: bool) -> dict:
    """The model kernel's out (bf16) and float32 gradients (rounded by the caller) on (S, 1, D) slices."""
    qf, kf, vf, dof = (t.float()[:, 0] for t in (q, k, v, dout))
    s = (qf @ kf.T) * CAUSAL.scale
    s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    total = e.sum(-1, keepdim=True)
    out = (((_bf16(e) if numerators else e) @ vf) / total).to(BF16)
    p = e / total
    d = (dof * out.float()).sum(-1, keepdim=True)
    dscores = p * (dof @ vf.T - d)
    dscores = _bf16(dscores) if ds else dscores
    dq, dk = dscores @ kf * CAUSAL.scale, dscores.T @ qf * CAUSAL.scale
    return {"out": out[:, None], "dq": dq[:, None].to(BF16), "dk": dk[:, None].to(BF16)}


class _Rounded(torch.autograd.Function):
    """A bf16 op's result: rounded forward and backward."""

    @staticmethod
    def forward(ctx, x):
        return _bf16(x)

    @staticmethod
    def backward(ctx, grad):
        return _bf16(grad)


def naive_on_gpu(q, k, v, dout) -> dict:
    """attnselect.correctness.reference in bf16 as a GPU computes it: each op rounded, products in float32."""
    qf, kf, vf = (t.float()[:, 0].requires_grad_(True) for t in (q, k, v))
    qq, kk, vv = (_Rounded.apply(t) for t in (qf, kf, vf))  # bf16 leaves: their gradients rounded too
    s = _Rounded.apply(_Rounded.apply(qq * CAUSAL.scale) @ kk.T)
    s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf"))
    out = _Rounded.apply(_Rounded.apply(torch.softmax(s, -1)) @ vv)
    out.backward(dout.float()[:, 0])
    return {"dq": qf.grad[:, None], "dk": kf.grad[:, None]}


def failures(lengths, seeds: int, *, numerators: bool, ds: bool) -> dict:
    """{(criterion, value): slices failed} over ``seeds`` slices of each length."""
    failed = {(c, n): 0 for c in (2, 3) for n in ("dq", "dk")}
    for length in lengths:
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)
            q, k, v, dout = (torch.randn(length, 1, 128, generator=g).to(BF16) for _ in range(4))
            batch = [t.unsqueeze(0) for t in (q, k, v, dout)]
            exact = dict(zip(("out", "lse", "dq", "dk", "dv"), correctness.reference(*batch, CAUSAL, torch.float32)))
            got = fused(q, k, v, dout, numerators=numerators, ds=ds)
            naive = naive_on_gpu(q, k, v, dout)
            backs = {
                2: correctness._read_back_reference(*batch, CAUSAL, exact, torch.float32),
                3: correctness._read_back_reference(*batch, CAUSAL, exact, torch.float32, returned=got["out"][None]),
            }
            for name in ("dq", "dk"):
                ref, value = exact[name][0], got[name].float()
                floor = correctness.FLOOR_ULPS * torch.finfo(torch.float32).eps * ref.abs().max().clamp(min=1.0)
                bound = correctness.GRAD_FACTOR * (naive[name] - ref).abs().max() + 2 * (_bf16(ref) - ref).abs().max()
                bound = bound + floor
                for criterion, back in backs.items():
                    error = min((value - ref).abs().max(), (value - back[name][0]).abs().max())
                    failed[(criterion, name)] += bool(error > bound)
    return failed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--lengths", default="2,3,4,8,16")
    ap.add_argument("--out")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    rows = []
    for numerators, ds in ((True, True), (True, False), (False, True), (False, False)):
        found = failures(lengths, a.seeds, numerators=numerators, ds=ds)
        rows.append({"rounded numerators": numerators, "rounded dS": ds,
                     "failed": {f"criterion {c} {n}": count for (c, n), count in found.items()}})  # fmt: skip
    slices = len(lengths) * a.seeds
    lines = ["# The self-check's gradient bound against a fused kernel's model (CPU, a GPU's naive reference)", "",
             f"`benchmarks/self_check_model.py --seeds {a.seeds} --lengths {a.lengths}`: {slices} one-head causal "
             "slices a row (method in the script's docstring); slices whose dq or dk failed the bound.", "",
             "| rounded numerators | rounded dS | dq, criterion 2 | dk, criterion 2 | dq, criterion 3 "
             "| dk, criterion 3 |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        f = row["failed"]
        lines.append(f"| {row['rounded numerators']} | {row['rounded dS']} | {f['criterion 2 dq']} | "
                     f"{f['criterion 2 dk']} | {f['criterion 3 dq']} | {f['criterion 3 dk']} |")  # fmt: skip
    print("\n".join(lines))
    if a.out:
        with open(a.out + ".json", "w") as out:
            json.dump({"lengths": lengths, "seeds": a.seeds, "slices per row": slices, "rows": rows}, out, indent=1)
        with open(a.out + ".md", "w") as out:
            out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
