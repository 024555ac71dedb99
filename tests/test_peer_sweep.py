"""benchmarks/peer_sweep.py: its CPU smoke run works, and its judge catches what it is there to catch."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

import attnselect

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import peer_sweep
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return peer_sweep


def test_peer_sweep_cpu_smoke(tmp_path):
    """The smallest run, in its worker process: every case ok but the refusal attnselect documents (TE's top-left
    window in cross-attention), a record per case, the report's table and the summary as the last lines."""
    out = tmp_path / "peer"
    done = subprocess.run(
        [sys.executable, "benchmarks/peer_sweep.py", "--device", "cpu", "--quick", "--families", "te,torch",
         "--max-seqlen", "32", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "peer.jsonl").read_text().splitlines()]
    assert records and {r["family"] for r in records} == {"te", "torch"}
    for r in records:
        assert r["status"] == "ok" or (r["status"] == "refused" and r["known"]), r
        assert r["status"] != "ok" or (r["chosen"] and set(r["errors"]) >= {"out", "lse"})
    assert "| family | peer tests | cases |" in (tmp_path / "peer.md").read_text()
    assert done.stdout.strip().splitlines()[-1].startswith("wrote ")


def _first(sweep, family: str, want):
    return next(c for c in sweep.all_cases([family], sweep.Fit(32, 2), quick=False) if want(c))


def test_the_judge_catches_wrong_masks_values_and_gap_tokens(sweep, monkeypatch):
    """A kernel that aligns FlashAttention's causal mask top-left, drops a window, mixes up K/V heads, writes into gap
    tokens or rounds off a gradient is judged wrong; the real call is ok."""
    real = attnselect.attention
    causal = _first(  # where top-left and bottom-right differ
        sweep, "fa2", lambda c: c.mask == "causal" and c.training and not c.softcap and c.lengths_q != c.lengths_kv
    )
    local = _first(sweep, "fa2", lambda c: c.mask.startswith("local(") and c.training and 1 < c.heads_kv < c.heads_q)
    gaps = _first(sweep, "te", lambda c: c.mask == "padding_causal" and c.window is None and any(c.pads_q or ()))

    def status(case, change):
        monkeypatch.setattr(attnselect, "attention", change)
        try:
            return sweep.run_case(case, "cpu")["status"]
        finally:
            monkeypatch.setattr(attnselect, "attention", real)

    def scaled_dk(q, k, v, **kw):
        k = k * 1.0
        k.register_hook(lambda g: g * 1.05)
        return real(q, k, v, **kw)

    for case in (causal, local, gaps):
        assert status(case, real) == "ok", case.name
    assert status(causal, lambda q, k, v, **kw: real(q, k, v, **dict(kw, causal=True))) == "wrong"
    assert status(local, lambda q, k, v, **kw: real(q, k, v, **{n: a for n, a in kw.items() if n != "window"})) == (
        "wrong"
    )
    assert status(local, lambda q, k, v, **kw: real(q, k.flip(-2), v.flip(-2), **kw)) == "wrong"
    assert status(causal, scaled_dk) == "wrong"

    def into_gaps(q, k, v, **kw):
        out, lse = real(q, k, v, **kw)
        return out + 1e-3 * (out == 0), lse

    assert status(gaps, into_gaps) == "wrong"


def test_peer_sizes_and_windows(sweep):
    """On a GPU the peers' own sizes; FlashAttention-2's window is the one its test draws after manual_seed(0)."""
    cases = sweep.all_cases(sweep.FAMILIES, sweep.Fit(None, None), quick=False)
    assert 150 <= len({c.configuration for c in cases}) <= 250
    mla = next(c for c in cases if "mla_2_2" in c.name)
    assert (mla.lengths_q, mla.lengths_kv, mla.d_qk, mla.d_v, mla.causal) == ((2048,), (4096,), 192, 128, True)
    local = next(c for c in cases if c.family == "fa2" and "x203 " in c.name and "local(" in c.name)
    torch.manual_seed(0)
    assert local.window[0] == torch.randint(0, 203, (2,)).tolist()[0]
