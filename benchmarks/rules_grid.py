"""Check the rules against a real GPU: run a grid of problems through every backend the machine has.

For each problem and each (backend, pad_to) candidate it records what the rules predict
(supported or not, with reasons) and what really happens: does the forward run (and the
backward, when training), and do the output and the three gradients match a float64
reference to bf16 tolerance. A row agrees when prediction and reality are the same.

    python benchmarks/rules_grid.py --out results/h200_rules_grid.jsonl [--resume FILE] [--deadline S]
        [--section main|odd|fa4] [--backends a,b | --skip a,b]

Rows are appended as they are measured, so a run cut short keeps what it did; --resume
skips the rows already in a file. ``benchmarks/grid_report.py`` turns the rows into the
markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import time

import torch

from attnselect import backends
from attnselect.choose.candidates import judge
from attnselect.execution import run_candidate
from attnselect.spec.options import Packing
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target
from attnselect.spec.validate import packing_facts

HEAD_DIMS = [(64, 64), (128, 128), (192, 128), (192, 192), (256, 256), (576, 512)]
DTYPES = [torch.bfloat16, torch.float16]
# (mask, window, seqlen_q, seqlen_kv, heads_kv, dropout_p): heads_q is 8.
SCENARIOS = [
    ("none", None, 256, 256, 8, 0.0),
    ("causal", None, 256, 256, 2, 0.0),
    ("causal", None, 128, 256, 8, 0.0),
    ("causal_bottom_right", None, 128, 256, 8, 0.0),
    ("sliding_window", (64, 0), 256, 256, 2, 0.0),
    ("none", None, 256, 256, 8, 0.125),
    ("causal", None, 512, 512, 1, 0.0),
    ("sliding_window", (96, 32), 256, 256, 8, 0.0),
    ("causal_bottom_right", None, 256, 128, 8, 0.0),  # the first 128 queries see no key
]
# Packed (thd): (mask, window, lengths_q, lengths_kv, heads_kv); mixed lengths with 1 and 0.
LENGTHS = [0, 1, 37, 256, 5, 130, 64]
THD_HEAD_DIMS = [(64, 64), (128, 128), (192, 128), (192, 192)]
THD_SCENARIOS = [
    ("causal", None, LENGTHS, LENGTHS, 8),
    ("none", None, LENGTHS, LENGTHS, 2),
    ("causal_bottom_right", None, LENGTHS, [3, 1, 40, 300, 5, 130, 80], 8),
    ("sliding_window", (48, 0), LENGTHS, LENGTHS, 2),
    # Queries without keys: fewer keys than queries (bottom-right) and an empty key sequence.
    ("causal_bottom_right", None, LENGTHS, [0, 1, 20, 128, 5, 0, 64], 2),
]
TOLERANCE = 2e-2  # relative Frobenius error; bf16/fp16 operands land between 1e-3 and 1e-2


# Head dims the main grid lacks: below 16 and not multiples of 8 (flex refuses < 16 on CUDA, FA2's varlen kernel
# and cuDNN need multiples of 8), with the scenarios most kernels differ on; their padded candidates round up.
ODD_HEAD_DIMS = [(8, 8), (15, 15), (59, 59)]
ODD_SCENARIOS = [SCENARIOS[0], SCENARIOS[1], SCENARIOS[3]]
# FlashAttention-4 compiles every configuration on first use (6-19 s, results/h200_fa4_compile.md), so its rows
# cover a chosen part of the grid: bf16, the head dims MLA and its controls use, GQA, bottom-right causal, windows,
# packed sequences of length 0 and 1 and keyless queries, training and inference; and the odd head dims.
FA4_HEAD_DIMS = [(128, 128), (192, 128), (192, 192)]
FA4_SCENARIOS = [SCENARIOS[1], SCENARIOS[3], SCENARIOS[7]]
FA4_THD_HEAD_DIMS = [(128, 128), (192, 128)]
FA4_THD_SCENARIOS = [THD_SCENARIOS[0], THD_SCENARIOS[4]]
# Head dims below 128 other than 64, where FA4's sm90 backward returned wrong gradients for 8, 16 and 48 on the H200.
FA4_SMALL_HEAD_DIMS = [
    (8, 8),
    (16, 16),
    (24, 24),
    (32, 32),
    (40, 40),
    (48, 48),
    (56, 56),
    (80, 80),
    (96, 96),
    (112, 112),
]
SECTIONS = ("main", "odd", "fa4")


def _dense(head_dims, dtypes, scenarios):
    for (dqk, dv), dtype, training, scenario in itertools.product(head_dims, dtypes, (False, True), scenarios):
        mask, window, sq, skv, hkv, dropout = scenario
        yield (
            AttentionProblem(
                batch=2,
                seqlen_q=sq,
                seqlen_kv=skv,
                heads_q=8,
                heads_kv=hkv,
                head_dim_qk=dqk,
                head_dim_v=dv,
                dtype=dtype,
                layout="bshd",
                mask=mask,
                window=window,
                dropout_p=dropout,
                training=training,
            ),
            None,
        )


def _packed(head_dims, dtypes, scenarios):
    for (dqk, dv), dtype, training, scenario in itertools.product(head_dims, dtypes, (False, True), scenarios):
        mask, window, lengths_q, lengths_kv, hkv = scenario
        yield (
            AttentionProblem(
                batch=len(lengths_q),
                seqlen_q=max(lengths_q),
                seqlen_kv=max(lengths_kv),
                heads_q=8,
                heads_kv=hkv,
                head_dim_qk=dqk,
                head_dim_v=dv,
                dtype=dtype,
                layout="thd",
                mask=mask,
                window=window,
                training=training,
                **packing_facts(mask, window, lengths_q, lengths_kv),
            ),
            (lengths_q, lengths_kv),
        )


def grid(section: str = "main"):
    """(problem, (lengths_q, lengths_kv) for thd or None). main: 216 dense problems, then 80 packed ones;
    odd: 18 dense and 4 packed of the odd head dims; fa4: FlashAttention-4's 18 dense, 4 odd, 8 packed and 20 of
    small head dims."""
    bf16 = [torch.bfloat16]
    if section == "main":
        yield from _dense(HEAD_DIMS, DTYPES, SCENARIOS)
        yield from _packed(THD_HEAD_DIMS, DTYPES, THD_SCENARIOS)
    elif section == "odd":
        yield from _dense(ODD_HEAD_DIMS, bf16, ODD_SCENARIOS)
        yield from _packed(ODD_HEAD_DIMS[1:], bf16, THD_SCENARIOS[:1])
    elif section == "fa4":
        yield from _dense(FA4_HEAD_DIMS, bf16, FA4_SCENARIOS)
        yield from _dense(ODD_HEAD_DIMS[1:], bf16, SCENARIOS[1:2])
        yield from _packed(FA4_THD_HEAD_DIMS, bf16, FA4_THD_SCENARIOS)
        yield from _dense(FA4_SMALL_HEAD_DIMS, bf16, SCENARIOS[1:2])
    else:
        raise ValueError(f"section: got {section!r}, expected one of {', '.join(SECTIONS)}")


def row_key(problem: dict, lengths, backend: str, pad_to) -> tuple:
    """A row's identity. Read through AttentionProblem, so rows written before a field existed get its
    default; the thd facts (varlen_*) follow from the lengths, so they are left out."""
    shape = {
        name: value
        for name, value in AttentionProblem.from_dict(problem).to_dict().items()
        if not name.startswith("varlen_")
    }
    return json.dumps(shape, sort_keys=True), json.dumps(lengths), backend, pad_to


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(problem, candidate, inputs, reference) -> dict:
    q, k, v, grad_out, packing = inputs
    leaves = [t.detach().clone().requires_grad_(problem.training) for t in (q, k, v)]
    row = {"ran_forward": False, "ran_backward": None, "error": None, "out_err": None, "grad_err": None}
    try:
        out, _ = run_candidate(candidate, problem, *leaves, packing=packing)
        _sync()
        row["ran_forward"] = True
        if problem.training:
            out.backward(grad_out)
            _sync()
            row["ran_backward"] = True
    except Exception as exc:  # reality is whatever the kernel does: record it
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        if row["ran_forward"]:
            row["ran_backward"] = False
        return row
    finite = bool(torch.isfinite(out).all())
    ref_out, ref_grads = reference
    row["out_err"] = rel(out, ref_out)
    if problem.dropout_p:
        # Dropout cannot match the no-dropout reference; it must run finite and visibly drop
        # (a kernel that ignores dropout_p would match the reference and so fail here).
        row["matches"] = finite and row["out_err"] > 5 * TOLERANCE
        return row
    if problem.training:
        row["grad_err"] = max(rel(t.grad, g) for t, g in zip(leaves, ref_grads))
    row["matches"] = finite and row["out_err"] < TOLERANCE and (row["grad_err"] or 0.0) < TOLERANCE
    return row


def make_inputs(problem, lengths, device):
    """(q, k, v, grad_out, packing or None) of random data for the problem."""
    g = torch.Generator(device=device).manual_seed(hash(problem) % (1 << 31))
    packing = None
    if lengths is None:
        shape = lambda s, h, d: (problem.batch, s, h, d)  # noqa: E731
        sq, skv = problem.seqlen_q, problem.seqlen_kv
    else:
        shape = lambda t, h, d: (t, h, d)  # noqa: E731
        sq, skv = sum(lengths[0]), sum(lengths[1])
        cu = [torch.tensor([0, *itertools.accumulate(ls)], dtype=torch.int32, device=device) for ls in lengths]
        packing = Packing(cu[0], cu[1], problem.seqlen_q, problem.seqlen_kv, cu[0], cu[1])
    q = torch.randn(shape(sq, problem.heads_q, problem.head_dim_qk), generator=g, device=device)
    k = torch.randn(shape(skv, problem.heads_kv, problem.head_dim_qk), generator=g, device=device)
    v = torch.randn(shape(skv, problem.heads_kv, problem.head_dim_v), generator=g, device=device)
    grad_out = torch.randn(shape(sq, problem.heads_q, problem.head_dim_v), generator=g, device=device)
    return (*(t.to(problem.dtype) for t in (q, k, v, grad_out)), packing)


def float64_reference(problem, inputs):
    from attnselect.spec.options import Candidate

    *tensors, packing = inputs
    q, k, v, grad_out = (t.double() for t in tensors)
    leaves = [t.requires_grad_(problem.training) for t in (q, k, v)]
    without_dropout = dataclasses.replace(problem, dropout_p=0.0)
    out, _ = run_candidate(Candidate("reference"), without_dropout, *leaves, packing=packing)
    if not problem.training:
        return out.detach(), None
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", help="a previous rows file; its rows are copied and skipped")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds; stop cleanly after this")
    ap.add_argument("--limit", type=int, help="only the first N problems (smoke test)")
    ap.add_argument("--backends", help="comma list (default: every backend the machine has)")
    ap.add_argument("--skip", default="", help="comma list of backends left out")
    ap.add_argument("--section", choices=SECTIONS, default="main", help="which problems (see grid())")
    a = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 4096
    torch._dynamo.config.accumulated_cache_size_limit = 8192
    start = time.time()
    target = Target.current()
    device = "cuda" if target.is_cuda else "cpu"
    wanted = set(a.backends.split(",")) if a.backends else None
    skipped = set(filter(None, a.skip.split(",")))
    done = set()
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "a") as sink:
        if a.resume and os.path.exists(a.resume):
            same = os.path.abspath(a.resume) == os.path.abspath(a.out)  # resuming in place: nothing to copy
            for line in open(a.resume):
                row = json.loads(line)
                done.add(row_key(row["problem"], row.get("lengths"), row["backend"], row["pad_to"]))
                if not same:
                    sink.write(line)
        for problem, lengths in itertools.islice(grid(a.section), a.limit):
            verdicts = [
                v
                for v in judge(problem, target)
                if not (
                    backends.get(v.candidate.backend).package
                    and v.reasons
                    == (f"package {backends.get(v.candidate.backend).package.distribution} is not installed",)
                )
                and (wanted is None or v.candidate.backend in wanted)
                and v.candidate.backend not in skipped
            ]
            todo = [
                v
                for v in verdicts
                if row_key(problem.to_dict(), lengths, v.candidate.backend, v.candidate.pad_to) not in done
            ]
            if not todo:
                continue
            if time.time() - start > a.deadline:
                print("deadline reached; rerun with --resume to continue", flush=True)
                break
            inputs = make_inputs(problem, lengths, device)
            reference = float64_reference(problem, inputs)
            for verdict in todo:
                t0 = time.time()
                row = measure(problem, verdict.candidate, inputs, reference)
                really = row["ran_forward"] and row["ran_backward"] is not False and row["matches"]
                row.update(
                    problem=problem.to_dict(),
                    lengths=lengths,
                    backend=verdict.candidate.backend,
                    pad_to=verdict.candidate.pad_to,
                    predicted=verdict.supported,
                    reasons=list(verdict.reasons),
                    really=bool(really),
                    agrees=verdict.supported == bool(really),
                    seconds=round(time.time() - t0, 3),
                )
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                if not row["agrees"]:
                    print(
                        f"DISAGREE {problem.describe()} | {verdict.candidate} predicted={verdict.supported} "
                        f"really={bool(really)} {row['error'] or ''} out_err={row['out_err']} "
                        f"grad_err={row['grad_err']}",
                        flush=True,
                    )
    meta = {
        "device": target.describe(),
        "target": target.to_dict(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": target.cudnn_version,
        "date": time.strftime("%Y-%m-%d"),
        "tolerance": TOLERANCE,
    }
    with open(a.out + ".meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    rows = [json.loads(line) for line in open(a.out)]
    agree = sum(r["agrees"] for r in rows)
    problems = {row_key(r["problem"], r.get("lengths"), "", None) for r in rows}
    print(
        f"{len(rows)} rows, {len(problems)} problems, "
        f"agreement {agree}/{len(rows)} = {100 * agree / max(len(rows), 1):.2f}% "
        f"on {target.describe()} in {time.time() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
