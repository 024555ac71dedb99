"""Where a new packing's first call spends its host time: attention()'s path for a packed call known but for its
packing's sizes (attnselect.dispatch's sibling), stage by stage.

    python benchmarks/new_packing_parts.py [--calls 150] [--rounds 7] [--training] [--out OUT]

The new-packing case of benchmarks/hot_path.py (1024 tokens in 1 to 8 documents, a new packing each call, H16,
128/128 bf16, causal, both max_seqlen given, inference; CPU: its small stand-in, which attention() does not memoize,
so only the whole calls are timed there); ``--training``: each call's forward and backward (``torch.autograd.grad``
of the output, the replay's backward a stage of its own). Rows, each the median over ``--rounds`` rounds of the
per-call mean over ``--calls`` calls, each on a packing not seen before:

- attention() as users call it; the chosen kernel's op called directly (torch's ``aten._flash_attention_forward``
  where the choice is ``varlen_fa2``, the package's ``flash_attn_varlen_func`` for FlashAttention packages); torch's
  ``varlen_attn``;
- the stages of attention()'s path, replayed in its order on the same state (each call remembered as attention()
  remembers it): the memo lookup (``dispatch.recall``: a miss with a sibling), apart from the call of the packing's
  class it makes where that class stands (``dispatch._class_call``: the call is then known), else the problem at the
  new sizes, the packed selection (``select_packed``), the runner (``packed_runner``), the self-check's question
  (``self_check.needed``) and the memo's entry (``Unknown.remember``); then the run.

``--host-stages h200`` times the replay's host stages alone (its run left out) on meta tensors for a preset target at
the packaged calibration's versions: no GPU needed, so a change to the host path can be compared on any machine
(``PYTHONPATH=<other checkout>/src`` for the other version).

The replay copies api.attention's sibling branch (a rental's call counting, ``_renting``, left out: about a
microsecond). It stops the script where attention() no longer holds the lines it copies (:data:`MIRRORED`), and where
its problem, choice or result differ from those attention() makes for the same packing validated afresh.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import attnselect
from attnselect import api, backends, dispatch, self_check
from attnselect.choose.predict import work_class
from attnselect.choose.selection import select_packed
from attnselect.dispatch import KnownCall
from attnselect.execution import kernel_call, packed_runner
from attnselect.spec.options import CallOptions, Packing
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target
from hot_path import new_packings, profile, write_report

# select_packed apart on a new packing of a work class (and size class) new in the round and of one seen
CLASSES = ("select_packed, a work class seen", "select_packed, a new work class")
STAGES = ("recall", "its class's call", "problem at the new sizes", "select_packed", "packed_runner",
          "self_check.needed", "remember", "run")  # fmt: skip

FA4_STAND_IN = {"flash_attn.cute": ("flash_attn_varlen_func", "flash_attn_func")}  # what FA4's runners bind


# What the replay copies from api.attention's sibling branch, as written there.
MIRRORED = (
    "problem = unknown.sized_problem(sibling) if sibling is not None else None",
    "select_packed(problem, target=target, backend=backend, pad=pad, disable=disable)",
    "again = sibling is not None and sibling.chosen == decision.chosen and sibling.runner is not None",
    'runner = getattr(sibling.runner, "unrented", sibling.runner)',
    "runner = packed_runner(chosen, decision.chosen.pad_to, call, like=(q, k, v, packing))",
    "unchecked = unknown.family.unchecked if unknown is not None and unknown.family is not None else ()",
    "answered = bool(unchecked) and (decision.chosen, problem.size_class) in unchecked",
    "checking = not answered and self_check.needed(problem, decision.chosen, target)",
    "family = unknown.remember(known)",
    "if family is not None and not (answered or checking) and self_check.has_work(problem):",
    "family.unchecked.add((decision.chosen, problem.size_class))",
    "else known.runner(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_kv)",
    "_keep_class(family, problem, decision, known, target=target, backend=backend, pad=pad, disable=disable)",
)


def options_of(cu, m, backend=None) -> tuple:
    return tuple(CallOptions("thd", True, cu_seqlens_q=cu, max_seqlen_q=m, max_seqlen_kv=m, backend=backend))


def replay(q, k, v, cu, m, times: dict, target=None, backend=None):
    """attention()'s path on one new packing, each stage's nanoseconds added to ``times``; with a ``target`` (meta
    tensors: :func:`host_stages`) for that target, its run left out; ``backend``: forced. (The candidate chosen, the
    call's problem, the run's result), or None where the packing's sizes were seen before (known: nothing is added).
    A new packing of a class that stands is known by recall: its class's call (dispatch._class_call) is timed apart
    from the rest of recall."""
    _time_class_calls()
    clock, within = time.perf_counter_ns, _CLASS_CALLS[1]
    within[:] = [0, 0]
    t0 = clock()
    unknown = dispatch.recall(q, k, v, options_of(cu, m, backend))
    t1 = clock()
    # recall apart from its class call and the problem it makes for it (dispatch._in_family)
    spent = {"recall": t1 - t0 - within[0] - within[1], "its class's call": within[0]}
    if type(unknown) is KnownCall and not within[0]:  # known at these sizes: no class call asked
        return None
    if type(unknown) is KnownCall:  # a class decided before: its call at these sizes
        known = unknown
        chosen, problem = known.chosen, known.problem
    else:
        sibling = unknown.sibling
        problem = unknown.sized_problem(sibling)
        target = target or sibling.target
        t2 = clock()
        packing = Packing(cu, cu, m, m, cu, cu)
        decision = select_packed(problem, target=target, backend=backend)
        t3 = clock()
        again = sibling.chosen == decision.chosen and sibling.runner is not None
        backend_of = backends.get(decision.chosen.backend)
        if again:
            runner = getattr(sibling.runner, "unrented", sibling.runner)
        else:
            runner = packed_runner(backend_of, decision.chosen.pad_to, sibling.call, like=(q, k, v, packing))
        t4 = clock()
        unchecked = unknown.family.unchecked
        answered = bool(unchecked) and (decision.chosen, problem.size_class) in unchecked
        checking = not answered and self_check.needed(problem, decision.chosen, target)
        t5 = clock()
        known = KnownCall(problem, decision.chosen, target, sibling.call, backend is not None, runner)
        family = unknown.remember(known)
        if not (answered or checking) and self_check.has_work(problem):
            family.unchecked.add((decision.chosen, problem.size_class))
        api._keep_class(family, problem, decision, known, target=target, backend=backend, pad=None, disable=None)
        t6 = clock()
        chosen = decision.chosen
        if checking and q.device.type == "meta":  # no run, so no self-check: taken as passed, as attention()'s first
            self_check._PASSED.add((target, decision.chosen, problem.signature))  # call of a signature passes it
        spent.update({"select_packed": t3 - t2, "packed_runner": t4 - t3, "self_check.needed": t5 - t4,
                      "remember": t6 - t5})  # fmt: skip
    spent["problem at the new sizes"] = within[1]  # made in recall (dispatch._in_family), or above
    t7 = clock()
    out = known.runner(q, k, v, cu, m, m) if q.device.type != "meta" else None
    spent["run"] = clock() - t7
    for name, ns in spent.items():
        times[name] += ns
    return chosen, problem, out


def _time_class_calls() -> None:
    """Wrap dispatch._class_call (what recall calls for a new packing of a class that stands) and
    AttentionProblem._at_sizes (the problem at the new sizes, made in recall where the family asks for its class) so
    that the replay reads their nanoseconds apart (:data:`_CLASS_CALLS`): once per process."""
    if _CLASS_CALLS[0] is not None:
        return
    _CLASS_CALLS[0] = dispatch._class_call = _timed(dispatch._class_call, 0)
    AttentionProblem._at_sizes = _timed(AttentionProblem._at_sizes, 1)


def _timed(function, slot: int):
    """``function``, its nanoseconds added to ``_CLASS_CALLS[1][slot]``."""
    spent, clock = _CLASS_CALLS[1], time.perf_counter_ns

    def timed(*args):
        start = clock()
        result = function(*args)
        spent[slot] += clock() - start
        return result

    return timed


# the class call's wrapper, once installed, and the last call's nanoseconds in its class call and its problem
_CLASS_CALLS = [None, [0, 0]]


def host_stages(name: str, calls: int, rounds: int, fa4: bool = False, mla: bool = False, backend=None,
                paid: bool = False, training: bool = False, tokens: int = 2048) -> tuple[dict, dict]:  # fmt: skip
    """The replay's host stages (its run left out) for the preset target ``name`` on any machine: meta tensors, the
    target at the packaged calibration's versions (the cuDNN frontend installed, and FlashAttention-4 with ``fa4``),
    the memo seeded by hand as a first call would seed it, a cache directory of its own. ``mla``: the size ladder's
    packings of ``tokens`` (lognormal documents, :func:`ladder.packing_lengths`), 192/128, where sizes repeat and work
    classes are new at first, in place of 1024 tokens in 1 to 8 documents at 128/128; ``backend``: forced;
    ``paid``: FlashAttention-4's compile paid in the process (first_calls.ran); ``training``: q, k and v require
    gradients. ({stage: per-round microseconds a call}, over the packings not seen before; {CLASSES: per-round
    median microseconds of select_packed on a packing whose work class and size class the round had not seen
    before, and on one whose it had, with their counts; "calls on <candidate>": per-round counts of the choices})."""
    import tempfile

    from attnselect.choose import first_calls
    from ladder import packing_lengths

    # the packaged calibration alone: no calibration or recorded failure of this machine's cache directory
    os.environ["ATTNSELECT_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnselect-host-stages-")
    packages = {"nvidia-cudnn-frontend": "1.32.0", **({"flash-attn-4": "4.0.0b36"} if fa4 else {})}
    # the runners bind their packages' functions; the run is left out
    if fa4 and "flash_attn" not in sys.modules and importlib.util.find_spec("flash_attn") is None:
        _stand_ins(FA4_STAND_IN)
    if "cudnn" not in sys.modules and importlib.util.find_spec("cudnn") is None:  # where the rules rank the frontend
        _stand_ins({"cudnn": ("sdpa_torch",)})
    target = Target.preset(name, packages=packages, torch_version="2.11.0+cu130", cudnn_version="9.19.0")
    tokens, d_qk, d_v = (tokens, 192, 128) if mla else (1024, 128, 128)
    q, k = (torch.empty(tokens, 16, d_qk, device="meta", dtype=torch.bfloat16, requires_grad=training)
            for _ in range(2))  # fmt: skip
    v = torch.empty(tokens, 16, d_v, device="meta", dtype=torch.bfloat16, requires_grad=training)
    if mla:
        shapes = [(len(lengths) + 1, max(lengths)) for lengths in map(lambda i: packing_lengths(tokens, i),
                                                                       range(1, calls + 2))]  # fmt: skip
    else:
        shapes = [(cu.numel(), m) for cu, m in new_packings(tokens, calls + 1, "cpu")]
    packings = [(torch.empty(n, dtype=torch.int32, device="meta"), m) for n, m in shapes]
    per_stage, by_class = {stage: [] for stage in STAGES[:-1]}, {}
    choices, rounds_done = {}, 0  # {str(candidate): per-round counts of new packings it was chosen for}
    # q's rows, as attention() describes the call (a checkout older than the problem's tokens has no such field)
    rows = {"tokens": tokens} if "tokens" in {f.name for f in dataclasses.fields(attnselect.AttentionProblem)} else {}
    for _ in range(rounds):
        attnselect.clear_cache()
        first_calls.forget()
        cu, m = packings[-1]
        first = attnselect.AttentionProblem(cu.numel() - 1, m, m, 16, 16, d_qk, d_v, layout="thd", mask="causal",
                                            dtype=torch.bfloat16, training=training, **rows)  # fmt: skip
        if paid:
            first_calls.ran(attnselect.Candidate("flash_attn4"), first)
        decision, call = select_packed(first, target=target, backend=backend), kernel_call(first)
        runner = packed_runner(backends.get(decision.chosen.backend), decision.chosen.pad_to, call,
                               like=(q, k, v, Packing(cu, cu, m, m, cu, cu)))  # fmt: skip
        family = dispatch.recall(q, k, v, options_of(cu, m, backend)).remember(
            KnownCall(first, decision.chosen, target, call, backend is not None, runner)
        )
        if not self_check.needed(first, decision.chosen, target):  # as attention() keeps the first call's answer
            family.unchecked.add((decision.chosen, first.size_class))
        times, made = dict.fromkeys(STAGES, 0), 0
        chosen = {name: 0 for name in choices}  # a candidate chosen in an earlier round and not in this one: 0
        seen, selects = {(work_class(first), first.size_class)}, {CLASSES[0]: [], CLASSES[1]: []}
        for cu, m in packings[:calls]:
            before = times["select_packed"]
            replayed = replay(q, k, v, cu, m, times, target, backend)
            if replayed is None:
                continue
            made += 1
            problem = replayed[1]
            chosen[str(replayed[0])] = chosen.get(str(replayed[0]), 0) + 1
            kind = (work_class(problem), problem.size_class)
            selects[CLASSES[kind not in seen]].append((times["select_packed"] - before) / 1e3)
            seen.add(kind)
        for stage in per_stage:
            per_stage[stage].append(times[stage] / made / 1e3)
        for kind, spent in selects.items():
            by_class.setdefault(kind, []).append(statistics.median(spent) if spent else float("nan"))
            by_class.setdefault(kind + " (calls)", []).append(len(spent))
        for candidate, count in chosen.items():  # one entry a round: a candidate first chosen now, 0 before
            choices.setdefault(candidate, [0] * rounds_done).append(count)
        rounds_done += 1
    first_calls.forget()
    by_class.update({f"calls on {candidate}": counts for candidate, counts in choices.items()})
    return per_stage, by_class


def _stand_ins(functions: dict[str, tuple[str, ...]]) -> None:
    """Modules of packages not installed here ({module: its functions}, parent packages made too): the replay's
    runners bind those functions, never call them (their run is left out)."""
    import types

    def not_installed(*args, **kwargs):
        raise RuntimeError("a stand-in for a package not installed (benchmarks/new_packing_parts.py --host-stages)")

    for name, names in functions.items():
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
        for depth in range(1, len(parts)):  # each parent holds its child, as an import binds it
            setattr(sys.modules[".".join(parts[:depth])], parts[depth], sys.modules[".".join(parts[: depth + 1])])
        for function in names:
            setattr(sys.modules[name], function, not_installed)


def compare(a) -> None:
    """--host-stages for two checkouts (``--compare BEFORE AFTER``: their src folders), alternated process by process,
    with and without FA4; writes ``--out``.json (every round) and .md (median and fastest round per stage)."""
    import subprocess
    import tempfile

    runs, classes = {}, {}
    flags = " ".join(f for f, on in (("--mla", a.mla), (f"--tokens {a.tokens}", a.mla and a.tokens != 2048),
                                      (f"--backend {a.backend}", a.backend), ("--paid", a.paid),
                                      ("--training", a.training)) if on)  # fmt: skip
    for fa4 in (True,) if a.backend == "flash_attn4" or a.paid else (False, True):
        for _ in range(a.repeats):
            for side, src in zip(("before", "after"), a.compare):
                out = Path(tempfile.mkdtemp()) / "stages"
                # each side's own replay where its checkout has one (the replay mirrors its attention())
                script = Path(src).parent / "benchmarks" / Path(__file__).name
                script = str(script if script.exists() else __file__)
                subprocess.run([sys.executable, script, "--host-stages", a.host_stages, "--calls", str(a.calls),
                                "--rounds", str(a.rounds), "--out", str(out), *(["--fa4"] if fa4 else []),
                                *(["--mla", "--tokens", str(a.tokens)] if a.mla else []),
                                *(["--backend", a.backend] if a.backend else []),
                                *(["--paid"] if a.paid else []), *(["--training"] if a.training else [])],
                               env={**os.environ, "PYTHONPATH": src}, check=True, capture_output=True)  # fmt: skip
                found = json.loads(out.with_suffix(".json").read_text())
                for stage, t in found["stages"].items():
                    runs.setdefault(str(fa4), {}).setdefault(side, {}).setdefault(stage, []).extend(t)
                for kind, t in found.get("by_class", {}).items():  # an older replay has none
                    classes.setdefault(str(fa4), {}).setdefault(side, {}).setdefault(kind, []).extend(t)
    commits = [subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or src for src in a.compare]  # fmt: skip
    report = {"target": a.host_stages, "calls_per_round": a.calls, "rounds": a.rounds, "repeats": a.repeats,
              "before": a.compare[0], "after": a.compare[1], "commits": commits, "date": time.strftime("%F"),
              "host": f"{os.cpu_count()} cores, torch {torch.__version__}", "runs": runs,
              "by_class": classes}  # fmt: skip
    lines = [f"# A new packing's host stages on the {a.host_stages} target, timed on this host: before and after\n",
             f"`benchmarks/new_packing_parts.py --host-stages {a.host_stages} {flags + ' ' if flags else ''}"
             "--compare BEFORE AFTER`, "
             f"{report['date']}, "
             f"{report['host']}: attention()'s sibling branch replayed on meta tensors, its kernel run left out; each "
             f"side's src folder in turn, {a.repeats} processes a side, {a.rounds} rounds of {a.calls} calls each. "
             f"Median microseconds a call over the rounds (fastest round). Before: {commits[0]}; after: {commits[1]} "
             "(and any change in its working tree)."]  # fmt: skip
    for fa4, sides in runs.items():
        lines += ["", f"## {'cuDNN frontend and FlashAttention-4' if fa4 == 'True' else 'cuDNN frontend'} installed",
                  "", "| stage | before | after |", "|---|---|---|"]  # fmt: skip
        for stage in dict.fromkeys([*sides["before"], *sides["after"]]):  # a stage one side's replay lacks: n/a
            cells = [sides[side].get(stage) for side in ("before", "after")]
            cells = [f"{statistics.median(t):.1f} ({min(t):.1f})" if t else "n/a" for t in cells]
            lines.append(f"| {stage} | {cells[0]} | {cells[1]} |")
        whole = {side: [sum(ts) for ts in zip(*sides[side].values())] for side in sides}
        lines.append(f"| all but the run | {statistics.median(whole['before']):.1f} ({min(whole['before']):.1f}) | "
                     f"{statistics.median(whole['after']):.1f} ({min(whole['after']):.1f}) |")  # fmt: skip
        split = classes.get(fa4, {})
        for kind in split.get("after", {}):  # select_packed apart by the work class's novelty (not in the sum)
            b, f = split.get("before", {}).get(kind), split["after"][kind]
            before = f"{statistics.median(b):.1f} ({min(b):.1f})" if b else "n/a"
            lines.append(f"| {kind} | {before} | {statistics.median(f):.1f} ({min(f):.1f}) |")
    print("\n".join(lines))
    if a.out:
        Path(a.out + ".json").write_text(json.dumps(report, indent=1))
        Path(a.out + ".md").write_text("\n".join(lines) + "\n")


def _first(result):
    """A package function's output: its first item where it returns (out, lse)."""
    return result[0] if isinstance(result, tuple) else result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", help="write .json and .md here")
    ap.add_argument("--host-stages", metavar="TARGET", help="the host stages alone for a preset target (h200), on meta "
                    "tensors: no GPU needed, no kernel run")  # fmt: skip
    ap.add_argument("--fa4", action="store_true", help="with --host-stages: FlashAttention-4 installed on the target")
    ap.add_argument("--mla", action="store_true", help="with --host-stages: the ladder's packings, 192/128")
    ap.add_argument("--tokens", type=int, default=2048, help="with --mla: tokens a packing (the ladder's rungs)")
    ap.add_argument("--backend", help="with --host-stages: this backend forced")
    ap.add_argument("--paid", action="store_true", help="with --host-stages: FlashAttention-4's compile paid")
    ap.add_argument(
        "--compare",
        nargs=2,
        metavar=("BEFORE", "AFTER"),
        help="with --host-stages: two checkouts' "
        "src folders, each timed in turn in its own processes (--repeats each, with FA4 and without)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--training", action="store_true", help="forward and backward (torch.autograd.grad); with "
                    "--host-stages: q, k and v require gradients")  # fmt: skip
    a = ap.parse_args()
    if a.host_stages and a.compare:
        return compare(a)
    if a.host_stages:
        stages, by_class = host_stages(
            a.host_stages, a.calls, a.rounds, a.fa4, a.mla, a.backend, a.paid, a.training, a.tokens
        )
        for stage, t in stages.items():
            print(f"| {stage} | {statistics.median(t):.1f} (fastest {min(t):.1f}) |")
        whole = [sum(ts) for ts in zip(*stages.values())]
        print(f"| all but the run | {statistics.median(whole):.1f} (fastest {min(whole):.1f}) |")
        for kind, t in by_class.items():
            print(f"| {kind} | {statistics.median(t):.1f} (fastest {min(t):.1f}) |")
        if a.out:
            tokens = a.tokens if a.mla else 1024
            report = dict(target=a.host_stages, fa4=a.fa4, training=a.training, tokens=tokens, stages=stages)
            Path(a.out + ".json").write_text(json.dumps(report | {"by_class": by_class}, indent=1))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    heads, total, dim = (16, 1024, 128) if device == "cuda" else (2, 256, 16)
    packings = new_packings(total, a.calls * (a.rounds + 1) * 4 + a.calls + 8, device)  # 5387 at most
    turn = iter(packings)
    q, k, v = (torch.randn(total, heads, dim, device=device, dtype=dtype, requires_grad=a.training) for _ in range(3))

    def backward(out):  # training: the output's gradients, the output as the upstream one
        return torch.autograd.grad(out, (q, k, v), out) if a.training else None

    def attention(cu, m):
        return attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, max_seqlen_q=m,
                                    max_seqlen_kv=m)  # fmt: skip

    cu, m = next(turn)
    attention(cu, m)  # the sibling every later call is known by
    chosen = attnselect.select(attnselect.AttentionProblem.from_tensors(
        q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, max_seqlen_q=m, max_seqlen_kv=m)).chosen  # fmt: skip
    rows = {"attention(), a new packing each call": lambda cu, m: backward(attention(cu, m))}
    backend = backends.get(chosen.backend)
    if chosen.backend == "varlen_fa2" and not chosen.padded:
        op = torch.ops.aten._flash_attention_forward.default  # the overload: no lookup among overloads a call
        rows["aten._flash_attention_forward, the chosen op"] = lambda cu, m: backward(
            op(q, k, v, cu, cu, m, m, 0.0, True, False, scale=dim**-0.5)[0])  # fmt: skip
    elif getattr(backend, "module", None) and not chosen.padded:
        function = importlib.import_module(backend.module).flash_attn_varlen_func
        rows[f"{backend.module}.flash_attn_varlen_func"] = lambda cu, m: backward(_first(function(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, causal=True)))  # fmt: skip
    if device == "cuda":
        from torch.nn.attention.varlen import varlen_attn

        rows["torch varlen_attn"] = lambda cu, m: backward(varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0)))
    memoized = device == "cuda"  # attention() memoizes packed calls with boundaries on the GPU only
    source = inspect.getsource(api.attention)
    if not all(line in source for line in MIRRORED):
        raise SystemExit("api.attention's sibling branch changed: update replay() and MIRRORED")
    if memoized:  # the replay makes what attention() makes
        cu, m = next(turn)
        made, problem, (out, *_) = replay(q, k, v, cu, m, dict.fromkeys(STAGES, 0))
        attnselect.clear_cache()  # attention() on that packing validates and decides afresh
        expected = attention(cu, m)
        known = dispatch.known_calls()[-1]
        if (problem, made) != (known.problem, known.chosen) or not torch.equal(out, expected):
            raise SystemExit("the replay's problem, choice or result differ from attention()'s")
        attention(*next(turn))  # a sibling again
    per_row = {name: [] for name in rows}
    per_stage = {name: [] for name in STAGES + (("backward",) if a.training else ())}
    for r in range(a.rounds + 1):  # the first round warms up
        for name, fn in rows.items() if r % 2 == 0 else reversed(rows.items()):
            torch.cuda.synchronize() if device == "cuda" else None
            start = time.perf_counter()
            for _ in range(a.calls):
                fn(*next(turn))
            if r:
                per_row[name].append((time.perf_counter() - start) / a.calls * 1e6)
        if memoized:
            times = dict.fromkeys(per_stage, 0)
            torch.cuda.synchronize() if device == "cuda" else None
            for _ in range(a.calls):
                out = replay(q, k, v, *next(turn), times)[2][0]
                if a.training:
                    start = time.perf_counter_ns()
                    backward(out)
                    times["backward"] += time.perf_counter_ns() - start
            if r:
                for name in per_stage:
                    per_stage[name].append(times[name] / a.calls / 1e3)
    profiled = profile(lambda: backward(attention(*next(turn))), a.calls, lines=30)
    meta = {"device": attnselect.Target.current().describe(), "date": time.strftime("%Y-%m-%d"), "chosen": str(chosen)}
    lines = [
        "# A new packing's first call: where its host time goes\n",
        f"{meta['device']}, {meta['date']}. Produced by `benchmarks/new_packing_parts.py`: {total} tokens in 1 to 8 "
        f"documents, a new packing each call, H{heads}, {dim}/{dim} {str(dtype)[6:]}, causal, "
        f"{'training (forward and backward)' if a.training else 'inference'}; chosen: "
        f"{chosen}. Median host us per call over {a.rounds} rounds of {a.calls} calls (min..max).\n",
        "| row | host us per call |",
        "|---|---|",
    ]
    report = {"meta": {**meta, "training": a.training}, "rows": per_row, "stages": per_stage}
    for name, t in per_row.items():
        lines.append(f"| {name} | {statistics.median(t):.1f} ({min(t):.1f}..{max(t):.1f}) |")
    if memoized:
        lines += ["", "attention()'s path replayed stage by stage:", "", "| stage | host us per call |", "|---|---|"]
        for name, t in per_stage.items():
            lines.append(f"| {name} | {statistics.median(t):.1f} ({min(t):.1f}..{max(t):.1f}) |")
        whole = [sum(ts) for ts in zip(*per_stage.values())]
        lines.append(f"| all stages | {statistics.median(whole):.1f} ({min(whole):.1f}..{max(whole):.1f}) |")
    lines += ["", f"cProfile of attention(), {a.calls} calls, a new packing each (own time):", "", "```", profiled,
              "```"]  # fmt: skip
    write_report(a.out, report, lines)


if __name__ == "__main__":
    main()
