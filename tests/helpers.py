"""Shared test helpers: random inputs for a problem and a float64 reference run."""

from __future__ import annotations

import importlib
import pathlib
import sys

import torch

import attnselect
from attnselect.choose.calibration import FORMAT, fingerprint
from attnselect.spec.target import Target

# The small MLA-like causal training problem the selection, settings and decision tests judge on the CPU target.
SELECTION_PROBLEM = attnselect.AttentionProblem(
    batch=1,
    seqlen_q=64,
    seqlen_kv=64,
    heads_q=2,
    heads_kv=2,
    head_dim_qk=24,
    head_dim_v=16,
    dtype=torch.float32,
    mask="causal",
    training=True,
)
CPU = Target.preset("cpu")

# DeepSeek-V3's attention at 4k tokens: the fields of an AttentionProblem (the rules' and cuDNN's gate tests).
MLA = dict(
    batch=2,
    seqlen_q=4096,
    seqlen_kv=4096,
    heads_q=16,
    heads_kv=16,
    head_dim_qk=192,
    head_dim_v=128,
    dtype=torch.bfloat16,
    mask="causal",
)


def verdict(decision, backend, pad_to=None):
    return next(v for v in decision.verdicts if v.candidate == attnselect.Candidate(backend, pad_to))


SHAPES = {
    "bshd": lambda b, s, h, d: (b, s, h, d),
    "sbhd": lambda b, s, h, d: (s, b, h, d),
    "bhsd": lambda b, s, h, d: (b, h, s, d),
}


def dense_inputs(
    layout="bshd",
    b=2,
    sq=33,
    skv=33,
    hq=4,
    hkv=4,
    dqk=24,
    dv=16,
    dtype=torch.float64,
    device="cpu",
    requires_grad=True,
    seed=0,
):
    g = torch.Generator().manual_seed(seed)
    make = SHAPES[layout]
    q = torch.randn(make(b, sq, hq, dqk), generator=g, dtype=torch.float64)
    k = torch.randn(make(b, skv, hkv, dqk), generator=g, dtype=torch.float64)
    v = torch.randn(make(b, skv, hkv, dv), generator=g, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype).requires_grad_(requires_grad) for t in (q, k, v)]


def thd_inputs(lengths_q, lengths_kv=None, hq=4, hkv=2, dqk=24, dv=16, dtype=torch.float64, device="cpu", seed=0):
    """((q, k, v) requiring grad, cu_seqlens_q, cu_seqlens_kv) for packed sequences of the given lengths."""
    lengths_kv = lengths_q if lengths_kv is None else lengths_kv
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_kv)
    q = torch.randn(tq, hq, dqk, generator=g, dtype=torch.float64)
    k = torch.randn(tk, hkv, dqk, generator=g, dtype=torch.float64)
    v = torch.randn(tk, hkv, dv, generator=g, dtype=torch.float64)
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0).tolist()), dtype=torch.int32, device=device)
    tensors = [t.to(device=device, dtype=dtype).requires_grad_(True) for t in (q, k, v)]
    return tensors, cu(lengths_q), cu(lengths_kv)


def run_with_grads(q, k, v, grad_seed=1, **kwargs):
    """(out, lse or None, [dq, dk, dv]) for attnselect.attention with the given kwargs."""
    for t in (q, k, v):
        t.grad = None
    result = attnselect.attention(q, k, v, **kwargs)
    out, lse = result if isinstance(result, tuple) else (result, None)
    g = torch.Generator().manual_seed(grad_seed)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out)
    out.backward(grad_out)
    return out.detach(), lse, [t.grad.clone() for t in (q, k, v)]


def rel_err(a, b) -> float:
    """Relative Frobenius error; -inf entries (lse of rows without keys) must sit in the same places."""
    a, b = a.double(), b.double()
    if not torch.equal(torch.isneginf(a), torch.isneginf(b)):
        return float("inf")
    finite = ~torch.isneginf(b)
    a, b = a[finite], b[finite]
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_group(script: str, n: int, *arguments: str, timeout: float = 600) -> dict:
    """Run ``script rank n port *arguments`` as a gloo group of ``n`` processes (a decision cache of their own, no
    ATTNSELECT_* variable); returns {(rank, case): report} from the JSON lines each prints."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {name: value for name, value in os.environ.items() if not name.startswith("ATTNSELECT_")}
    env["ATTNSELECT_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnselect-group-")
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(rank), str(n), port, *arguments],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for rank in range(n)
    ]
    outputs = [p.communicate(timeout=timeout) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outputs]
    reports = {}
    for out, _ in outputs:
        for line in out.splitlines():
            if line.startswith("{"):
                report = json.loads(line)
                reports[report["rank"], report["case"]] = report
    return reports


CALIBRATED_H200 = Target.preset("h200", packages={"flash-attn-4": "4.0.0b36"})


def calibration_sample(target: Target = CALIBRATED_H200, **changes) -> dict:
    """A small calibration of ``target``: sdpa_cudnn and flash_attn4 on dense 192/128 training."""
    data = {
        "format": FORMAT,
        "fingerprint": fingerprint(target),
        "device": target.describe(),
        "date": "2026-12-02",
        "source": "tests",
        "host_us": {
            "sdpa_cudnn": {"dense training": 60.0, "dense inference": 25.0, "dense+pad training": 80.0},
            "flash_attn4": {"dense training": 300.0, "dense inference": 130.0, "dense+pad training": 320.0},
        },
        "gpu": {
            "sdpa_cudnn": {
                "dense 192/128 training": [[10.0, 20.0], [1e4, 1000.0]],
                "dense 192/128+pad training": [[10.0, 25.0], [1e4, 1300.0]],
            },
            "flash_attn4": {
                "dense 192/128 training": [[10.0, 15.0], [1e4, 800.0]],
                "dense 192/128+pad training": [[10.0, 18.0], [1e4, 1000.0]],
            },
        },
        "first_call_ms": {"flash_attn4": 4000.0},
        # the rest rank after these two
        "skipped": [
            "sdpa_flash",
            "sdpa_efficient",
            "sdpa_math",
            "flex",
            "reference",
            "flash_attn2",
            "flash_attn3",
            "cudnn_frontend",
            "varlen_fa2",
        ],  # fmt: skip
    }
    data.update(changes)
    return data


def replaying_calibration_sample() -> dict:
    """:func:`calibration_sample` with FA4's forward timed replayed (a shape called before), dense and packed, and
    inference curves to predict with."""
    data = calibration_sample()
    data["host_us"]["flash_attn4"].update({"thd inference": 150.0})
    data["new_packing_us"] = {"flash_attn4": {"thd inference": 250.0}}
    data["replayed_host_us"] = {"flash_attn4": {"dense inference": 15.0, "thd inference": 20.0}}
    data["gpu"]["flash_attn4"].update({"dense 192/128 inference": [[10.0, 8.0], [1e4, 300.0]],
                                       "thd 192/128 inference": [[10.0, 9.0], [1e4, 320.0]]})  # fmt: skip
    data["gpu"]["sdpa_cudnn"].update({"dense 192/128 inference": [[10.0, 12.0], [1e4, 400.0]],
                                      "dense 192/128+pad inference": [[10.0, 14.0], [1e4, 500.0]]})  # fmt: skip
    data["gpu"]["flash_attn4"]["dense 192/128+pad inference"] = [[10.0, 10.0], [1e4, 380.0]]
    data["host_us"]["sdpa_cudnn"]["dense+pad inference"] = 50.0
    data["host_us"]["flash_attn4"]["dense+pad inference"] = 160.0
    return data


def benchmark_module(name: str):
    """A module of benchmarks/ (they import one another by bare name)."""
    benchmarks = str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(benchmarks)


def pickled_equal_elsewhere(value, fresh: str, tmp_path) -> None:
    """Assert that ``value``, pickled and loaded in processes of other string hashes (PYTHONHASHSEED 1 and 2), equals
    and hashes as ``fresh`` (an expression over ``attnselect``) made there: a cached hash must not travel."""
    import os
    import pickle
    import subprocess
    import sys

    (tmp_path / "value.pkl").write_bytes(pickle.dumps(value))
    code = (
        "import pickle, sys, attnselect; value = pickle.load(open(sys.argv[1], 'rb')); "
        f"fresh = {fresh}; assert {{fresh: 1}}.get(value) == 1 and hash(value) == hash(fresh)"
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", code, str(tmp_path / "value.pkl")], env=env, check=True)
