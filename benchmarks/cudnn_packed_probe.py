"""Whether torch's own cuDNN attention op serves packed (thd) MLA calls, how fast, and what a new packing costs.

    python benchmarks/cudnn_packed_probe.py --out results/h100_cudnn_packed_probe     # a CUDA GPU

``aten._cudnn_attention_forward`` takes ``cum_seq_q``/``cum_seq_k`` (the path nested tensors reach SDPA's cuDNN
kernel by) and has an autograd formula; no package beyond torch. This calls it on (T, H, D) packed tensors of the
size ladder's packings (benchmarks/ladder.py: lognormal documents, 16 heads, bf16, causal), and:

- **correct**: out and, in training, dq, dk, dv of each pair against a float64 reference made sequence by sequence
  (``attnselect.backends.reference``), beside torch's packed FlashAttention-2 (V zero-padded where d_v < d_qk, the
  ``varlen_fa2`` way) against the same reference: each error is the largest absolute difference over the
  reference's largest magnitude;
- **fast**: a call's time between CUDA events recorded around it (the median of ``--calls`` after one warm-up;
  host work inside the call that holds back its kernels, as a cuDNN graph build, counts), forward alone and forward
  and backward, on one packing repeated, the cuDNN op against FA2 (padded where it must be);
- **new packings**: each call's wall time, synchronised, over ``--new`` packings each new, then the same packings
  again: a graph cached per key (aten/src/ATen/native/cudnn/MHA.cpp) shows as first calls that take milliseconds and
  repeated ones that do not; a graph built on every call, as calls that all do.

Writes ``--out``.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from attnselect.choose.timing import _timed_call
from ladder import boundaries, packing_lengths

HEADS = 16


def cudnn(q, k, v, cu, longest, training: bool):
    op = torch.ops.aten._cudnn_attention_forward
    return op(q, k, v, None, cu, cu, longest, longest, training, 0.0, True, False, scale=q.shape[-1] ** -0.5)[0]


def fa2(q, k, v, cu, longest, training: bool):
    d_qk, d_v = q.shape[-1], v.shape[-1]
    vp = F.pad(v, (0, d_qk - d_v)) if d_v < d_qk else v
    out = torch.ops.aten._flash_attention_forward(
        q, k, vp, cu, cu, longest, longest, 0.0, True, False, scale=d_qk**-0.5, window_size_left=-1,
        window_size_right=0,
    )[0]  # fmt: skip
    return out[..., :d_v]


ROWS = {"cudnn op": cudnn, "fa2 (V padded where d_v < d_qk)": fa2}


def tensors(tokens: int, d_qk: int, d_v: int, training: bool, device, dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(tokens, HEADS, d, device=device, dtype=dtype, generator=g) for d in (d_qk, d_qk, d_v))
    for t in (q, k, v):
        t.requires_grad_(training)
    grad = torch.randn(tokens, HEADS, d_v, device=device, dtype=dtype, generator=g)
    return q, k, v, grad


def reference(q, k, v, cu, grad, training: bool):
    """out (and dq, dk, dv) in float64, sequence by sequence, causal."""
    q64, k64, v64 = (t.detach().double().requires_grad_(training) for t in (q, k, v))
    outs = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q64, k64, v64))
        outs.append(
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=q.shape[-1] ** -0.5).transpose(0, 1)
        )
    out = torch.cat(outs)
    if not training:
        return (out.detach(),)
    return (out.detach(), *torch.autograd.grad(out, (q64, k64, v64), grad.double()))


def error(got, want) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def check(pair, training, device, tokens) -> dict:
    d_qk, d_v = pair
    q, k, v, grad = tensors(tokens, d_qk, d_v, training, device)
    cu, longest = boundaries(packing_lengths(tokens, 1), device)
    want = reference(q, k, v, cu, grad, training)
    found = {}
    for name, fn in ROWS.items():
        try:
            out = fn(q, k, v, cu, longest, training)
            got = (out.detach(),) if not training else (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))
            found[name] = {what: error(g, w) for what, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
            found[name]["shape"] = list(out.shape)
        except Exception as exc:  # noqa: BLE001 (reported)
            found[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    return found


def gpu_ms(fn, calls: int) -> float:
    """The median of ``calls`` calls' ms between CUDA events around each, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    device = torch.device("cuda")
    return statistics.median(_timed_call(fn, device, wait=True)() for _ in range(calls))


def speed(pair, training, device, tokens, calls) -> dict:
    d_qk, d_v = pair
    q, k, v, grad = tensors(tokens, d_qk, d_v, training, device)
    cu, longest = boundaries(packing_lengths(tokens, 1), device)
    found = {}
    for name, fn in ROWS.items():

        def call(fn=fn):
            out = fn(q, k, v, cu, longest, training)
            if training:
                torch.autograd.grad(out, (q, k, v), grad)

        try:
            found[name] = gpu_ms(call, calls)
        except Exception as exc:  # noqa: BLE001 (reported)
            found[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return found


def new_packings(pair, training, device, tokens, count) -> dict:
    """Wall ms of each call on a new packing, then on the same packings again; and each packing's key parts."""
    d_qk, d_v = pair
    q, k, v, grad = tensors(tokens, d_qk, d_v, training, device)
    packings = [packing_lengths(tokens, 100 + i) for i in range(count)]
    found = {"keys": [[len(p), max(p)] for p in packings]}
    for name, fn in ROWS.items():
        for turn in ("first", "again"):
            walls = []
            try:
                for lengths in packings:
                    cu, longest = boundaries(lengths, device)
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    out = fn(q, k, v, cu, longest, training)
                    if training:
                        torch.autograd.grad(out, (q, k, v), grad)
                    torch.cuda.synchronize()
                    walls.append((time.perf_counter() - start) * 1e3)
                found[f"{name}, {turn}"] = walls
            except Exception as exc:  # noqa: BLE001 (reported)
                found[f"{name}, {turn}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--check-tokens", type=int, default=2048)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 65536])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--new", type=int, default=12)
    a = ap.parse_args()
    device = torch.device("cuda")
    meta = {
        "device": f"{torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))}), "
        f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}",
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(a),
    }
    report = {"meta": meta, "correct": [], "speed": [], "new packings": []}
    for pair in ((192, 128), (128, 128)):
        for training in (False, True):
            phase = "training" if training else "inference"
            row = {"pair": f"{pair[0]}/{pair[1]}", "phase": phase}
            report["correct"].append({**row, "rows": check(pair, training, device, a.check_tokens)})
            for tokens in a.tokens:
                report["speed"].append({**row, "tokens": tokens, "ms": speed(pair, training, device, tokens, a.calls)})
            report["new packings"].append({**row, "tokens": 8192, **new_packings(pair, training, device, 8192, a.new)})
            print(json.dumps(report["correct"][-1]), flush=True)
            print(json.dumps(report["speed"][-len(a.tokens) :]), flush=True)
    Path(a.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
    Path(a.out + ".md").write_text(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        "# torch's cuDNN attention op on packed (thd) input\n",
        f"{report['meta']['device']}, {report['meta']['date']}. Produced by `benchmarks/cudnn_packed_probe.py` "
        "(method in its docstring).\n",
        "## Correct: largest error over the float64 reference's largest magnitude\n",
        "| pair | phase | row | out | dq | dk | dv |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in report["correct"]:
        for name, r in entry["rows"].items():
            if "error" in r:
                lines.append(f"| {entry['pair']} | {entry['phase']} | {name} | {r['error']} | | | |")
                continue
            cells = " | ".join(f"{r[w]:.2e}" if w in r else "" for w in ("out", "dq", "dk", "dv"))
            lines.append(f"| {entry['pair']} | {entry['phase']} | {name} | {cells} |")
    lines += ["\n## ms a call between CUDA events around it, one packing repeated (median; host work that holds back "
              "the kernels, as a graph build, included)\n", "| pair | phase | tokens | row | ms |",
              "|---|---|---|---|---|"]  # fmt: skip
    for entry in report["speed"]:
        for name, ms in entry["ms"].items():
            cell = f"{ms:.4f}" if isinstance(ms, float) else ms
            lines.append(f"| {entry['pair']} | {entry['phase']} | {entry['tokens']} | {name} | {cell} |")
    lines += ["\n## Wall ms of each call on a new packing (8192 tokens), then on the same packings again\n"]
    for entry in report["new packings"]:
        lines.append(f"{entry['pair']} {entry['phase']}; (sequences, longest) of each: {entry['keys']}\n")
        for name, walls in entry.items():
            if name in ("pair", "phase", "tokens", "keys"):
                continue
            cell = ", ".join(f"{w:.1f}" for w in walls) if isinstance(walls, list) else walls
            lines.append(f"- {name}: {cell}")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
