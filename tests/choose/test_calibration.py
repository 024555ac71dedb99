"""Calibrations: the file format, where they come from, and which GPU and versions they hold for
(attnselect.choose.calibration)."""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from importlib import resources

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnselect
from attnselect import memos
from attnselect.choose import calibration
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target
from helpers import CALIBRATED_H200 as H200
from helpers import calibration_sample as sample


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    calibration._parsed.cache_clear()
    yield calibration.user_path(H200)
    calibration._parsed.cache_clear()


def test_a_calibration_of_this_gpu_and_these_versions_holds(user_file):
    user_file.write_text(json.dumps(sample()))
    found, source = calibration.for_target(H200)
    assert found is not None and source == str(user_file)


@pytest.mark.parametrize(
    "other",
    [
        Target.preset("h200", torch_version="2.12.0", packages={"flash-attn-4": "4.0.0b36"}),
        Target.preset("h200", cudnn_version="9.20.0", packages={"flash-attn-4": "4.0.0b36"}),
    ],
)
def test_other_versions_get_no_calibration_and_are_told_why(user_file, other):
    user_file.write_text(json.dumps(sample()))
    found, why = calibration.for_target(other)
    assert found is None and "is for NVIDIA H200" in why and "attnselect calibrate" in why


@pytest.mark.parametrize("fa4", [None, "4.0.0b37"])
def test_a_backend_package_s_version_is_matched_backend_by_backend(user_file, fa4):
    """A calibration made with FA4 holds on the same machine without it (FA4 is then no candidate); where another
    FA4 is installed, its times do not hold and the calibration orders nothing, saying why."""
    user_file.write_text(json.dumps(sample()))
    other = Target.preset("h200", packages={"flash-attn-4": fa4})
    found, _ = calibration.for_target(other)
    assert found is not None
    assert calibration.package_changed(found, "flash-attn-4", H200) is None
    why = calibration.package_changed(found, "flash-attn-4", other)
    assert why == f"flash-attn-4 {fa4} is installed, the calibration measured 4.0.0b36"


def test_gpu_models_of_one_arch_keep_their_own_files(user_file):
    """An H100 and an H200 sharing a cache directory, or a package shipping both, do not read (or overwrite) each
    other's calibration."""
    h100 = Target.preset("h100", packages={"flash-attn-4": "4.0.0b36"})
    assert calibration.user_path(h100) != user_file
    assert calibration.file_name("sm90", "NVIDIA H100") != calibration.file_name("sm90", "NVIDIA H200")
    user_file.write_text(json.dumps(sample()))
    found, why = calibration.for_target(h100)  # the user's file and the packaged one are the H200's
    assert found is None and why == "no calibration for the NVIDIA H100 (sm90): `attnselect calibrate` on it makes one"
    assert calibration.packaged(h100) is None and calibration.packaged(H200)["fingerprint"]["name"] == "NVIDIA H200"


def test_a_user_calibration_left_behind_by_an_upgrade_is_not_used_and_said_once(user_file, caplog):
    stamped = sample()
    stamped["fingerprint"] = dict(stamped["fingerprint"], attnselect="0.0.1")  # another attnselect
    user_file.write_text(json.dumps(stamped))
    for _ in range(2):
        attnselect.clear_cache()
        found, why = calibration.for_target(H200)
        assert found is None and f"{user_file} is for NVIDIA H200" in why and "attnselect 0.0.1" in why
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and str(user_file) in r.getMessage()]
    assert len(said) == 1 and "it was made for" in said[0] and "attnselect 0.0.1" in said[0]


@pytest.mark.parametrize("content", ["not json", json.dumps({"format": 99})])
def test_explain_says_why_a_user_calibration_was_ignored_every_time(user_file, content):
    """The warning is logged once a process; explain tells each time why the user's own file was not read."""
    user_file.write_text(content)
    for _ in range(2):
        attnselect.clear_cache()
        found, why = calibration.for_target(H200)
        assert f"{user_file} was ignored (" in why


def test_the_cpu_has_no_calibration():
    assert calibration.for_target(Target.preset("cpu")) == (None, "")


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        "[1, 2]",
        json.dumps({"format": 99}),
        json.dumps(sample(fingerprint={"name": "x"})),
        json.dumps(sample(host_us={"sdpa_cudnn": {"dense training": "fast"}})),
        json.dumps(sample(host_us={"sdpa_cudnn": {"dense training": -1.0}})),
        json.dumps(sample(gpu={"sdpa_cudnn": {"dense 192/128 training": [[10.0]]}})),
        json.dumps(sample(gpu={"sdpa_cudnn": {"dense 192/128 training": [[100.0, 1.0], [10.0, 2.0]]}})),
        json.dumps(sample(gpu={"sdpa_cudnn": {"dense 192/128 training": []}})),
        json.dumps(sample(first_call_ms=[1])),
        json.dumps(sample(first_call_ms={"flash_attn4": {"dense": 1.0}})),
        json.dumps(sample(new_size_ms={"sdpa_cudnn": {"dense training": "slow"}})),
        json.dumps(sample(format=True)),
        json.dumps(sample(host_us={"sdpa_cudnn": {"dense training": 10**400}})),
        "[" * 100_000,
        json.dumps(sample(skipped="flex")),
        json.dumps(sample(host="a fast one")),
        json.dumps(sample(host={"cpu": 3})),
    ],
)
def test_a_corrupt_or_foreign_file_is_ignored_with_one_warning(user_file, content, caplog):
    user_file.write_text(content)
    with caplog.at_level(logging.WARNING, logger="attnselect"):
        for _ in range(3):
            found, _ = calibration.for_target(H200)
            assert found is None
    assert sum("ignoring the calibration" in r.getMessage() for r in caplog.records) == 1


def test_an_older_format_is_refused_with_how_to_make_a_new_one(user_file, caplog):
    """Format 1 keyed a packed curve's points by every sequence at the longest length: read by today's work they
    would predict packed calls several times too slow."""
    user_file.write_text(json.dumps(sample(format=1)))
    with caplog.at_level(logging.WARNING, logger="attnselect"):
        assert calibration.for_target(H200)[0] is None
    (message,) = [r.getMessage() for r in caplog.records if "ignoring the calibration" in r.getMessage()]
    assert "format 1, an older attnselect's" in message and "`attnselect calibrate` makes one of format 2" in message


def test_the_packaged_calibration_is_of_this_format():
    text = (resources.files("attnselect") / "data" / "calibration_sm90_nvidia-h200.json").read_text()
    assert calibration.parse(text, "packaged")["format"] == calibration.FORMAT


def test_random_bytes_are_ignored(user_file, caplog):
    user_file.write_bytes(bytes(range(256)) * 4)
    with caplog.at_level(logging.WARNING, logger="attnselect"):
        assert calibration.for_target(H200)[0] is None
    assert any("ignoring the calibration" in r.getMessage() for r in caplog.records)


def test_a_first_call_s_cost_is_read_at_the_call_s_layout_padding_and_phase():
    costs = {"flash_attn4": {"dense inference": 1600.0, "dense training": 5000.0}, "sdpa_cudnn": 400.0}
    assert calibration.first_call_ms(costs, "flash_attn4", "bshd", False, True) == 5000.0
    assert calibration.first_call_ms(costs, "flash_attn4", "sbhd", False, False) == 1600.0
    assert calibration.first_call_ms(costs, "flash_attn4", "thd", True, True) == 5000.0  # unmeasured: the dearest
    assert calibration.first_call_ms(costs, "sdpa_cudnn", "thd", False, True) == 400.0  # one figure for every key
    assert calibration.first_call_ms(costs, "sdpa_flash", "bshd", False, True) == 0.0


def test_the_keys_name_layout_dims_padding_and_phase():
    assert calibration.curve_key("bshd", 192, 128, True, True) == "dense 192/128+pad training"
    assert calibration.curve_key("thd", 64, 64, False, False) == "thd 64/64 inference"
    assert calibration.host_key("sbhd", False, False) == "dense inference"
    assert calibration.host_key("thd", True, True) == "thd+pad training"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
CONTENT = st.one_of(
    st.binary(max_size=64).map(lambda b: ("bytes", b)),
    JSON.map(lambda j: ("text", json.dumps(j))),
    st.fixed_dictionaries({"host_us": JSON, "gpu": JSON, "first_call_ms": JSON}).map(  # the format, any tables
        lambda tables: ("text", json.dumps(sample(**tables)))
    ),
    st.dictionaries(st.text(max_size=12), st.lists(st.lists(JSON, max_size=3), max_size=3), max_size=3).map(
        lambda curves: ("text", json.dumps(sample(gpu={"sdpa_cudnn": curves})))
    ),
    st.integers(1, 200).map(lambda n: ("text", json.dumps(sample())[:n])),
)


PROBLEM = AttentionProblem(1, 256, 256, 16, 16, 192, 128, mask="causal", training=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=CONTENT)
def test_any_content_of_the_calibration_file_never_breaks_a_choice(content, tmp_path_factory, monkeypatch, caplog):
    """Whatever the user's calibration file holds, select() and explain() choose (by prediction where it is a
    calibration, else as without the file) with at most one warning, and never raise. Decisions do not write the file
    (only `attnselect calibrate` does): it stays as it was, and what `attnselect calibrate` writes over it is read."""
    directory = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(directory))
    memos._WARNED.clear()
    attnselect.clear_cache()
    without = attnselect.select(PROBLEM, target=H200)  # no user file
    kind, data = content
    path = calibration.user_path(H200)
    path.write_bytes(data) if kind == "bytes" else path.write_text(data)
    written = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="attnselect"):
        caplog.clear()
        for _ in range(2):
            attnselect.clear_cache()
            decision = attnselect.select(PROBLEM, target=H200)
            assert decision.chosen in decision.ranked and "ranked:  by" in decision.report()
            if str(path) not in decision.calibration:  # the file was ignored, entirely
                assert (decision.ranked, decision.calibration) == (without.ranked, without.calibration)
    assert len([r for r in caplog.records if "ignoring the calibration" in r.getMessage()]) <= 1
    assert path.read_bytes() == written

    from attnselect import cli
    from attnselect.bench import calibrate

    with monkeypatch.context() as patched:  # `attnselect calibrate` on this H200, its measurement stubbed
        patched.setattr(Target, "current", lambda *a, **kw: H200)
        patched.setattr(calibrate, "run", lambda target, **kw: sample(target))
        assert cli.main(["calibrate"]) == 0
    memos._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="attnselect"):
        caplog.clear()
        assert attnselect.select(PROBLEM, target=H200).calibration == str(path)
    assert "ignoring the calibration" not in caplog.text


def test_the_packaged_h200_calibration_holds_on_the_machine_it_measured(tmp_path, monkeypatch):
    """attnselect/data/calibration_sm90_nvidia-h200.json (results/h200_calibration.json): a valid calibration, read
    for the H200, torch and cuDNN it ran on, with FA4 and the cuDNN frontend or without them; it covers the head-dim
    pairs the issue names, dense and packed, in both phases, for every backend it timed."""
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))  # no user calibration
    calibration._parsed.cache_clear()
    memos.clear_cache()
    packages = {"flash-attn-4": "4.0.0b36", "nvidia-cudnn-frontend": "1.32.0"}
    for installed in (packages, {}):
        h200 = Target.preset("h200", packages=installed, torch_version="2.11.0+cu130", cudnn_version="9.19.0")
        found, source = calibration.for_target(h200)
        assert found is not None and source == "attnselect/data/calibration_sm90_nvidia-h200.json"
    curves = found["gpu"]
    keys = [key for per_backend in curves.values() for key in per_backend]
    for d_qk, d_v in ((192, 128), (128, 128), (64, 64), (256, 256)):
        for phase in ("inference", "training"):
            for layout in ("dense", "thd"):
                assert any(key.startswith(f"{layout} {d_qk}/{d_v}") and key.endswith(phase) for key in keys)
    assert {"flash_attn4", "cudnn_frontend", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "varlen_fa2"} <= set(curves)
    problem = AttentionProblem(1, 4096, 4096, 16, 16, 192, 128, mask="causal", training=True, dtype=torch.bfloat16)
    decision = attnselect.select(problem, target=h200)
    assert (
        decision.predictions is not None and decision.calibration == "attnselect/data/calibration_sm90_nvidia-h200.json"
    )


def test_the_packaged_h100_calibration_ranks_a_repeated_small_inference_call_onto_fa4_after_its_first_calls(
    tmp_path, monkeypatch
):
    """attnselect/data/calibration_sm90_nvidia-h100-80gb-hbm3.json (results/h100_calibration_host_8ea1018.json):
    read for that GPU model at its versions, not for another H100's name; it times FA4's forward replayed, so a small
    dense inference call ranks FA4 first and rents around a shape's first calls (first_calls.replay_start_ms)."""
    from attnselect.choose import first_calls

    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))  # no user calibration
    calibration._parsed.cache_clear()
    memos.clear_cache()
    first_calls.forget()
    versions = dict(torch_version="2.11.0+cu130", cudnn_version="9.19.0")
    h100 = dataclasses.replace(Target.preset("h100", packages={"flash-attn-4": "4.0.0b36"}, **versions),
                               name="NVIDIA H100 80GB HBM3")  # fmt: skip
    found, source = calibration.for_target(h100)
    assert source == "attnselect/data/calibration_sm90_nvidia-h100-80gb-hbm3.json" and found["replayed_host_us"]
    assert calibration.for_target(Target.preset("h100", **versions))[0] is None  # "NVIDIA H100": another model
    small = AttentionProblem(1, 256, 256, 16, 16, 192, 128, mask="causal", dtype=torch.bfloat16)
    fa4 = Candidate("flash_attn4")
    try:
        first_calls.ran(fa4, small._with(seqlen_q=512, seqlen_kv=512))  # its configuration compiled
        decision = attnselect.select(small, target=h100)
        assert decision.ranked[0] == fa4 and decision.rental is not None and decision.rental.deferred == fa4
        assert decision.rental.replay_ms == decision.rental.compile_ms > 0  # the shape's first calls, nothing else
        first_calls.ran(fa4, small)
        memos.clear_cache()
        assert attnselect.select(small, target=h100).chosen == fa4
    finally:
        first_calls.forget()


def test_the_documented_format_names_every_field_of_the_packaged_calibration():
    """docs/api.md's description of the file names each field the packaged one holds, and the format's number."""
    root = pathlib.Path(__file__).resolve().parents[2]
    text = (root / "docs" / "api.md").read_text()
    described = next(block for block in text.split("\n- ") if block.startswith("The file (format "))
    packaged = calibration.packaged(H200)  # the packaged file of its GPU model, whatever the versions
    assert packaged is not None and f"(format {calibration.FORMAT};" in described
    for field in [*packaged, *packaged["fingerprint"], "new_packing_us", "replayed_host_us"]:
        assert f"`{field}`" in described, field


def test_explain_says_where_the_packaged_calibration_s_host_times_were_measured():
    """Hosts of one GPU model differ in host time (docs/limits.md): a ranking by the packaged calibration says its host
    times are another machine's, and how to measure this one's."""
    h200 = Target.preset("h200", torch_version="2.11.0+cu130", cudnn_version="9.19.0")  # the packaged file's
    problem = AttentionProblem(1, 4096, 4096, 16, 16, 192, 128, mask="causal", dtype=torch.bfloat16)
    report = attnselect.explain(problem, target=h200)
    assert "calibration attnselect/data/calibration_sm90_nvidia-h200.json" in report
    line = next(line for line in report.splitlines() if line.startswith("origin:  host times as"))
    assert "packaged calibration" in line and "the machine that made it" in line and "attnselect calibrate" in line
    assert attnselect.select(problem, target=h200).to_dict()["calibration_host"] == line.removeprefix("origin:  ")


def test_explain_names_the_cpu_a_packaged_calibration_recorded(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))  # no user calibration
    packaged = json.loads(calibration._packaged("calibration_sm90_nvidia-h200.json"))
    recorded = json.dumps({**packaged, "host": {"cpu": calibration.host_of()}})  # this machine's CPU, even so
    monkeypatch.setattr(calibration, "_packaged", lambda name: recorded)
    calibration._parsed.cache_clear()
    memos.clear_cache()
    h200 = Target.preset("h200", torch_version="2.11.0+cu130", cudnn_version="9.19.0")
    problem = AttentionProblem(1, 4096, 4096, 16, 16, 192, 128, mask="causal", dtype=torch.bfloat16)
    report = attnselect.explain(problem, target=h200)
    calibration._parsed.cache_clear()
    memos.clear_cache()
    assert f"origin:  host times as the packaged calibration measured them, on {calibration.host_of()};" in report


def test_explain_names_another_cpu_a_user_calibration_was_measured_on(user_file):
    problem = AttentionProblem(1, 4096, 4096, 16, 16, 192, 128, mask="causal", dtype=torch.bfloat16, training=True)
    for recorded, said in ((None, False), (calibration.host_of(), False), ("Another CPU 9000", True)):
        user_file.write_text(json.dumps(sample(**({"host": {"cpu": recorded}} if recorded else {}))))
        memos.clear_cache()
        report = attnselect.explain(problem, target=H200)
        assert f"calibration {user_file}" in report
        assert ("origin:  host times as measured on Another CPU 9000; this machine's CPU is" in report) is said
        assert ("origin:" in report) is said


def test_a_calibration_records_the_cpu_its_host_times_were_measured_on():
    from attnselect.bench import calibrate

    data = calibrate._result(H200, False, {}, {}, {}, {})
    assert data["host"] == {"cpu": calibration.host_of()} and calibration.host_of()


@pytest.mark.parametrize(
    "cpuinfo, expected",
    [
        ("processor\t: 0\nmodel name\t: AMD EPYC 9654\nprocessor\t: 1\nmodel name\t: AMD EPYC 9654\n", "AMD EPYC 9654"),
        ("processor\t: 0\nCPU implementer\t: 0x41\nCPU part\t: 0xd4f\n", "{machine} implementer 0x41 part 0xd4f"),
        (None, "{processor}"),
    ],
)
def test_the_cpu_is_named_by_its_model_or_its_arm_part(monkeypatch, cpuinfo, expected):
    import io
    import platform

    def fake_open(path, *args, **kwargs):
        assert path == "/proc/cpuinfo"
        if cpuinfo is None:
            raise FileNotFoundError(path)
        return io.StringIO(cpuinfo)

    monkeypatch.setattr(calibration, "open", fake_open, raising=False)
    named = calibration.host_of.__wrapped__()
    assert named == expected.format(machine=platform.machine(), processor=platform.processor() or platform.machine())
