"""attnselect calibrate (attnselect.bench.calibrate): its measurement is a calibration the rules can read."""

from __future__ import annotations

import pytest

from attnselect import cli
from attnselect.bench import calibrate
from attnselect.choose import calibration, predict
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem


def test_a_quick_calibration_on_the_cpu_is_one_the_rules_can_read():
    seen = []
    data = calibrate.run(quick=True, progress=lambda done, total, what: seen.append((done, total)))
    assert calibration._problem(data) is None and data["fingerprint"]["name"] == "cpu"
    assert seen[0] == (0, 2) and seen[-1] == (2, 2)
    curves = data["gpu"]["sdpa_flash"]
    assert set(curves) == {"dense 192/128+pad training", "thd 192/128+pad training"}
    assert all(len(points) == 2 and points[0][0] < points[1][0] for points in curves.values())
    problem = AttentionProblem(1, 256, 256, 16, 16, 192, 128, mask="causal", training=True)
    time = predict.predict(Candidate("sdpa_flash", 192), problem, data)
    assert time is not None and time.host_us == data["host_us"]["sdpa_flash"]["dense+pad training"]
    assert data["first_call_ms"]["sdpa_flash"] >= 0


def test_the_command_needs_a_gpu(capsys):
    assert cli.main(["calibrate", "--quick"]) == 2
    assert "expected one" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_command_writes_a_calibration_that_holds_here(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    calibration.parse.cache_clear()
    assert cli.main(["calibrate", "--quick"]) == 0
    from attnselect.spec.target import Target

    found, source = calibration.for_target(Target.current())
    assert found is not None and source.startswith(str(tmp_path))
