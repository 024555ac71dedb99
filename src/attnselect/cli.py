"""Command line: ``attnselect explain`` (which kernel, and why), ``demo`` (a real run), ``backends``, ``tune``,
``warmup``, ``bench``, ``calibrate``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import tempfile

import torch

from attnselect.api import attention, warmup
from attnselect.backends import all_backends
from attnselect.bench.models import MODELS
from attnselect.choose import calibration, settings
from attnselect.choose.selection import select
from attnselect.errors import AttnSelectError, InvalidInputError
from attnselect.spec.options import mask_from_arguments
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import PRESETS, Target

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
DEFAULT_TARGET = "h200"


def _explain_parser(sub) -> None:
    p = sub.add_parser("explain", help="judge every candidate for one problem and show the choice")
    p.add_argument(
        "--target", default=DEFAULT_TARGET, help=f"preset {sorted(PRESETS)} or 'current' (default {DEFAULT_TARGET})"
    )
    p.add_argument("--cudnn-version", help="override the target's cuDNN version, e.g. 9.10.0")
    p.add_argument(
        "--as-calibrated",
        action="store_true",
        help="the preset at the torch, cuDNN and packages its packaged calibration measured (ranked by predicted time)",
    )
    p.add_argument("--model", choices=sorted(MODELS), help="take heads and head dims from a model (flags given win)")
    p.add_argument("--head-dim-qk", type=int, help="default: the model's, else 192")
    p.add_argument("--head-dim-v", type=int, help="default: the model's, else 128")
    p.add_argument("--heads", type=int, help="default: the model's, else 16")
    p.add_argument("--kv-heads", type=int, help="default: the model's, else --heads")
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--seqlen-kv", type=int, help="default: --seqlen")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layout", default="bshd", choices=["bshd", "sbhd", "bhsd", "thd"])
    p.add_argument("--tokens", type=int, default=0, help="thd: q's rows, the packing's tokens (default: not known)")
    p.add_argument("--train", action="store_true", help="backward needed")
    p.add_argument(
        "--causal", nargs="?", const="top_left", default="none", choices=["none", "top_left", "bottom_right"]
    )
    p.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"))
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lse", action="store_true", help="the caller needs the log-sum-exp")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--backend", help="force a backend")
    p.add_argument("--pad", choices=["auto", "always", "never"])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--all", action="store_true", help="one row per candidate, the unsupported ones too")


def problem_from_args(a) -> AttentionProblem:
    m = MODELS.get(a.model)
    fallback = (m.heads, m.kv_heads, m.head_dim_qk, m.head_dim_v) if m else (16, None, 192, 128)  # the flags given win
    heads, kv_heads, dqk, dv = (
        flag if flag is not None else default
        for flag, default in zip((a.heads, a.kv_heads, a.head_dim_qk, a.head_dim_v), fallback)
    )
    kv_heads = heads if kv_heads is None else kv_heads
    mask, window = mask_from_arguments(
        {"none": False, "top_left": True, "bottom_right": "bottom_right"}[a.causal],
        tuple(a.window) if a.window else None,
    )
    return AttentionProblem(
        batch=a.batch,
        seqlen_q=a.seqlen,
        seqlen_kv=a.seqlen if a.seqlen_kv is None else a.seqlen_kv,
        heads_q=heads,
        heads_kv=kv_heads,
        head_dim_qk=dqk,
        head_dim_v=dv,
        dtype=DTYPES[a.dtype],
        layout=a.layout,
        tokens=a.tokens,
        mask=mask,
        window=window,
        dropout_p=a.dropout,
        training=a.train,
        return_lse=a.lse,
        context_parallel_size=a.cp,
    )


def target_from_args(a) -> Target:
    if a.as_calibrated and a.target == "current":
        raise InvalidInputError("--as-calibrated: got --target current, expected a GPU preset (a simulated machine)")
    target = Target.current() if a.target == "current" else Target.preset(a.target)
    if a.as_calibrated:
        target = _as_calibrated(target, a.target)
    if a.cudnn_version is not None and not target.is_cuda:
        raise InvalidInputError(f"--cudnn-version: got {a.cudnn_version!r}, expected none for the cpu target")
    return target.with_versions(cudnn_version=a.cudnn_version) if a.cudnn_version else target


def _as_calibrated(target: Target, name: str) -> Target:
    """The preset ``target`` at the versions its GPU's packaged calibration ran with (its GPU alone), its packages
    those the calibration measured and no other; refused where that calibration would not hold there (it ran with
    another attnselect)."""
    if not target.is_cuda:
        raise InvalidInputError(f"--as-calibrated: got --target {name}, expected a GPU preset (a simulated machine)")
    data = calibration.packaged(target)
    if data is None:
        raise InvalidInputError(f"--as-calibrated: no calibration is packaged for the {target.name}, expected one")
    fp = data["fingerprint"]
    packages = {**dict.fromkeys(dict(target.packages)), **fp["packages"]}  # None: not installed
    calibrated = target.with_versions(torch_version=fp["torch"], cudnn_version=fp["cudnn"], packages=packages)
    found, why = calibration.for_target(calibrated)
    if found is None:
        raise InvalidInputError(f"--as-calibrated: the packaged calibration does not hold ({why}), expected it to")
    return calibrated


# The problem's, target's and controls' fields the flags set: an error naming a field names its flag too
FLAGS = {
    "batch": "--batch", "seqlen_q": "--seqlen", "seqlen_kv": "--seqlen-kv", "heads_q": "--heads",
    "heads_kv": "--kv-heads", "head_dim_qk": "--head-dim-qk", "head_dim_v": "--head-dim-v", "dropout_p": "--dropout",
    "context_parallel_size": "--cp", "window": "--window", "tokens": "--tokens", "cudnn_version": "--cudnn-version",
    "target": "--target", "backend": "--backend",
}  # fmt: skip


def _flagged(message: str) -> str:
    """``message`` with the field it names (``field: got ...``) named by its flag: ``--flag (field): got ...``."""
    field, colon, rest = message.partition(":")
    return f"{FLAGS[field]} ({field}):{rest}" if colon and field in FLAGS else message


def cmd_explain(a) -> int:
    try:
        problem, target = problem_from_args(a), target_from_args(a)
        decision = select(problem, target=target, backend=a.backend, pad=a.pad)
    except AttnSelectError as exc:
        print(f"{type(exc).__name__}: {_flagged(str(exc))}", file=sys.stderr)
        return 2
    print(json.dumps(decision.to_dict(), indent=2) if a.json else decision.report(show_all=a.all))
    return 0


def cmd_demo(a) -> int:
    """A real MLA-shaped attention call on this machine, forward and backward, against float64."""
    target = Target.current()
    device = "cuda" if target.is_cuda else "cpu"
    dtype = torch.bfloat16 if target.is_cuda else torch.float32
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, 256, 8, 192), (2, 256, 8, 192), (2, 256, 8, 128)]
    exact = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    grad_out = torch.randn(2, 256, 8, 128, generator=generator, dtype=torch.float64)
    runs = []
    for inputs, kwargs in (([t.to(device, dtype) for t in exact], {}), (exact, {"backend": "reference"})):
        q, k, v = (t.detach().requires_grad_() for t in inputs)
        out = attention(q, k, v, causal=True, **kwargs)
        out.backward(grad_out.to(out))
        runs.append([out, q.grad, k.grad, v.grad])
    errors = [((a.double().cpu() - b.cpu()).norm() / b.norm()).item() for a, b in zip(*runs)]
    problem = AttentionProblem.from_tensors(*[t.to(device, dtype).requires_grad_() for t in exact], causal=True)
    print(f"target:  {target.describe()}")
    print(f"problem: {problem.describe()}")
    print(select(problem, target=target).why)
    print(
        "relative error against a float64 reference: "
        + ", ".join(f"{name} {e:.1e}" for name, e in zip(("out", "dq", "dk", "dv"), errors))
    )
    return 0 if max(errors) < 2e-2 else 1


def model_problems(a) -> list[AttentionProblem]:
    """Every (model, seqlen, phase) problem of ``tune`` and ``warmup``: causal, the models' heads and head dims. Flags
    that make no call (no sequences, no tokens, a packing of more tokens than it holds) are refused, named."""
    tokens = getattr(a, "tokens", 0)
    if a.batch < 1:
        raise InvalidInputError(f"--batch: got {a.batch}, expected at least 1")
    for seqlen in a.seqlen:
        if seqlen < 1:
            raise InvalidInputError(f"--seqlen: got {seqlen}, expected lengths of at least 1")
    if tokens and a.layout != "thd":
        raise InvalidInputError(f"--tokens: got {tokens} with --layout {a.layout}, expected it with --layout thd only")
    if tokens < 0 or tokens > a.batch * min(a.seqlen):
        raise InvalidInputError(f"--tokens: got {tokens}, expected 0 (half of --batch x --seqlen) up to --batch x "
                                f"--seqlen = {a.batch * min(a.seqlen)} (a packing's tokens)")  # fmt: skip
    problems = []
    for model in a.model:
        m = MODELS[model]
        for seqlen in a.seqlen:
            for training in [False, True] if a.phase == "both" else [a.phase == "training"]:
                problems.append(
                    AttentionProblem(
                        batch=a.batch,
                        seqlen_q=seqlen,
                        seqlen_kv=seqlen,
                        heads_q=m.heads,
                        heads_kv=m.kv_heads,
                        head_dim_qk=m.head_dim_qk,
                        head_dim_v=m.head_dim_v,
                        dtype=DTYPES[a.dtype],
                        layout=a.layout,
                        mask="causal",
                        training=training,
                        tokens=tokens,
                    )
                )
    return problems


def cmd_tune(a) -> int:
    """Measure ahead of time: every (model, seqlen, phase) problem, stored in the decision cache."""
    target = Target.current()
    problems = model_problems(a)
    print(f"tuning {len(problems)} problems on {target.describe()}")
    for i, problem in enumerate(problems, 1):
        decision = select(problem, target=target, policy="measure")
        bar = "#" * (20 * i // len(problems))
        print(f"[{bar:<20}] {i}/{len(problems)} {problem.describe()}: {decision.chosen}", flush=True)
    return 0


def cmd_warmup(a) -> int:
    """Make each (model, seqlen, phase) problem's first call now: decisions, self-checks and kernel compiles."""
    problems = [dataclasses.replace(p, cuda_graph_capture=a.cuda_graph) for p in model_problems(a)]
    settings.resolve(backend=a.backend)  # a bad --backend is named before anything is warmed
    print(f"warming up {len(problems)} problems on {Target.current().describe()}", flush=True)

    def progress(done: int, total: int, text: str) -> None:
        print(f"[{'#' * (20 * done // total):<20}] {done}/{total} {text}", flush=True)

    warmed = warmup(problems, backend=a.backend, progress=progress)
    failed = [w for w in warmed if w.error]
    for w in failed:
        print(f"failed: {w.problem.describe()}: {w.error}", file=sys.stderr)
    return 1 if failed else 0


def cmd_bench(a) -> int:
    """Every candidate and policy on real model shapes (see attnselect.bench)."""
    from attnselect import bench

    try:
        if a.merge:
            report = bench.merge(a.out, a.merge)
        elif a.render:
            report = bench.render(a.out)
        else:
            report = bench.run(a.out, smoke=a.smoke, deadline_s=a.deadline, shard=a.shard, only=tuple(a.only))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # a report missing, or not a report
        print(f"bench: cannot read the report ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    print(
        f"{len(report['results'])} problems -> {a.out}.json, .md" + (", .png" if os.path.exists(a.out + ".png") else "")
    )
    for policy, row in bench.summary(report).items():
        print(
            f"  {policy:<14} within 2% of the fastest on {row['within_2pct']:.0%}, within 5% on "
            f"{row['within_5pct']:.0%} of {row['problems']} problems; worst {row['worst_ratio']:.0%}"
        )
    return 0


def cmd_calibrate(a) -> int:
    """Measure this GPU (minutes) into its calibration file; a run stopped on the way keeps what it measured in a
    partial file beside it, which nothing reads as a calibration."""
    from attnselect.bench import calibrate
    from attnselect.memos import clear_cache

    if a.quick and not a.out:
        raise InvalidInputError("--quick: got no --out, expected one (a quick calibration is a smoke test: it would "
                                "rank every call from two sizes of one head-dim pair)")  # fmt: skip
    target = Target.current()
    if not target.is_cuda:
        raise InvalidInputError(
            "attnselect calibrate: got a machine without a CUDA GPU, expected one (on the CPU the rules table orders "
            "the candidates)"
        )
    path = pathlib.Path(a.out) if a.out else calibration.user_path(target)
    _check_writable(path, "--out" if a.out else "ATTNSELECT_CACHE_DIR")  # before minutes of measuring, not after
    partial = path.with_name(f"{path.stem}.partial{path.suffix or '.json'}")
    partial.unlink(missing_ok=True)  # an earlier run's: not this one's to report

    def checkpoint(data: dict) -> None:
        _write_json(partial, {**data, "source": data["source"] + calibrate.PARTIAL})

    try:
        data = calibrate.run(target, attention=attention, quick=a.quick, progress=calibrate.print_progress,
                             checkpoint=checkpoint)  # fmt: skip
        _write_json(path, data)
    except (RuntimeError, OSError, KeyboardInterrupt) as exc:  # a CUDA error that ends the process's use of the GPU,
        # a write that failed (a full disk), or ^C
        kept = f"; what it measured is in {partial} (a partial calibration: not used)" if partial.exists() else ""
        print(f"attnselect calibrate: stopped ({type(exc).__name__}: {exc}){kept}", file=sys.stderr)
        return 1
    partial.unlink(missing_ok=True)
    clear_cache()
    print(f"calibration of {target.describe()} -> {path}")
    return 0


def _check_writable(path: pathlib.Path, where: str) -> None:
    """Refuse, naming ``where`` (the flag or variable that chose it), a path a calibration cannot be written to."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a directory")
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise InvalidInputError(f"{where}: cannot write {path} ({type(exc).__name__}: {exc}), expected a writable "
                                "file path") from exc  # fmt: skip


def _write_json(path: pathlib.Path, data: dict) -> None:
    """``data`` as JSON at ``path``, whole or not at all: written to a file of its own beside it, then renamed over it
    (processes writing to one cache directory do not mix their writes)."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(data, file, indent=1)
        os.replace(temporary, path)
    except BaseException:
        pathlib.Path(temporary).unlink(missing_ok=True)
        raise


def cmd_backends(a) -> int:
    """Every registered backend, what it is, and whether this machine can run it at all."""
    target = Target.current()
    print(f"target: {target.describe()}")
    for backend in all_backends():
        installed = not (backend.package and backend.package_version(target) is None)
        runs_here = installed and target.device_type in backend.surfaces
        print(f"  {backend.name:<15} {'available' if runs_here else 'unavailable':<12} {backend.summary}")
        if backend.shape_cache is not None:
            print(f"  {'':<15} {'':<12} new shape: {backend.shape_cache.describe()}")
    return 0


def _shard(text: str) -> tuple[int, int]:
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
        raise argparse.ArgumentTypeError(f"expected K/N with 0 <= K < N, got {text!r}")
    return int(k), int(n)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="attnselect", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _explain_parser(sub)
    sub.add_parser("demo", help="run a small MLA attention on this machine and check it")
    sub.add_parser("backends", help="list the backends and whether this machine can run them")
    bench = sub.add_parser("bench", help="time every candidate and policy on real model shapes")
    bench.add_argument("--out", required=True, help="path without extension: .json, .md and .png are written")
    bench.add_argument("--smoke", action="store_true", help="one tiny shape (CPU, CI)")
    bench.add_argument("--deadline", type=float, default=540.0, help="seconds; rerun to resume")
    bench.add_argument(
        "--shard",
        type=_shard,
        default=(0, 1),
        metavar="K/N",
        help="time every N-th problem from the K-th (one process per GPU)",
    )
    bench.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="time only the problems whose description or models contain TEXT (repeatable)",
    )
    no_timing = bench.add_mutually_exclusive_group()
    no_timing.add_argument("--render", action="store_true", help="only rewrite .md and .png from an existing .json")
    no_timing.add_argument("--merge", nargs="+", metavar="PART.json", help="join shards' reports into --out")
    calibrate = sub.add_parser("calibrate", help="measure this GPU's backends for the rules' predicted times")
    calibrate.add_argument("--quick", action="store_true", help="one head-dim pair and two sizes (needs --out)")
    calibrate.add_argument("--out", help="write here instead of the cache directory (where it takes precedence)")
    tune = sub.add_parser("tune", help="measure model shapes now and keep the decisions in the cache")
    warm = sub.add_parser(
        "warmup", help="make model shapes' first calls now (decisions, self-checks, kernel compiles into the cache)"
    )
    for p in (tune, warm):
        p.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["deepseek-v3"])
        p.add_argument("--seqlen", nargs="+", type=int, default=[1024, 4096])
        p.add_argument("--batch", type=int, default=1, help="sequences (thd: a packing of this many at most)")
        p.add_argument("--layout", default="bshd", choices=["bshd", "sbhd", "bhsd", "thd"])
        p.add_argument("--phase", default="both", choices=["training", "inference", "both"])
        p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    warm.add_argument("--backend", help="force a backend, as the job does (default: ATTNSELECT_BACKEND)")
    warm.add_argument("--tokens", type=int, default=0, help="thd: a packing's tokens, q's rows (default: half of "
                      "--batch x --seqlen)")  # fmt: skip
    warm.add_argument("--cuda-graph", action="store_true", help="the job captures these calls into CUDA graphs: "
                      "the kernel the capture ranks first makes its first call too, so the graphs run it")  # fmt: skip
    a = parser.parse_args(argv)
    try:
        return {
            "explain": cmd_explain,
            "demo": cmd_demo,
            "backends": cmd_backends,
            "tune": cmd_tune,
            "warmup": cmd_warmup,
            "bench": cmd_bench,
            "calibrate": cmd_calibrate,
        }[a.command](a)
    except AttnSelectError as exc:
        print(f"{type(exc).__name__}: {_flagged(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
