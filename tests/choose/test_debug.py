"""ATTNSELECT_DEBUG / ATTNSELECT_DEBUG_LEVEL logging, like TransformerEngine's NVTE_DEBUG."""

from __future__ import annotations

import pytest
import torch

import attnselect
from attnselect import AttentionProblem, Target

P = AttentionProblem(
    batch=1, seqlen_q=8, seqlen_kv=8, heads_q=2, heads_kv=2, head_dim_qk=24, head_dim_v=16, dtype=torch.float32
)


def test_level_1_logs_one_line_per_new_decision(monkeypatch, capsys):
    monkeypatch.setenv("ATTNSELECT_DEBUG", "1")
    attnselect.select(P, target=Target.preset("cpu"))
    attnselect.select(P, target=Target.preset("cpu"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[attnselect INFO]")
    assert "running sdpa_flash, padded to 24, because" in err[0]


def test_level_2_logs_every_candidate(monkeypatch, capsys):
    monkeypatch.setenv("ATTNSELECT_DEBUG", "1")
    monkeypatch.setenv("ATTNSELECT_DEBUG_LEVEL", "2")
    attnselect.select(P, target=Target.preset("cpu"))
    err = capsys.readouterr().err
    assert "sdpa_flash padded to 24: supported, rank 1" in err
    assert "sdpa_cudnn native: not supported: runs on cuda only" in err


def test_nothing_printed_without_debug_and_memoized_calls_log_nothing(monkeypatch, capsys):
    attnselect.select(P, target=Target.preset("cpu"))
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("ATTNSELECT_DEBUG", "1")
    q, k, v = (torch.randn(1, 8, 2, d) for d in (24, 24, 16))
    attnselect.attention(q, k, v)
    assert capsys.readouterr().err.count("[attnselect INFO]") == 1
    attnselect.attention(q, k, v)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name,value", [("ATTNSELECT_DEBUG", "yes"), ("ATTNSELECT_DEBUG_LEVEL", "3")])
def test_bad_debug_values_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(attnselect.InvalidInputError, match=name):
        attnselect.select(P, target=Target.preset("cpu"))
