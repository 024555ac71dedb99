"""The young kernels' allowlists from the correctness grid (attnselect.backends.evidence)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from attnselect.backends import evidence, get
from attnselect.choose.candidates import kernel_reasons
from attnselect.choose.selection import _failed, select, select_packed
from attnselect.errors import ForcedChoiceError, InvalidInputError
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target

H200 = Target.preset("h200")


def _problem(**kw):
    fields = dict(batch=2, seqlen_q=512, seqlen_kv=512, heads_q=8, heads_kv=8, head_dim_qk=192, head_dim_v=128)
    return AttentionProblem(**{**fields, **kw})


@pytest.fixture
def grid(monkeypatch):
    data = {
        "source": "results/grid.md",
        "device": "NVIDIA H200",
        "fingerprint": evidence.base_fingerprint(H200),
        "packages": {"flex": None},
        "kernels": {
            "flex": {
                "dense 192/128 training": {"passed": 3, "failed": 0},
                "dense 64/256 training": {"passed": 2, "failed": 1, "example": "row 7: InductorError: out of resource"},
            }
        },
        "covered": frozenset({("flex", None, _problem(training=True).signature)}),
    }
    monkeypatch.setattr(evidence, "grid_for", lambda arch: data if arch == "sm90" else None)
    return data


def test_a_young_kernel_is_served_only_where_every_row_passed(grid):
    flex = get("flex")
    assert kernel_reasons(flex, _problem(training=True), H200) == []
    failed = kernel_reasons(flex, _problem(training=True, head_dim_qk=64, head_dim_v=256), H200)
    assert failed == ["failed 1 of 3 rows at dense 64/256 training (no MHA row) in results/grid.md"]
    unseen = kernel_reasons(flex, _problem(training=True, head_dim_qk=80, head_dim_v=80), H200)
    assert unseen == ["no correctness grid row ran it at dense 80/80 training (results/grid.md)"]
    elsewhere = kernel_reasons(flex, _problem(training=True), Target.preset("b200"))
    assert elsewhere == ["no correctness grid has passed it on sm100 (benchmarks/correctness_grid.py)"]


def test_a_key_with_failures_serves_the_groupings_whose_rows_all_passed(grid):
    grid["kernels"]["flex"]["thd 128/128 inference"] = {
        "passed": 34, "failed": 2,
        "by_grouping": {"MQA": {"passed": 24, "failed": 2}, "MHA": {"passed": 4, "failed": 0}},
    }  # fmt: skip
    flex, thd = get("flex"), dict(layout="thd", head_dim_qk=128, head_dim_v=128)
    assert kernel_reasons(flex, _problem(**thd), H200) == []
    mqa = kernel_reasons(flex, _problem(**thd, heads_kv=1), H200)
    assert mqa == ["failed 2 of 36 rows at thd 128/128 inference (2 of 26 MQA rows) in results/grid.md"]
    gqa = kernel_reasons(flex, _problem(**thd, heads_kv=2), H200)  # no evidence of its own
    assert gqa == ["failed 2 of 36 rows at thd 128/128 inference (no GQA row) in results/grid.md"]


def test_a_key_that_passed_only_short_sequences_is_served_only_up_to_them(grid):
    grid["kernels"]["flex"]["dense 64/256 inference"] = {
        "passed": 2, "failed": 0, "passed_up_to": 77,
        "failed_beyond": "row 67: InductorError: out of resource: shared memory (a span of 666 tokens)",
    }  # fmt: skip
    flex, dims = get("flex"), dict(head_dim_qk=64, head_dim_v=256)
    assert kernel_reasons(flex, _problem(**dims, seqlen_q=77, seqlen_kv=77), H200) == []
    assert kernel_reasons(flex, _problem(**dims, seqlen_q=16, seqlen_kv=77), H200) == []
    longer = kernel_reasons(flex, _problem(**dims, seqlen_q=64, seqlen_kv=1024), H200)  # the longer side counts
    assert longer == [
        "passed at dense 64/256 inference only up to a span of 77 tokens (this call: 1024); failed beyond at the "
        "same head dims: row 67: InductorError: out of resource: shared memory (a span of 666 tokens) "
        "(results/grid.md)"
    ]
    decision = select(_problem(**dims, seqlen_q=1023, seqlen_kv=1024), target=H200)
    assert decision.chosen.backend != "flex"
    assert "only up to a span of 77 tokens" in decision.report(show_all=True)


def test_a_packed_key_is_limited_by_all_its_tokens_as_flex_runs_them_as_one_sequence(grid):
    grid["kernels"]["flex"]["thd 64/256 inference"] = {
        "passed": 2, "failed": 0, "passed_up_to": 800, "failed_beyond": "row 67: out of resource (a span of 1332)",
    }  # fmt: skip
    flex = get("flex")
    packed = dict(layout="thd", head_dim_qk=64, head_dim_v=256, seqlen_q=300, seqlen_kv=300)
    assert kernel_reasons(flex, _problem(**packed, batch=2), H200) == []  # 600 tokens
    assert "this call: 1200" in kernel_reasons(flex, _problem(**packed, batch=4), H200)[0]
    # a packed loop's decision carried to a packing of more tokens is judged again at its sizes
    assert select_packed(_problem(**packed, batch=2), target=H200, backend="flex").chosen.backend == "flex"
    with pytest.raises(ForcedChoiceError, match="this call: 1200"):
        select_packed(_problem(**packed, batch=4), target=H200, backend="flex")


def test_the_allowlist_reads_a_problems_sizes_only_where_a_key_holds_a_span(grid, monkeypatch):
    """reads_sizes: the allowlist's reasons read a problem's sizes only at a key the grid passed up to a span; at
    the others (and with the allowlist off) they are the same at every size, which lets a packed loop's settled
    decision leave its young kernel's verdict unjudged on a new packing (attnselect.choose.selection)."""
    import random

    grid["kernels"]["flex"]["thd 64/256 inference"] = {
        "passed": 2, "failed": 0, "passed_up_to": 800, "failed_beyond": "row 67: out of resource (a span of 1332)",
    }  # fmt: skip
    grid["kernels"]["flex"]["thd 128/128 inference"] = {
        "passed": 34, "failed": 2,
        "by_grouping": {"MQA": {"passed": 24, "failed": 2}, "MHA": {"passed": 4, "failed": 0}},
    }  # fmt: skip
    limited = dict(layout="thd", head_dim_qk=64, head_dim_v=256)
    assert evidence.reads_sizes("flex", _problem(**limited), H200)
    rng = random.Random(0)
    for dims in (dict(head_dim_qk=128, head_dim_v=128), dict(head_dim_qk=80, head_dim_v=80), {}):
        for heads_kv in (8, 2, 1):
            problem = _problem(layout="thd", heads_kv=heads_kv, **dims)
            assert not evidence.reads_sizes("flex", problem, H200)
            sizes = [(rng.randint(1, 60), rng.randint(1, 9000)) for _ in range(20)]
            reasons = {tuple(evidence.reasons("flex", problem._with(batch=b, seqlen_q=s, seqlen_kv=s), H200))
                       for b, s in sizes}  # fmt: skip
            assert len(reasons) == 1, reasons
    monkeypatch.setenv("ATTNSELECT_ALLOWLIST", "0")
    assert not evidence.reads_sizes("flex", _problem(**limited), H200)


def test_the_packaged_h200_grid_limits_flex_at_64_256_to_the_length_it_passed():
    """The peer sweep's test_flash_attn_output[d64 dv256 1023x1024 mha none bfloat16 fwd] chose flex without the
    cuDNN frontend and flex ran out of shared memory (results/h200_peer_sweep_without_frontend.md)."""
    evidence.grid_for.cache_clear()
    problem = _problem(batch=4, seqlen_q=1023, seqlen_kv=1024, heads_q=4, heads_kv=4, head_dim_qk=64,
                       head_dim_v=256, dtype=torch.bfloat16)  # fmt: skip
    refused = kernel_reasons(get("flex"), problem, H200)
    assert refused and "only up to a span of 77 tokens" in refused[0] and "out of resource" in refused[0]
    short = dataclasses.replace(problem, seqlen_q=77, seqlen_kv=77)
    assert kernel_reasons(get("flex"), short, H200) == []


def test_the_allowlist_leaves_older_kernels_and_the_cpu_alone(grid):
    assert kernel_reasons(get("sdpa_cudnn"), _problem(head_dim_qk=80, head_dim_v=80), H200) == []
    assert kernel_reasons(get("flex"), _problem(head_dim_qk=80, head_dim_v=80), Target.preset("cpu")) == []


def test_the_allowlist_can_be_switched_off(grid, monkeypatch):
    monkeypatch.setenv("ATTNSELECT_ALLOWLIST", "0")
    assert kernel_reasons(get("flex"), _problem(training=True, head_dim_qk=80, head_dim_v=80), H200) == []
    monkeypatch.setenv("ATTNSELECT_ALLOWLIST", "yes")
    with pytest.raises(InvalidInputError, match="ATTNSELECT_ALLOWLIST: got 'yes'"):
        evidence.allowlist_enabled()


def test_covered_signatures_need_the_same_versions(grid):
    problem = _problem(training=True)
    assert evidence.covers("flex", None, problem, H200, None)
    assert not evidence.covers("flex", None, _problem(training=True, seqlen_q=4096, seqlen_kv=4096), H200, None)
    assert not evidence.covers("flex", None, problem, Target.preset("h200", torch_version="2.12.0"), None)
    grid["packages"]["flex"] = "1.0"  # a backend's own package version must match too
    assert not evidence.covers("flex", None, problem, H200, None)


def test_a_signature_a_peer_sweep_failed_is_refused_there_as_a_failure(grid):
    problem = _problem(training=True, dtype=torch.float16, softcap=True)
    finding = "wrong in results/sweep.jsonl: case: self-check: WrongResultError: dq, dk wrong"
    grid["failed"] = {problem.signature: {"flex": finding}}
    assert _failed(problem, H200) == {Candidate("flex"): finding, Candidate("flex", 192): finding}  # padded or not
    square = _problem(training=True, dtype=torch.float16, softcap=True, head_dim_v=192)
    grid["failed"][square.signature] = {"flex": finding}
    assert _failed(square, H200) == {Candidate("flex"): finding}
    decision = select(problem, target=H200)
    assert decision.chosen.backend != "flex"
    assert finding in decision.report(show_all=True)
    assert _failed(_problem(training=True, dtype=torch.float16), H200) == {}  # another signature
    for inside in ("cuda_graph_capture", "compiled_graph"):  # failed eagerly: refused under capture and compile too
        assert _failed(dataclasses.replace(problem, **{inside: True}), H200) == _failed(problem, H200)
    assert _failed(problem, Target.preset("h200", torch_version="2.12.0")) == {}  # other versions: not known
    assert _failed(problem, Target.preset("b200")) == {}


def test_the_packaged_h200_grid_loads_and_names_its_source():
    evidence.grid_for.cache_clear()
    data = evidence.grid_for("sm90")
    assert data is not None and data["source"].startswith("results/h200_correctness_grid.md")
    assert {"flex", "cudnn_frontend"} <= set(data["kernels"])
    findings = [finding for found in data["failed"].values() for finding in found.values()]
    assert findings and all(" in results/h200_peer_sweep" in finding for finding in findings)


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps({"format": 99}),
        json.dumps([1, 2]),
        json.dumps({"format": 1, "source": "x", "covered": [], "kernels": {"flex": [1]}}),
        json.dumps({"format": 1, "source": "x", "covered": [[1]], "kernels": {}}),
        json.dumps({"format": 1, "source": "x", "covered": [], "kernels": {}, "failed": [["flex", 0, [], "x"]]}),
        json.dumps({"format": 1, "source": "x", "covered": [], "kernels": {}, "failed": {"a": 1}}),
        *(
            json.dumps(
                {
                    "format": 1,
                    "source": "x",
                    "covered": [],
                    "kernels": {"flex": {"k": {"passed": 1, "failed": 0, **limit}}},
                }
            )
            for limit in (
                {"passed_up_to": "77", "failed_beyond": "x"},
                {"passed_up_to": 77},
                {"failed_beyond": "x"},
                {"passed_up_to": 0, "failed_beyond": "x"},
            )
        ),
        json.dumps(
            {
                "format": 1,
                "source": "x",
                "covered": [],
                "kernels": {"flex": {"k": {"passed": 1, "failed": 0, "by_grouping": []}}},
            }
        ),
    ],
)
def test_a_foreign_or_corrupt_summary_is_ignored_with_one_warning(content, monkeypatch, caplog):
    class Files:
        def joinpath(self, *parts):
            return self

        def read_text(self):
            return content

    monkeypatch.setattr(evidence.resources, "files", lambda package: Files())
    evidence.grid_for.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="attnselect"):
            assert evidence.grid_for("sm90") is None
        assert sum("ignoring the correctness summary" in r.getMessage() for r in caplog.records) == 1
    finally:
        evidence.grid_for.cache_clear()


def test_the_packaged_grid_covers_each_signature_where_every_row_passed():
    """Covered signatures are looked up as AttentionProblem.signature holds them: the loaded grid holds exactly the
    (backend, pad_to, signature) of the committed rows that passed in every row of their signature."""
    import pathlib

    from attnselect.spec.problem import AttentionProblem

    evidence.grid_for.cache_clear()
    grid = evidence.grid_for("sm90")
    rows = pathlib.Path(__file__).parents[2] / "results" / "h200_correctness_grid.jsonl"
    passed: dict = {}
    for line in rows.read_text().splitlines():
        r = json.loads(line)
        key = (r["backend"], r["pad_to"], AttentionProblem.from_dict(r["problem"]).signature)
        passed[key] = passed.get(key, True) and r["passed"]
    assert grid["covered"] == {key for key, ok in passed.items() if ok}
