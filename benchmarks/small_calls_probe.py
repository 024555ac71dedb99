"""Small dense calls, kernel by kernel: the host's time to issue one, a call alone, a layer of a stack.

    python benchmarks/small_calls_probe.py --out results/h200_small_calls_probe   # a GPU; writes .json and .md

The size ladder's small dense rungs (benchmarks/ladder.py: bshd, 16 heads, causal, bf16, contiguous bshd tensors,
training a forward and ``torch.autograd.grad``) at B1 S256 192/128, B1 S256 128/128, B1 S1024 128/128, B1 S1024
192/128 and B8 S1024 192/128, both phases (``--shapes``, ``--phases``: others). Rows: attnselect with each SDPA kernel
forced (``backend=``), F.sdpa's default dispatch (the kernel it picks is reported), F.sdpa inside ``sdpa_kernel`` of
each kernel (the kernel with torch's dispatch alone), ops F.sdpa's dispatch reaches (cuDNN's on the transposed views,
the mem-efficient kernel's own on the bshd tensors), and ``sdpa_cudnn``'s runner as attnselect prepares it for these
calls (no memo lookup), calling cuDNN's op (what attnselect runs) and, beside it, calling F.sdpa's default dispatch
where that reaches cuDNN (the backend without its ``aten_op``): which of the two a repeated call should take.
Three measures, each row's in the same rounds (``--rounds``, in alternating order): ``host``, the host's time to
issue a call while the GPU is busy (after a ~1 ms spin, as attnselect.bench.calibrate measures host times for the
packaged calibration); ``latency``, one call then a sync; ``stack``, ``--layers`` calls then a sync, per call.
Reported: the median and quartiles of every round pooled, and each round's median (a row whose rounds disagree is
bimodal, not noisy). A profile of one training call of each attnselect row (the host's top operators by self time)
follows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnselect

SHAPES = ((1, 256, 192, 128), (1, 256, 128, 128), (1, 1024, 128, 128), (1, 1024, 192, 128), (8, 1024, 192, 128))
KERNELS = {
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}
HEADS = 16


def rows(q, k, v) -> dict:
    out = {f"attnselect {name}": (lambda name=name: attnselect.attention(q, k, v, causal=True, backend=name, pad=False))
           for name in KERNELS}  # fmt: skip

    def sdpa(kernel=None):
        def call():
            views = (t.transpose(1, 2) for t in (q, k, v))
            if kernel is None:
                return F.scaled_dot_product_attention(*views, is_causal=True).transpose(1, 2)
            with sdpa_kernel(kernel):
                return F.scaled_dot_product_attention(*views, is_causal=True).transpose(1, 2)

        return call

    out["F.sdpa default"] = sdpa()
    out.update({f"F.sdpa {name}": sdpa(kernel) for name, kernel in KERNELS.items()})
    lse = q.requires_grad  # attention.cpp should_compute_logsumexp

    def cudnn_op():  # the op F.sdpa calls once its dispatch has chosen cuDNN, on the transposed views
        views = (t.transpose(1, 2) for t in (q, k, v))
        return torch._scaled_dot_product_cudnn_attention(*views, None, lse, 0.0, True)[0].transpose(1, 2)

    efficient = torch.ops.aten._efficient_attention_forward.default
    out["aten cudnn op"] = cudnn_op
    out["aten efficient op, bshd"] = lambda: efficient(q, k, v, None, None, None, None, None, 0.0, 1, lse)[0]
    out.update(cudnn_runners(q, k, v))
    return out


def cudnn_runners(q, k, v) -> dict:
    """``sdpa_cudnn``'s prepared runners for calls like (q, k, v) (attnselect.execution.dense_runner, as attention()
    memoizes them): through cuDNN's op, and through F.sdpa's default dispatch (the backend without its op)."""
    from attnselect import backends
    from attnselect.execution import dense_runner, kernel_call

    (batch, sq, hq, d_qk), (skv, hkv, d_v) = q.shape, v.shape[1:]
    problem = attnselect.AttentionProblem(
        batch, sq, skv, hq, hkv, d_qk, d_v, mask="causal", dtype=q.dtype, training=q.requires_grad
    )
    backend = backends.get("sdpa_cudnn")
    dispatching = type("SdpaCudnnDispatched", (type(backend),), {"aten_op": None})()
    out = {}
    for name, b in (("sdpa_cudnn runner, op", backend), ("sdpa_cudnn runner, dispatch", dispatching)):
        run = dense_runner(b, None, "bshd", kernel_call(problem), like=(q, k, v))
        out[name] = lambda run=run: run(q, k, v)[0]
    return out


def step(fn, q, k, v, grad):
    def run():
        o = fn()
        if grad is not None:
            torch.autograd.grad(o, (q, k, v), grad)

    return run


def served(run) -> bool:
    try:
        run()
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def measure(run, calls: int, layers: int) -> dict:
    host, latency, stack = [], [], []
    for _ in range(calls):
        torch.cuda._sleep(2_000_000)
        start = time.perf_counter()
        run()
        host.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        latency.append((time.perf_counter() - start) * 1e6)
    for _ in range(max(calls // 2, 1)):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(layers):
            run()
        torch.cuda.synchronize()
        stack.append((time.perf_counter() - start) * 1e6 / layers)
    return {"host": host, "latency": latency, "stack": stack}


def summary(values: list[float]) -> dict:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return {"median": median, "q1": q1, "q3": q3}


def profile(run) -> list:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profiler(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            run()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return [{"op": e.key, "self_us_per_call": e.self_cpu_time_total / 10, "count_per_call": e.count / 10}
            for e in events]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shapes", nargs="+", metavar="BxSxDQKxDV", help="these shapes instead (e.g. 1x4096x192x128)")
    ap.add_argument("--phases", nargs="+", choices=("inference", "training"), default=["inference", "training"])
    a = ap.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in a.shapes] if a.shapes else SHAPES
    target = attnselect.Target.current()
    report = {"device": target.describe(), "date": time.strftime("%F"), "rounds": a.rounds, "calls": a.calls,
              "layers": a.layers, "shapes": []}  # fmt: skip
    for batch, seqlen, d_qk, d_v in shapes:
        for training in (phase == "training" for phase in a.phases):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(batch, seqlen, HEADS, d, device="cuda", dtype=torch.bfloat16, generator=g)
                       .requires_grad_(training) for d in (d_qk, d_qk, d_v))  # fmt: skip
            grad = torch.randn(batch, seqlen, HEADS, d_v, device="cuda", dtype=torch.bfloat16) if training else None
            name = f"B{batch} S{seqlen} {d_qk}/{d_v} {'training' if training else 'inference'}"
            with torch.enable_grad() if training else torch.no_grad():
                choice = torch._fused_sdp_choice(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
            default = next((n for n, b in SDPBackend.__members__.items() if b.value == choice), str(choice))
            with torch.enable_grad() if training else torch.no_grad():
                runs = {r: step(fn, q, k, v, grad) for r, fn in rows(q, k, v).items()}
                runs = {r: run for r, run in runs.items() if served(run)}
                for run in runs.values():  # warm-up: choices, graphs
                    for _ in range(3):
                        run()
                torch.cuda.synchronize()
                raw = {r: {"host": [], "latency": [], "stack": []} for r in runs}
                per_round = {r: {"host": [], "latency": [], "stack": []} for r in runs}
                order = list(runs)
                for rnd in range(a.rounds):
                    for r in order if rnd % 2 == 0 else reversed(order):
                        got = measure(runs[r], a.calls, a.layers)
                        for way, values in got.items():
                            raw[r][way] += values
                            per_round[r][way].append(round(statistics.median(values), 1))
                profiles = {r: profile(runs[r]) for r in runs if r.startswith("attnselect") and training}
            stats = {r: {way: dict(summary(raw[r][way]), rounds=per_round[r][way]) for way in raw[r]} for r in runs}
            entry = {"shape": name, "sdpa_default": default, "rows": stats, "profiles": profiles}
            report["shapes"].append(entry)
            print(name, "F.sdpa default:", default, flush=True)
            for r, ways in entry["rows"].items():
                print(f"  {r:26s}", "  ".join(f"{w} {s['median']:7.1f} {s['rounds']}" for w, s in ways.items()))
            del q, k, v, grad
    Path(a.out + ".json").write_text(json.dumps(report, indent=1))
    lines = [
        "# Small dense calls, kernel by kernel",
        "",
        f"{report['device']}, {report['date']}. Produced by `benchmarks/small_calls_probe.py` (method in its "
        f"docstring): us per call, median (quartiles) of {a.rounds} rounds of {a.calls} calls pooled "
        f"(stack: {a.calls // 2} steps of {a.layers} layers), then each round's median.",
    ]
    for entry in report["shapes"]:
        lines += ["", f"## {entry['shape']}", "", f"F.sdpa's default dispatch: {entry['sdpa_default']}."]
        lines += ["", "| row | host | latency | stack |", "|---|---|---|---|"]
        for r, ways in entry["rows"].items():
            cells = [f"{w['median']:.1f} ({w['q1']:.1f}..{w['q3']:.1f}) {w['rounds']}" for w in ways.values()]
            lines.append(f"| {r} | " + " | ".join(cells) + " |")
        for r, events in entry["profiles"].items():
            lines += ["", f"{r}, one call's host operators by self time (us, calls):", ""]
            lines += [f"- {e['op']}: {e['self_us_per_call']:.1f} us, {e['count_per_call']:g}" for e in events]
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
