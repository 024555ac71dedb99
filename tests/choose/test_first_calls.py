"""A compile still to pay on a first call: rent the next candidate until the rent reaches the price
(attnselect.choose.first_calls)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import attnselect
from attnselect import api
from attnselect.choose import calibration, first_calls
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem
from helpers import CALIBRATED_H200 as H200
from helpers import calibration_sample as sample

LARGE = AttentionProblem(4, 8192, 8192, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
FA4 = Candidate("flash_attn4")


@pytest.fixture(autouse=True)
def calibrated(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    calibration.parse.cache_clear()
    calibration.user_path(H200).write_text(json.dumps(sample()))
    attnselect.clear_cache()
    first_calls.forget()
    yield
    calibration.parse.cache_clear()
    attnselect.clear_cache()
    first_calls.forget()


def test_a_faster_kernel_that_compiles_waits_until_the_time_lost_reaches_its_compile():
    decision = attnselect.select(LARGE, target=H200)
    assert decision.ranked[0] == FA4 and decision.chosen == Candidate("sdpa_cudnn")
    rental = decision.rental
    lost = decision.predictions[decision.chosen].total_us - decision.predictions[FA4].total_us
    assert rental.deferred == FA4 and rental.compile_ms == 4000.0
    assert rental.calls == math.ceil(4000.0 * 1e3 / lost) and rental.lost_us == pytest.approx(lost)
    assert "compiles on its first call in this process (about 4.0 s, calibrated)" in decision.why
    assert f"{rental.calls} calls, then flash_attn4" in decision.why


def test_once_its_configuration_ran_in_this_process_the_fastest_is_chosen():
    first_calls.ran(FA4, LARGE)
    decision = attnselect.select(LARGE, target=H200)
    assert decision.chosen == FA4 and decision.rental is None
    attnselect.clear_cache()  # the decision caches forget; what this process compiled stays
    assert attnselect.select(LARGE, target=H200).chosen == FA4


def test_no_rental_where_the_caller_forced_a_backend_or_the_call_is_captured_or_compiled():
    assert attnselect.select(LARGE, target=H200, backend="flash_attn4").chosen == FA4
    for graph in (dict(cuda_graph_capture=True), dict(compiled_graph=True)):
        assert attnselect.select(LARGE._with(**graph), target=H200).rental is None, graph


def test_the_renting_runner_pays_at_its_count_and_makes_the_next_call_choose_again(monkeypatch):
    rental = attnselect.select(LARGE, target=H200).rental
    cleared = []
    monkeypatch.setattr(api, "clear_cache", lambda: cleared.append(True))
    run = api._renting(lambda *args: args, rental._replace(calls=3), LARGE)
    for _ in range(2):
        assert run(1, 2, 3) == (1, 2, 3)
    assert not cleared and attnselect.select(LARGE, target=H200).rental is not None
    run(1, 2, 3)
    assert cleared == [True]
    attnselect.clear_cache()
    assert attnselect.select(LARGE, target=H200).chosen == FA4
    run(1, 2, 3)  # past the count: nothing more
    assert cleared == [True]


def test_calls_at_other_sizes_of_the_signature_rent_together(monkeypatch):
    """A packed loop brings new sizes every step, so a new decision and runner: the count goes on across them."""
    rental = attnselect.select(LARGE, target=H200).rental._replace(calls=4)
    cleared = []
    monkeypatch.setattr(api, "clear_cache", lambda: cleared.append(True))
    for seqlen in (8192, 8000, 7900, 8100):
        api._renting(lambda *args: None, rental, LARGE._with(seqlen_q=seqlen, seqlen_kv=seqlen))()
    assert cleared == [True]
