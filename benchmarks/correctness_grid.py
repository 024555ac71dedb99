"""The correctness grid: every installed backend over the space users run, judged against float references.

Axes: head-dim pairs (d_qk, d_v) over {32, 64, 96, 128, 192, 256}^2, (576, 512) and odd dims; GQA ratio 1, 4, 16
and MQA; masks none, causal, bottom-right causal and a window; dense, thd and thd with gaps between sequences;
inference and training; bf16 and fp16; sizes from one small head (B1 H1 S77) to B32 H16 S1k and B1 H16 S8k.

**How rows are chosen.** Every (head-dim pair, phase, layout) cell gets a row: those are the young kernels'
allowlist keys (attnselect.backends.evidence), so each has evidence. The other axes are assigned greedily
(AETG-style), each row taking the values that cover the most pairs of axis values not yet covered; rows are added
until every pair of values of every two axes appears in some row (``pairs_missing()`` is empty;
tests/test_benchmarks.py checks it).

**What a row checks.** For each candidate (backend, padding) that the static rules serve (the allowlist off), the
kernel runs the full call (with its lse), and in training its backward for a random output gradient; the
self-check's slices of the result (attnselect.self_check.check_slices: spread over every sequence and K/V head, up
to four query heads each; the committed rows of 2026-12-02 were judged on two slices, the first sequence's first
K/V head and the last or longest sequence's last) are judged by attnselect.correctness: out, lse, dq, dk and dv
against the float32 reference of the rounded inputs, within 2x (out, lse) or 3x (gradients) the naive reference's
error (FlashAttention's test_flash_attn_output criterion). The young kernels' rows (FA4, flex, the cuDNN frontend)
run again in another process (repeat 1): their results differ by process. A first result that the rules have
since drawn a refusal from (flex's missing template for grouped heads) runs again too.

**Running it.** Worker processes (``--workers``, default 12 of the H200 machine's 16 cores) share the GPU. They take
(row, repeat) units from one queue, the costliest first (:func:`units`), each claimed by a file under ``--out DIR``
(a static split left one worker with 221 s of work and others idle), and never a row's repeat 1 in the process that
ran its repeat 0; each appends to its own file; a rerun skips what the files hold (resumable), a worker that dies
(a CUDA error spoils its context) is restarted, resumes its claims and skips the result it died on. ``--deadline``
stops cleanly. With ``--patience S`` a result that runs past S seconds (a compile that does not finish) is stopped
and recorded as stopped (not passed, yet no kernel failure in the package data), and its worker goes on in a new
process. ``--report`` turns the rows into
``results/<name>.md`` and the package data attnselect reads (``src/attnselect/data/correctness_<arch>.json``).

    python benchmarks/correctness_grid.py --out DIR [--workers 12] [--deadline 500] [--only-young] [--patience S]
    python benchmarks/correctness_grid.py --report DIR... --name h200_correctness_grid
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback

import torch

PAIRS = [(a, b) for a in (32, 64, 96, 128, 192, 256) for b in (32, 64, 96, 128, 192, 256)]
PAIRS += [(576, 512), (59, 59), (80, 80), (112, 112), (16, 16)]  # DeepSeek's MLA decode; odd and small dims
AXES = {
    "pair": PAIRS,
    "phase": ["inference", "training"],
    "layout": ["dense", "thd", "thd_gaps"],
    "mask": ["none", "causal", "causal_bottom_right", "sliding_window"],
    "gqa": [1, 4, 16, "mqa"],
    "dtype": ["bfloat16", "float16"],
    "size": ["tiny", "small", "medium", "large", "long"],
}
CELL = ("pair", "phase", "layout")  # crossed in full: the allowlist's keys
SIZES = {  # (batch or sequences, sequence length, query heads)
    "tiny": (1, 77, 1),
    "small": (2, 333, 4),
    "medium": (2, 1024, 16),
    "large": (32, 1024, 16),
    "long": (1, 8192, 16),
}
YOUNG = ("flash_attn4", "flex", "cudnn_frontend")
SOURCE = "results/h200_correctness_grid.jsonl"


def _pairs_of(row: dict) -> set:
    names = list(AXES)
    return {(a, json.dumps(row[a]), b, json.dumps(row[b])) for a, b in itertools.combinations(names, 2)}


def all_pairs() -> set:
    names = list(AXES)
    return {
        (a, json.dumps(x), b, json.dumps(y))
        for a, b in itertools.combinations(names, 2)
        for x in AXES[a]
        for y in AXES[b]
    }


_ROWS: list = []


def rows() -> list[dict]:
    """The grid's rows, deterministic: every cell, then rows until every pair of axis values is covered."""
    if not _ROWS:
        _ROWS.extend(_choose_rows())
    return _ROWS


def _choose_rows() -> list[dict]:
    covered: set = set()
    chosen: list[dict] = []
    free = [name for name in AXES if name not in CELL]

    def best(fixed: dict) -> dict:
        options = [dict(fixed, **dict(zip(free, values))) for values in itertools.product(*(AXES[n] for n in free))]
        return max(options, key=lambda r: len(_pairs_of(r) - covered))

    for values in itertools.product(*(AXES[n] for n in CELL)):
        row = best(dict(zip(CELL, values)))
        covered |= _pairs_of(row)
        chosen.append(row)
    missing = all_pairs() - covered
    while missing:
        a, x, b, y = sorted(missing)[0]
        options = [
            dict(zip(AXES, values))
            for values in itertools.product(*AXES.values())
            if json.dumps(dict(zip(AXES, values))[a]) == x and json.dumps(dict(zip(AXES, values))[b]) == y
        ]
        row = max(options, key=lambda r: len(_pairs_of(r) - covered))
        covered |= _pairs_of(row)
        chosen.append(row)
        missing = all_pairs() - covered
    for index, row in enumerate(chosen):
        row["id"] = index
    return chosen


def row_key(row: dict) -> str:
    return json.dumps({name: row[name] for name in AXES}, sort_keys=True)


def pairs_missing(grid: list[dict]) -> set:
    covered = set().union(*(_pairs_of(r) for r in grid))
    return all_pairs() - covered


# -- one row: problem and inputs ---------------------------------------------------------------------------------


def build(row: dict, device: str):
    """(problem, q, k, v, packing or None, options for attnselect's call) of a row, random data seeded by its id."""
    from attnselect.spec.options import Packing
    from attnselect.spec.problem import AttentionProblem
    from attnselect.spec.validate import packing_facts

    batch, seqlen, heads = SIZES[row["size"]]
    ratio = row["gqa"]
    if ratio == "mqa":
        heads_q, heads_kv = max(heads, 2), 1
    else:
        heads_q = max(heads, ratio)
        heads_kv = heads_q // ratio
    dqk, dv = row["pair"]
    dtype = getattr(torch, row["dtype"])
    rng = random.Random(row["id"])
    mask = row["mask"]
    window = None
    if mask == "sliding_window":
        left = max(1, seqlen // 5)
        window = (left, 0) if row["id"] % 2 == 0 else (left, max(1, left // 3))
    g = torch.Generator(device=device).manual_seed(row["id"])
    packing = None
    if row["layout"] == "dense":
        sq = seqlen
        skv = seqlen + seqlen // 4 if mask == "causal_bottom_right" else seqlen
        shape_q, shape_kv = (batch, sq, heads_q), (batch, skv, heads_kv)
        fields = dict(batch=batch, seqlen_q=sq, seqlen_kv=skv, layout="bshd")
    else:
        lengths_q = [seqlen] + [rng.randint(1, seqlen) for _ in range(batch - 1)]
        rng.shuffle(lengths_q)
        if mask == "causal_bottom_right":
            lengths_kv = [n + rng.randint(0, max(1, n // 4)) for n in lengths_q]
        else:
            lengths_kv = list(lengths_q)
        gaps = row["layout"] == "thd_gaps"
        gap_q = [rng.randint(1, 7) if gaps else 0 for _ in lengths_q]
        gap_kv = [rng.randint(1, 7) if gaps else 0 for _ in lengths_kv]
        cu_q = [0, *itertools.accumulate(lengths_q)]
        cu_kv = [0, *itertools.accumulate(lengths_kv)]
        off_q = [0, *itertools.accumulate(n + g_ for n, g_ in zip(lengths_q, gap_q))]
        off_kv = [0, *itertools.accumulate(n + g_ for n, g_ in zip(lengths_kv, gap_kv))]

        def t(x):
            return torch.tensor(x, dtype=torch.int32, device=device)

        cq, ckv = t(cu_q), t(cu_kv)
        same = lengths_q == lengths_kv and not gaps
        if same:
            ckv = cq
        oq = t(off_q) if gaps else cq
        okv = t(off_kv) if gaps else ckv
        packing = Packing(cq, ckv, max(lengths_q), max(lengths_kv), oq, okv)
        shape_q, shape_kv = (off_q[-1], heads_q), (off_kv[-1], heads_kv)
        fields = dict(
            batch=batch,
            seqlen_q=max(lengths_q),
            seqlen_kv=max(lengths_kv),
            layout="thd",
            varlen_gaps=gaps,
            **packing_facts(mask, window, lengths_q, lengths_kv),
        )
    problem = AttentionProblem(
        heads_q=heads_q,
        heads_kv=heads_kv,
        head_dim_qk=dqk,
        head_dim_v=dv,
        dtype=dtype,
        mask=mask,
        window=window,
        training=row["phase"] == "training",
        **fields,
    )
    q = torch.randn(*shape_q, dqk, generator=g, device=device).to(dtype)
    k = torch.randn(*shape_kv, dqk, generator=g, device=device).to(dtype)
    v = torch.randn(*shape_kv, dv, generator=g, device=device).to(dtype)
    return problem, q, k, v, packing


def judge_candidate(problem, candidate, q, k, v, packing) -> dict:
    """Run one candidate on the row's tensors and judge it (attnselect.self_check.judge over two slices)."""
    from attnselect import backends, self_check
    from attnselect.execution import kernel_call, run_call

    # The lse is judged where the kernel can return it; the problem stays a plain call (its signature is a user's).
    surface = backends.get(candidate.backend).surfaces.get("cuda" if q.is_cuda else "cpu")
    call = kernel_call(dataclasses.replace(problem, return_lse=surface is not None and surface.lse))
    run = lambda q, k, v: run_call(candidate, problem, call, q, k, v, packing=packing)  # noqa: E731
    result = {"ran": False, "error": None, "judgement": None}
    try:
        with torch.no_grad():
            out = run(q, k, v)
        pieces = self_check.check_slices(problem, packing)
        judgement = self_check.judge(problem, call, out, q, k, v, packing, pieces, run)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        result["ran"] = True
        result["judgement"] = judgement.to_dict()
        result["failures"] = judgement.failures
    except self_check.ReferenceFailed:
        raise
    except Exception as exc:  # whatever the kernel does is the finding
        result["error"] = f"{type(exc).__name__}: {_first_line(str(exc))}"
    result["passed"] = bool(result["ran"] and result["judgement"]["passed"])
    return result


# -- workers -----------------------------------------------------------------------------------------------------


def done_keys(directory: str) -> set:
    keys = set()
    for path in glob.glob(os.path.join(directory, "rows-*.jsonl")):
        for line in open(path):
            try:
                r = json.loads(line)
            except ValueError:  # a line cut short by a killed worker
                continue
            if not _transient(r.get("error") or ""):  # as read_rows: a failure of the machine is run again
                keys.add((r["row_key"], r["backend"], r["pad_to"], r["repeat"]))
    return keys


def units(ids=None) -> list[tuple[dict, int]]:
    """The (row, repeat) units of work, the costliest first (their references' score elements, training twice), so
    that the long rows start at once and the small ones, compile-bound and alike, fill the workers' ends."""

    def cost(row):
        batch, seqlen, heads = SIZES[row["size"]]
        return batch * seqlen * seqlen * heads * (2 if row["phase"] == "training" else 1)

    chosen = [r for r in rows() if ids is None or r["id"] in ids]
    return [(r, repeat) for repeat in (0, 1) for r in sorted(chosen, key=lambda r: (-cost(r), r["id"]))]


def _claim(directory: str, row: dict, repeat: int, index: int) -> bool:
    """Whether worker ``index`` runs this unit: it claims it first, or claimed it in a process that died."""
    path = os.path.join(directory, "claims", f"{row['id']}-{repeat}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return open(path).read() == str(index)
    os.write(fd, str(index).encode())
    os.close(fd)
    return True


def worker(index: int, directory: str, deadline: float, only_young: bool, ids=None) -> int:
    """Run the units this worker claims (:func:`units`); a row's repeat 1 (young kernels) never in the process that
    ran its repeat 0. Returns 3 after a CUDA error (the parent restarts it), else 0."""
    os.environ["ATTNSELECT_ALLOWLIST"] = "0"  # the static surface: the grid is what the allowlist is drawn from
    os.environ["ATTNSELECT_SELF_CHECK"] = "0"
    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 4096
    torch._dynamo.config.accumulated_cache_size_limit = 8192
    from attnselect import backends, self_check
    from attnselect.choose.candidates import judge
    from attnselect.spec.options import Candidate
    from attnselect.spec.target import Target

    target = Target.current()
    device = "cuda" if target.is_cuda else "cpu"
    done = done_keys(directory)
    sink = open(os.path.join(directory, f"rows-{index}.jsonl"), "a")
    pending = os.path.join(directory, f"pending-{index}.json")
    try:  # the last process of this worker died running it: that is its finding
        died = json.load(open(pending))
    except FileNotFoundError:
        died = None
    except ValueError:  # cut short as it was written: what ran is unknown, and it runs again
        died = None
        os.remove(pending)
    if died is not None:
        if (died["row_key"], died["backend"], died["pad_to"], died["repeat"]) not in done:
            died.update(ran=False, error="the process died running it (killed, or a fatal CUDA error)", passed=False)
            sink.write(json.dumps(died) + "\n")
            sink.flush()
            done.add((died["row_key"], died["backend"], died["pad_to"], died["repeat"]))
        os.remove(pending)
    first_here = set()  # rows whose repeat 0 ran in this process
    for row, repeat in units(ids):
        if time.time() > deadline:
            return 0
        if repeat == 1 and row["id"] in first_here or not _claim(directory, row, repeat, index):
            continue
        if repeat == 0:
            first_here.add(row["id"])
        key = row_key(row)
        problem = None
        for_row = []
        try:
            problem, q, k, v, packing = build(row, device)
        except Exception:
            traceback.print_exc()
            continue
        for verdict in judge(problem, target):
            backend = backends.get(verdict.candidate.backend)
            if not verdict.supported or (backend.package and backend.package_version(target) is None):
                continue
            young = verdict.candidate.backend in YOUNG
            if (repeat == 1 or only_young) and not young:
                continue
            c = verdict.candidate
            if (key, c.backend, c.pad_to, repeat) in done:
                continue
            for_row.append(c)
        if repeat == 1:  # a first result the rules have since drawn a refusal from is repeated all the same
            ran_first = {(b, pad) for (k_, b, pad, r) in done if k_ == key and r == 0 and b in YOUNG}
            for b, pad in sorted(ran_first, key=str):
                c = Candidate(b, pad)
                installed = not backends.get(b).package or backends.get(b).package_version(target) is not None
                if installed and c not in for_row and (key, b, pad, 1) not in done:
                    for_row.append(c)
        if torch.cuda.is_available():  # the last row's cached blocks, held from 13 other workers, OOMed them
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        for c in for_row:
            if time.time() > deadline:  # a row's candidates compile for seconds each
                return 0
            start = time.time()
            record = dict(
                row_key=key,
                row=row,
                problem=problem.to_dict(),
                signature=list(problem.signature),
                backend=c.backend,
                pad_to=c.pad_to,
                repeat=repeat,
                pid=os.getpid(),
            )
            with open(pending, "w") as f:
                json.dump({**record, "started": start}, f)  # when it started: --patience (_stop_the_slow)
            try:
                found = judge_candidate(problem, c, q, k, v, packing)
            except self_check.ReferenceFailed as exc:
                # The candidate ran just before the reference on one stream: a sticky CUDA error is its own.
                if _spoils_context(str(exc)):
                    found = {"ran": False, "error": _first_line(str(exc)), "passed": False}
                else:
                    found = {"error": f"the reference failed: {exc}"}
            os.remove(pending)
            error = found["error"] or ""
            if "reference failed" in error or _transient(error):
                print(f"[{index}] row {row['id']} {c} r{repeat}: {error[:100]}; left for a rerun", flush=True)
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
                continue
            record.update(seconds=round(time.time() - start, 2), **found)
            if torch.cuda.is_available():  # the row's peak so far, for a run that must fit 14 workers
                record["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            status = "ok" if found["passed"] else (found["error"] or "WRONG " + ",".join(found["failures"]))
            print(f"[{index}] row {row['id']} {c} r{repeat} {record['seconds']}s {status[:160]}", flush=True)
            if _spoils_context(error):
                return 3  # the CUDA context may be spoiled: start afresh
    return 0


def _spoils_context(error: str) -> bool:
    """A CUDA error that stays with the process (an illegal memory access): every later call in it fails too."""
    return not _transient(error) and ("CUDA error" in error or "cudaError" in error)


# Seconds a worker may run past the deadline (it checks it between rows; a flex compile under 14 workers took over
# a minute): the device step's own time limit is the deadline plus 90 s, and workers it left running had spoiled
# the timings taken after it.
OVERTIME = 45.0


def _stop_the_slow(directory: str, running: dict, patience: float | None) -> list[int]:
    """Kill each worker whose current result has run past ``patience`` seconds (a compile that does not finish: flex
    at row 17 ran past 225 s in fresh processes, results/h200_correctness_grid.md) and record that as its result,
    neither a pass nor a kernel failure (``stopped_after_s``: the time depends on what else shares the machine).
    Returns the workers killed."""
    stopped = []
    for i, proc in running.items():
        pending = os.path.join(directory, f"pending-{i}.json")
        try:
            r = json.load(open(pending))
        except (FileNotFoundError, ValueError):
            continue
        # A dead process's pending file is its next process's finding (worker()); it has no start time: older runs.
        if patience is None or r.get("pid") != proc.pid or time.time() - r.get("started", time.time()) <= patience:
            continue
        _kill(proc)
        try:
            still = json.load(open(pending))
        except (FileNotFoundError, ValueError):
            still = None
        stopped.append(i)
        if still != r:  # it finished that result before it was killed: its own record stands
            continue
        age = time.time() - r.pop("started")
        r.update(ran=False, error=f"did not finish within {patience:.0f} s (compile and run); stopped", passed=False,
                 seconds=round(age, 1), stopped_after_s=patience)  # fmt: skip
        with open(os.path.join(directory, f"rows-{i}.jsonl"), "a") as sink:
            sink.write(json.dumps(r) + "\n")
        with contextlib.suppress(FileNotFoundError):
            os.remove(pending)
        print(f"worker {i}: row {r['row']['id']} {r['backend']} pad {r['pad_to']} r{r['repeat']} {r['error']}")
    return stopped


def _kill(proc) -> None:
    """Kill a worker and the processes it started (inductor's compile workers, with TORCHINDUCTOR_COMPILE_THREADS
    above 1): each worker leads its own process group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _worker_command(i: int, directory: str, deadline: float, only_young: bool, ids: str | None) -> list[str]:
    return (
        [sys.executable, __file__, "--worker", str(i), "--out", directory, "--deadline-at", str(deadline)]
        + (["--only-young"] if only_young else [])
        + (["--ids", ids] if ids else [])
    )


def run_workers(
    directory: str,
    workers: int,
    deadline: float,
    only_young: bool,
    ids: str | None = None,
    patience: float | None = None,
) -> None:
    shutil.rmtree(os.path.join(directory, "claims"), ignore_errors=True)  # an earlier run's: left undone or done
    os.makedirs(os.path.join(directory, "claims"))
    # One compile thread a worker unless the caller sets more (a few workers on few rows: flex's compiles at rows
    # 10, 16 and 17 ran past 155 s in one thread).
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}

    def start(i: int):
        command = _worker_command(i, directory, deadline, only_young, ids)
        return subprocess.Popen(command, env=env, start_new_session=True)  # a group of its own: _kill

    if workers == 1:
        print("one worker: the young kernels' repeats need a second process and are not run", flush=True)
    running = {i: start(i) for i in range(workers)}
    while running:
        time.sleep(1)
        for i in _stop_the_slow(directory, running, patience):
            del running[i]
            if time.time() < deadline - 20:
                running[i] = start(i)  # it resumes its claim at the next result
        for i, proc in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[i]
            if code != 0 and time.time() < deadline - 20:
                print(f"worker {i} exited with {code}; restarting it", flush=True)
                running[i] = start(i)
        if running and time.time() > deadline + OVERTIME:  # inside a long compile: stopped, its result left for a rerun
            for i, proc in running.items():
                _kill(proc)
                pending = os.path.join(directory, f"pending-{i}.json")
                running_then = "between results"
                with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                    r = json.load(open(pending))
                    running_then = f"at row {r['row']['id']} {r['backend']} pad {r['pad_to']} r{r['repeat']}"
                with contextlib.suppress(FileNotFoundError):
                    os.remove(pending)  # not a death of the kernel's making
                print(f"worker {i} stopped {OVERTIME:.0f} s past the deadline, {running_then}: left for a rerun")
            return


# -- the report and the package data -----------------------------------------------------------------------------


def read_rows(directories) -> list[dict]:
    found = {}
    for directory in directories:
        paths = [directory] if directory.endswith(".jsonl") else glob.glob(os.path.join(directory, "rows-*.jsonl"))
        for path in paths:
            for line in open(path):
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if _transient(r.get("error") or ""):  # the machine, not the kernel: left for a rerun
                    continue
                found[(r["row_key"], r["backend"], r["pad_to"], r["repeat"])] = r
    return sorted(found.values(), key=lambda r: (r["row"]["id"], r["backend"], r["pad_to"] or 0, r["repeat"]))


def _transient(error: str) -> bool:
    """An error of the machine (memory held by the other workers), not of the kernel (attnselect.choose.failures)."""
    from attnselect.choose.failures import is_transient

    return bool(error) and is_transient(RuntimeError(error))


EARLIER = "results/h200_rules_grid.jsonl"  # the rules grid of 2026-12-01 (same stack): its young kernels' rows too
# The peer sweeps on the same stack (benchmarks/peer_sweep.py): a chosen candidate that was wrong or raised there is
# refused at that problem signature, as a failure the self-check or a crash recorded would be (choose.failures).
SWEEPS = (
    "results/h200_peer_sweep.jsonl",
    "results/h200_peer_sweep_fa4.jsonl",
    "results/h200_peer_sweep_55b3671.jsonl",
    "results/h200_peer_sweep_55b3671_fa4.jsonl",
    "results/h200_peer_sweep_without_frontend.jsonl",
    "results/h200_peer_sweep_942d778.jsonl",
    "results/h200_peer_sweep_942d778_fa4.jsonl",
    "results/h200_peer_sweep_without_frontend_942d778.jsonl",
    "results/h200_peer_sweep_flex_floats.jsonl",
    "results/h200_peer_sweep_without_frontend_flex_floats.jsonl",
    "results/h200_peer_sweep_18e1749.jsonl",
    "results/h200_peer_sweep_18e1749_fa4.jsonl",
)


def summary(
    records: list[dict], meta: dict, earlier: list[dict] = (), sweeps: list[tuple] = (), shipped: dict | None = None
) -> dict:
    """The package data: young kernels' results per allowlist key (and per K/V grouping within it), the
    signatures every process passed, and the (candidate, signature) pairs that failed in a peer sweep.

    ``sweeps``: (file, record) of the peer sweeps' records (:data:`SWEEPS`); a record that raised for the machine
    (out of memory: choose.failures.is_transient) is not a failure of the kernel. ``shipped``: the package data written
    before: its failures stay while the fingerprint and packages are the same (a sweep run with them shipped
    chooses another kernel there, so it does not find them again).
    ``earlier``: rows of the rules grid (benchmarks/rules_grid.py, relative error within 2e-2, one process), counted
    for the allowlist where today's static surface serves the candidate (it ran them all, served or not)."""
    from attnselect import backends
    from attnselect.backends.evidence import FORMAT, grouping, kernel_key, span
    from attnselect.spec.problem import AttentionProblem
    from attnselect.spec.target import Target

    kernels: dict = {}
    by_signature: dict = {}
    longest_passed: dict = {}  # (backend, allowlist key, head dims and phase) -> its passing rows' longest span
    failed_at: dict = {}  # (backend, head dims and phase) -> [(span, finding)] of the failing rows

    def count(backend, problem, passed, finding, source):
        key = kernel_key(problem)
        entry = kernels.setdefault(backend, {}).setdefault(key, {"passed": 0, "failed": 0})
        entry["passed" if passed else "failed"] += 1
        own = entry.setdefault("by_grouping", {}).setdefault(grouping(problem), {"passed": 0, "failed": 0})
        own["passed" if passed else "failed"] += 1
        longest, dims_and_phase = span(problem), key.split(" ", 1)[1]  # kernel_key without its layout
        if passed:
            held = (backend, key, dims_and_phase)
            longest_passed[held] = max(longest_passed.get(held, 0), longest)
        else:
            entry.setdefault("example", f"{source}: {finding}"[:240])
            failed_at.setdefault((backend, dims_and_phase), []).append((longest, f"{source}: {finding}"))

    for r in records:
        problem = AttentionProblem.from_dict(r["problem"])
        sig = json.dumps([r["backend"], r["pad_to"], list(problem.signature)])  # today's signature of the row
        by_signature[sig] = by_signature.get(sig, True) and r["passed"]
        if r["backend"] in YOUNG and "stopped_after_s" not in r:  # stopped at --patience: neither pass nor failure
            kernel = problem.padded(r["pad_to"]) if r["pad_to"] else problem
            count(r["backend"], kernel, r["passed"], _finding(r), f"row {r['row']['id']}")
    if earlier:
        saved = os.environ.get("ATTNSELECT_ALLOWLIST")
        os.environ["ATTNSELECT_ALLOWLIST"] = "0"  # the static surface: what today serves without any grid
        target = Target.from_dict(meta["earlier_target"])
        for r in earlier:
            if r["backend"] not in YOUNG:
                continue
            problem = AttentionProblem.from_dict(r["problem"])
            kernel = problem.padded(r["pad_to"]) if r["pad_to"] else problem
            if backends.get(r["backend"]).not_supported_reasons(kernel, target):
                continue
            finding = r["error"] or f"relative errors {r['out_err']}, {r['grad_err']} (bound 2e-2)"
            count(r["backend"], kernel, r["really"], finding, EARLIER.replace(".jsonl", ".md"))
        if saved is None:
            del os.environ["ATTNSELECT_ALLOWLIST"]
        else:
            os.environ["ATTNSELECT_ALLOWLIST"] = saved
    # What a kernel needs (an inductor template's shared memory, a launch's resources) and where it goes wrong can
    # grow with the tokens it takes as one sequence (evidence.span), whatever the layout: where rows of the same head
    # dims and phase failed, in any way, at a longer span than any row of a key passed, the key is served only up to
    # its passing rows' span (flex's dense 64/256 inference rows passed at 77 tokens, its thd rows ran out of shared
    # memory from 666, results/h200_correctness_grid.md).
    for (backend, key, dims_and_phase), longest in longest_passed.items():
        beyond = sorted(f for f in failed_at.get((backend, dims_and_phase), []) if f[0] > longest)
        if beyond:
            kernels[backend][key]["passed_up_to"] = longest
            kernels[backend][key]["failed_beyond"] = f"{beyond[0][1]} (a span of {beyond[0][0]} tokens)"[:240]
    covered = [json.loads(s) for s, ok in sorted(by_signature.items()) if ok]
    same = shipped and shipped.get("fingerprint") == meta["fingerprint"] and shipped.get("packages") == meta["packages"]
    kept = {json.dumps(f[:3]): f[3] for f in shipped.get("failed", [])} if same else {}
    failed = {}
    for source, record in sweeps:
        machine = record["status"] == "raised" and _transient(record.get("error"))
        if record["status"] in ("wrong", "raised") and "signature" in record and not machine:
            candidate = record["candidate"]
            key = json.dumps([candidate["backend"], candidate["pad_to"], record["signature"]])
            failed.setdefault(key, f"{record['status']} in {source}: {record['case']}: {record['error']}"[:300])
    return {
        "format": FORMAT,
        "source": SOURCE.replace(".jsonl", ".md") + (f" and {EARLIER.replace('.jsonl', '.md')}" if earlier else ""),
        "device": meta["device"],
        "arch": meta["arch"],
        "date": meta["date"],
        "fingerprint": meta["fingerprint"],
        "packages": meta["packages"],
        "kernels": kernels,
        "covered": covered,
        "failed": [[*json.loads(key), finding] for key, finding in sorted({**kept, **failed}.items())],
    }


def _first_line(text: str) -> str:
    """An error's first line (CUDA's errors go on with advice over several lines), at most 300 characters."""
    return (text.strip().splitlines() or [""])[0][:300]


def _finding(r: dict) -> str:
    if r["error"]:
        return _first_line(r["error"])
    j = r["judgement"]
    return ", ".join(f"{n} max error {j['errors'][n]:.3g} > {j['bounds'][n]:.3g}" for n in r.get("failures", []))


def report(records: list[dict], meta: dict) -> str:
    lines = [
        f"# Correctness grid on the {meta['device']}, {meta['date']}",
        "",
        f"Versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}. Rows: {SOURCE}; chosen by "
        "benchmarks/correctness_grid.py (every head-dim pair x phase x layout, all pairs of axis values covered).",
        "Criterion: out and lse within 2x, dq/dk/dv within 3x the naive reference's max error against the float32 "
        "reference of the rounded inputs, plus rounding (attnselect/correctness.py).",
        "",
    ]
    if meta.get("runs"):
        lines += [meta["runs"], ""]
    grid = rows()
    ran = {r["row_key"] for r in records}
    lines.append(f"{len(ran)} of {len(grid)} rows ran; {len(records)} (row, candidate, process) results.")
    lines.append("")
    lines.append("| backend | results | passed | failed or wrong | processes per row |")
    lines.append("|---|---|---|---|---|")
    for backend in sorted({r["backend"] for r in records}):
        mine = [r for r in records if r["backend"] == backend]
        repeats = len({r["repeat"] for r in mine})
        failed = sum(not r["passed"] for r in mine)
        lines.append(f"| {backend} | {len(mine)} | {len(mine) - failed} | {failed} | {repeats} |")
    lines += ["", "## Failures", "", "| row | problem | candidate | process | finding |", "|---|---|---|---|---|"]
    from attnselect.spec.problem import AttentionProblem

    for r in records:
        if r["passed"]:
            continue
        desc = AttentionProblem.from_dict(r["problem"]).describe()
        cand = f"{r['backend']}" + (f" padded to {r['pad_to']}" if r["pad_to"] else " native")
        lines.append(f"| {r['row']['id']} | {desc} | {cand} | {r['repeat']} | {_finding(r)[:200]} |")
    return "\n".join(lines) + "\n"


def meta_now() -> dict:
    """The run's machine and versions. ``packages``: the version of each young backend's package that its rows ran
    under (a run that resumes another's rows keeps the first version it finds)."""
    from attnselect import backends
    from attnselect.backends.evidence import base_fingerprint
    from attnselect.spec.target import Target

    target = Target.current()
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": target.cudnn_version}
    for distribution in ("nvidia-cudnn-frontend", "flash-attn-4"):
        versions[distribution] = target.version(distribution)
    packages = {name: backends.get(name).package_version(target) for name in YOUNG}
    return {
        "device": target.name,
        "arch": target.arch,
        "date": time.strftime("%Y-%m-%d"),
        "versions": versions,
        "fingerprint": base_fingerprint(target),
        "packages": packages,
        "target": target.to_dict(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="directory of the rows files")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--deadline", type=float, default=500.0, help="seconds from now")
    ap.add_argument("--deadline-at", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--only-young", action="store_true", help="young kernels' rows only")
    ap.add_argument("--patience", type=float, help="seconds one result may run before it is recorded as not finishing")
    ap.add_argument("--ids", help="comma list of row ids (a smoke test)")
    ap.add_argument("--report", nargs="+", help="rows directories or .jsonl files to report on")
    ap.add_argument("--meta", help="the run's meta.json (default: <first report dir>/meta.json)")
    ap.add_argument("--name", default="h200_correctness_grid")
    ap.add_argument("--earlier", action="store_true", help=f"count {EARLIER}'s young-kernel rows for the allowlist")
    a = ap.parse_args()
    if a.report:
        records = read_rows(a.report)
        meta = json.load(open(a.meta or os.path.join(a.report[0], "meta.json")))
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with open(os.path.join(root, "results", f"{a.name}.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        json.dump(meta, open(os.path.join(root, "results", f"{a.name}.jsonl.meta.json"), "w"), indent=1)
        open(os.path.join(root, "results", f"{a.name}.md"), "w").write(report(records, meta))
        data = os.path.join(root, "src", "attnselect", "data", f"correctness_{meta['arch']}.json")
        os.makedirs(os.path.dirname(data), exist_ok=True)
        earlier = [json.loads(line) for line in open(os.path.join(root, EARLIER))] if a.earlier else []
        sweeps = [(path, json.loads(line)) for path in SWEEPS if os.path.exists(os.path.join(root, path))
                  for line in open(os.path.join(root, path))]  # fmt: skip
        shipped = json.load(open(data)) if os.path.exists(data) else None
        summary_data = summary(records, meta, earlier, sweeps, shipped)
        json.dump(summary_data, open(data, "w"), indent=None, separators=(",", ":"))
        print(f"{len(records)} results -> results/{a.name}.md and {os.path.relpath(data, root)}")
        return
    if a.worker is not None:
        ids = {int(x) for x in a.ids.split(",")} if a.ids else None
        sys.exit(worker(a.worker, a.out, a.deadline_at, a.only_young, ids))
    deadline = time.time() + a.deadline
    os.makedirs(a.out, exist_ok=True)
    json.dump(meta_now(), open(os.path.join(a.out, "meta.json"), "w"), indent=1)
    run_workers(a.out, a.workers, deadline, a.only_young, a.ids, a.patience)
    records = read_rows([a.out])
    failed = [r for r in records if not r["passed"]]
    print(f"{len(records)} results, {len(failed)} failed or wrong, {len({r['row_key'] for r in records})} rows")


if __name__ == "__main__":
    main()
