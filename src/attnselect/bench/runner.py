"""``attnselect bench``: every candidate and every policy on real model shapes, side by side in one run.

For each problem of the suite it times every supported candidate and torch's default side by side
(forward, or forward+backward when training; interleaved rounds of repeats, median and p20..p80; as the
measure policy tunes, with twice its rounds: after a screening round, the steps more than 25% behind the
fastest keep that timing and the rest take many short turns, and near-ties, within 3%, up to 8x as many)
and reports the choice of each policy:

- ``rules`` and ``measure`` (attnselect's two policies),
- ``te``: TransformerEngine's selection emulated on our verdicts (docs/sources/te_backend_selection.md):
  FlashAttention, fused (cuDNN) and unfused (math) attention; on sm90+ flash is dropped when fused also
  serves; order flash > fused > unfused; PR #3339 pads only when the native shape gets unfused and the
  padded one does not, or when the native shape gets FlashAttention-2,
- ``always-pad`` and ``never-pad`` (the rules with padding forced or forbidden),
- ``torch-default``: what a user gets from plain F.scaled_dot_product_attention (its own dispatch) or,
  for packed input, torch's varlen_attn with V padded.

Output: JSON, a markdown table and, where matplotlib is installed, a PNG chart of TFLOP/s per policy.
Resumable: problems already in ``--out``.json are skipped; ``--deadline`` stops cleanly. ``--shard K/N``
times every N-th problem from the K-th (one process per GPU), ``--merge`` joins the shards' reports.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F

from attnselect.bench.models import MODELS
from attnselect.bench.report import POLICIES, chart, report_markdown
from attnselect.bench.te import te_choice
from attnselect.choose.candidates import judge
from attnselect.choose.rules import arch_family
from attnselect.choose.selection import select
from attnselect.choose.timing import (
    CONTENDER_FACTOR,
    REPEATS,
    ROUNDS,
    WARMUP,
    Settle,
    candidate_step,
    random_inputs,
    time_steps,
)
from attnselect.errors import InvalidInputError
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target


def suite(smoke: bool) -> dict[str, tuple[AttentionProblem, str]]:
    """Real model shapes: (model, heads override) x layout x phase x sequence length, keyed by the problem;
    each with the models it stands for (DeepSeek-V2-Lite's 16 heads of 192/128 are DeepSeek-V3's per rank)."""
    if smoke:
        shapes, seqlens, dtype = [("deepseek-v2-lite", 4)], [64], torch.float32
    else:
        # Most telling first, so a run cut short by its deadline (it resumes) has the key shapes.
        shapes = [
            ("deepseek-v3", 16),
            ("llama-3-70b", None),
            ("deepseek-v3-absorbed", None),
            ("kimi-k2", None),
            ("deepseek-v2-lite", None),
            ("deepseek-v3", 128),
        ]
        seqlens, dtype = [1024, 4096, 16384], torch.bfloat16
    problems: dict[str, tuple[AttentionProblem, str]] = {}
    for (model, heads), seqlen, layout, training in (
        (s, n, lay, tr) for s in shapes for n in seqlens for lay in ("bshd", "thd") for tr in (False, True)
    ):
        m = MODELS[model]
        if model == "deepseek-v3-absorbed" and (training or layout == "thd"):
            continue  # absorbed MLA is an inference (decode/prefill) shape
        hq = heads or m.heads
        hkv = hq if m.kv_heads == m.heads else m.kv_heads
        tokens = 16384 if not smoke else 128
        batch = max(tokens // seqlen, 1)
        problem = AttentionProblem(
            batch=batch,
            seqlen_q=seqlen,
            seqlen_kv=seqlen,
            heads_q=hq,
            heads_kv=hkv,
            head_dim_qk=m.head_dim_qk,
            head_dim_v=m.head_dim_v,
            dtype=dtype,
            layout=layout,
            mask="causal",
            training=training,
        )
        label = model + (f" ({heads} heads)" if heads else "")
        key = _key(problem)
        problems[key] = (problem, f"{problems[key][1]}, {label}" if key in problems else label)
    return problems


def _key(problem: AttentionProblem) -> str:
    return json.dumps(problem.to_dict(), sort_keys=True)


def useful_tflops(problem: AttentionProblem, ms: float, pairs: float | None = None) -> float:
    """TFLOP/s on useful causal work: ``pairs`` visible (query, key) pairs a call (packed calls: the mean over the
    packings timed, timing.NewPackings.causal_pairs), by default B full-length sequences."""
    pairs = problem.batch * problem.seqlen_q * (problem.seqlen_q + 1) / 2 if pairs is None else pairs
    flops = 2 * problem.heads_q * (problem.head_dim_qk + problem.head_dim_v) * pairs
    return flops * (3.5 if problem.training else 1.0) / (ms * 1e-3) / 1e12


RULE_POLICIES = ("rules", "te", "always-pad", "never-pad")  # decided without timing: re-derivable


def bench_problem(problem: AttentionProblem, target: Target) -> dict:
    device = torch.device("cuda" if target.is_cuda else "cpu")
    supported = {v.candidate for v in judge(problem, target) if v.supported}
    inputs = random_inputs(problem, device)
    steps = {TORCH_DEFAULT: lambda: _torch_default(problem, inputs)}
    ordered = sorted(supported, key=str)
    steps.update({str(c): candidate_step(c, problem, target, inputs) for c in ordered})
    rows = _timed(steps, device, problem, inputs[4].causal_pairs() if inputs[4] is not None else None)
    for c in ordered:  # each row says which candidate it is (the display string is only a label)
        rows[str(c)].update(c.to_dict())
    default = rows.pop(TORCH_DEFAULT)
    choices = {policy: _choice(policy, problem, target, supported, rows) for policy in (*RULE_POLICIES, "measure")}
    choices["torch-default"] = {
        "candidate": "F.scaled_dot_product_attention" if problem.layout != "thd" else "varlen_attn, V padded",
        **default,
    }
    best = min((r for r in rows.values() if "median_ms" in r), key=lambda r: r["median_ms"], default=None)
    return {
        "problem": problem.to_dict(),
        "describe": problem.describe(),
        "candidates": rows,
        "policies": {policy: choices[policy] for policy in POLICIES},
        "best_ms": best and best["median_ms"],
    }


def _choice(policy: str, problem: AttentionProblem, target: Target, supported: set, rows: dict) -> dict:
    if policy == "te":
        return _timed_choice(te_choice(problem, target, supported), rows)
    try:
        if policy == "measure":  # times the candidates again, as a user's first call would
            return _timed_choice(select(problem, target=target, policy="measure").chosen, rows)
        pad = {"always-pad": True, "never-pad": False}.get(policy)
        return _timed_choice(select(problem, target=target, pad=pad).chosen, rows)
    except Exception as exc:  # a policy that finds nothing is part of the comparison
        return {"candidate": None, "error": _first_line(exc)}


def _timed_choice(choice: Candidate | None, rows: dict) -> dict:
    return {"candidate": str(choice), **rows.get(str(choice), {"error": "not timed"})}


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def rechoose(report: dict, target: Target) -> int:
    """Re-derive the untimed policies' choices of stored results with the current rules, on the stored
    timings of that run (the rules changed after it); the choice made when the problem was timed is
    kept as ``was``. Returns how many choices changed."""
    changed = 0
    for entry in report["results"]:
        problem = AttentionProblem.from_dict(entry["problem"])
        supported = {Candidate(row["backend"], row["pad_to"]) for row in entry["candidates"].values()}
        for policy in RULE_POLICIES:
            fresh = _choice(policy, problem, target, supported, entry["candidates"])
            old = entry["policies"].get(policy, {})
            if fresh.get("candidate") != old.get("candidate"):
                timed = old.get("was", old.get("candidate"))  # the choice made when the problem was timed
                entry["policies"][policy] = fresh if fresh.get("candidate") == timed else {**fresh, "was": timed}
                changed += 1
    return changed


def _torch_default(problem, inputs):
    q, k, v, grad_out, packings = inputs
    if problem.layout == "thd":
        from torch.nn.attention.varlen import varlen_attn

        packing = packings()
        pad = problem.head_dim_qk - problem.head_dim_v
        v_padded = F.pad(v, (0, pad)) if pad > 0 else v
        out = varlen_attn(
            q,
            k,
            v_padded,
            packing.cu_seqlens_q,
            packing.cu_seqlens_kv,
            packing.max_seqlen_q,
            packing.max_seqlen_kv,
            window_size=(-1, 0),
        )[..., : problem.head_dim_v]
    else:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=problem.heads_q != problem.heads_kv,
        ).transpose(1, 2)
    if problem.training:
        torch.autograd.grad(out, (q, k, v), grad_out)


CANDIDATE_BUDGET_S = 2.0  # timing per candidate and problem, warm-up included: slow kernels stay affordable (those
# far behind may rest on one to three calls; each row counts its repeats)
TORCH_DEFAULT = "torch-default"


# Near-ties (within 3% of the fastest) decide the 2% and 3% goals, and on a long kernel this H200's turn-to-turn
# spread (p20..p80 4% to 8% on 9..28 ms training steps) leaves the bench's 32 rounds about 1% apart on one kernel;
# 256 rounds settled them within 0.3% (results/h200_median_convergence.md). Up to that, in at most 20 s a problem.
SETTLE = Settle(within=1.03, seconds=20.0, rounds=8 * 2 * ROUNDS)


def timing_rounds(steps: int) -> dict:
    """time_steps' options for timing ``steps`` steps as the bench does: as measure tunes but with twice its
    rounds, since the bench judges measure's choice (a screening round, then many short turns of the steps
    within CONTENDER_FACTOR of the fastest; those further behind keep their screening timing), then SETTLE's
    rounds for the near-ties. The budget sizes the repeats and never leaves a step out."""
    return {
        "warmup": WARMUP,
        "repeats": 2 * REPEATS,
        "rounds": 2 * ROUNDS,
        "budget_s": CANDIDATE_BUDGET_S * steps,
        "keep_within": CONTENDER_FACTOR,
        "settle": SETTLE,
    }


def _timed(steps: dict, device, problem, pairs: float | None = None) -> dict:
    """Every step timed side by side in interleaved rounds (time_steps), so drift lands on all alike."""
    results = time_steps(steps, device, **timing_rounds(len(steps)))
    rows = {}
    for key in steps:
        t = results[key]
        if isinstance(t, Exception):  # what fails is part of the comparison
            rows[key] = {"error": f"{type(t).__name__}: {_first_line(t)[:160]}"}
        else:
            rows[key] = {
                "median_ms": t.median_ms,
                "p20_ms": t.low_ms,
                "p80_ms": t.high_ms,
                "repeats": t.repeats,
                "tflops": useful_tflops(problem, t.median_ms, pairs),
            }
    return rows


def render(out: str, report: dict | None = None) -> dict:
    """Write the markdown table and the PNG chart of ``report`` (default: read from ``out``.json, e.g. again
    where matplotlib is installed)."""
    report = report if report is not None else json.load(open(out + ".json"))
    labels = {key: models for key, (_, models) in {**suite(smoke=True), **suite(smoke=False)}.items()}
    for entry in report["results"]:  # results stored before entries named their models
        entry.setdefault("models", labels.get(_key(AttentionProblem.from_dict(entry["problem"])), ""))
    with open(out + ".md", "w") as f:
        f.write(report_markdown(report))
    chart(report, out + ".png")
    return report


def run(
    out: str,
    *,
    smoke: bool = False,
    deadline_s: float = 540.0,
    shard: tuple[int, int] = (0, 1),
    only: tuple[str, ...] = (),
) -> dict:
    """Time the suite's problems not yet in ``out``.json (those of ``shard`` = (k, n): every n-th from the
    k-th; with ``only``, those whose description or models contain one of its texts), writing the JSON after
    each, then the markdown and chart."""
    target = Target.current()
    path = out + ".json"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    report = json.load(open(path)) if os.path.exists(path) else {"results": []}
    k, n = shard
    written_by = report.get("meta", {}).get("shard", "0/1")
    if report["results"] and written_by != f"{k}/{n}":
        raise InvalidInputError(
            f"shard: {out}.json holds shard {written_by}, not {k}/{n}; resume it with --shard "
            f"{written_by} or write this shard elsewhere"
        )
    if report["results"] and report["meta"]["device"] == target.describe():
        print(f"{rechoose(report, target)} stored choices re-derived with the current rules", flush=True)
    report["meta"] = {
        "device": target.describe(),
        "arch": arch_family(target),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        **({"shard": f"{k}/{n}"} if n > 1 else {}),
    }
    problems = suite(smoke)
    # Read through AttentionProblem, so results written before a field existed still count as done.
    done = {_key(AttentionProblem.from_dict(e["problem"])) for e in report["results"]}
    start = time.time()
    for index, (key, (problem, models)) in enumerate(problems.items()):
        if key in done or index % n != k or (only and not any(t in f"{problem.describe()} {models}" for t in only)):
            continue
        if time.time() - start > deadline_s:
            print("deadline reached; run again to continue", flush=True)
            break
        began = time.time()
        entry = {**bench_problem(problem, target), "models": models}
        entry["seconds"] = round(time.time() - began, 1)  # the problem's share of the run, for planning runs
        report["results"].append(entry)
        print(
            f"{entry['describe']}: " + ", ".join(f"{p} {c.get('candidate')}" for p, c in entry["policies"].items()),
            flush=True,
        )
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    return render(out, report)


def merge(out: str, parts: list[str]) -> dict:
    """Join the reports of ``parts`` (shards run side by side, on GPUs of one kind) into ``out``.json."""
    reports = [json.load(open(path)) for path in parts]
    devices = {r["meta"]["device"] for r in reports}
    if len(devices) != 1:
        raise InvalidInputError(f"parts: expected reports of one device, got {sorted(devices)}")
    results = {}
    for path, report in zip(parts, reports):
        for entry in report["results"]:
            key = _key(AttentionProblem.from_dict(entry["problem"]))
            if results.get(key, entry) != entry:  # the same entry twice (a part resumed from another) is fine
                raise InvalidInputError(
                    f"parts: {path} holds a second, different timing of {entry['describe']}; merge the parts of one run"
                )
            results[key] = entry
    dates = sorted({report["meta"]["date"] for report in reports})
    meta = {name: value for name, value in reports[0]["meta"].items() if name != "shard"}
    meta["date"] = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    order = {key: i for i, key in enumerate([*suite(smoke=False), *suite(smoke=True)])}  # the suite's order
    merged = {
        "meta": meta,
        "results": [results[key] for key in sorted(results, key=lambda key: order.get(key, len(order)))],
    }
    os.makedirs(os.path.dirname(out + ".json") or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(merged, f, indent=1)
    return render(out, merged)
