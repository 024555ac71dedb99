from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from attnselect import InvalidInputError, Target
from attnselect.spec import target as target_module
from helpers import pickled_equal_elsewhere


@pytest.mark.parametrize(
    "name,cc",
    [
        ("a100", (8, 0)),
        ("h100", (9, 0)),
        ("h200", (9, 0)),
        ("b200", (10, 0)),
        ("b300", (10, 3)),
        ("rtx-pro-6000", (12, 0)),
        ("cpu", None),
    ],
)
def test_presets(name, cc):
    t = Target.preset(name)
    assert t.capability == cc and (t.is_cuda == (cc is not None))


def test_version_override_and_comparison():
    t = Target.preset("b200", cudnn_version="9.10.0")
    assert t.cudnn_version == "9.10.0" and Target.preset("b200").cudnn_version == target_module.DEFAULT_CUDNN
    assert t.at_least("cudnn_version", "9.9") and not t.at_least("cudnn_version", "9.11")
    assert not t.at_least("flash-attn", "2.0")
    assert Target.preset("b200", packages={"flash-attn": "2.8.3"}).at_least("flash-attn", "2.3")
    with pytest.raises(InvalidInputError, match="unknown field"):
        t.with_versions(cuda="13")
    with pytest.raises(InvalidInputError, match="target: got 'v100'"):
        Target.preset("v100")


def test_current_reads_this_machine():
    t = Target.current()
    assert t.device_type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert t.torch_version == torch.__version__ and Target.current("cpu").device_type == "cpu"


def test_current_never_crashes_when_cuda_is_broken(monkeypatch, caplog):
    def broken():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    target_module.target_for_device.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="attnselect"):
            assert Target.current().device_type == "cpu"
            assert Target.current("cuda:0").device_type == "cpu"
        assert "unusable" in caplog.text
    finally:
        target_module.target_for_device.cache_clear()


def test_describe_and_dict():
    t = Target.preset("h200")
    assert t.arch == "sm90" and "cuDNN 9.19.0" in t.describe() and t.to_dict()["capability"] == [9, 0]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(name="x"), "capability: got None, expected a (major, minor) pair"),
        (dict(name="x", device_type="cpu", capability=(9, 0)), "capability: got (9, 0), expected None"),
        (dict(name="x", device_type="tpu"), "device_type: got 'tpu'"),
        (dict(name=3, capability=(9, 0)), "name: got 3, expected a non-empty string"),
        (dict(name="x", capability=(True, False)), "capability: got (True, False), expected a (major, minor)"),
        (dict(name="x", capability=(-9, 0)), "capability: got (-9, 0), expected a (major, minor)"),
    ],
)
def test_inconsistent_targets_are_refused(kwargs, message):
    with pytest.raises(InvalidInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Target(**kwargs)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: Target.preset("h200", packages={"flash-atn-4": "4.0.0b36"}), r"^packages: got \['flash-atn-4'\]"),
        (lambda: Target.from_dict({"name": "x", "foo": 1}), r"^target: got fields \['foo', 'name'\], expected"),
        (lambda: Target.from_dict({}), r"^target: got fields \[\], expected 'name'"),
        (lambda: Target.from_dict("abc"), r"^target: got str, expected a dict"),
        (lambda: Target.preset("h200").at_least("cuda_version", "12.0"), r"^name: got 'cuda_version', expected one"),
        (lambda: Target.preset("h200").at_least("torch_version", 3), r"^version: got 3, expected a version string"),
        (lambda: Target.from_dict({"name": "x", 1: 2}), r"^target: got fields \['1', 'name'\], expected"),
        (lambda: Target.from_dict({"name": "x", "packages": "abc"}), r"^packages: got 'abc', expected a dict"),
        (lambda: Target.from_dict({"name": "x", "packages": [1, 2]}), r"^packages: got \[1, 2\], expected a dict"),
        (lambda: Target.from_dict({"name": "x", "capability": 9}), r"^capability: got 9, expected a \(major, minor\)"),
    ],
)
def test_a_target_s_junk_is_refused_by_name(make, message):
    """A misspelt package would simulate its absence; an unknown field or version name is named, not a TypeError."""
    with pytest.raises(InvalidInputError, match=message):
        make()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine without CUDA")
def test_a_cuda_device_asked_for_without_cuda_is_the_cpu_target_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="attnselect"):
        assert Target.current("cuda:7").device_type == "cpu"
    assert "Target.current('cuda:7'): CUDA is not usable here" in caplog.text


def test_bad_device_names_the_argument():
    with pytest.raises(InvalidInputError, match="device: got 'bogus'"):
        Target.current("bogus")


def test_cudnn_version_numbers():
    assert target_module.cudnn_version_string(91900) == "9.19.0"
    assert target_module.cudnn_version_string(8902) == "8.9.2"


def test_flash_attn_4_alone_does_not_look_like_flash_attn_2(tmp_path, monkeypatch):
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    packages = target_module._installed_packages()["packages"]
    assert "flash-attn" not in packages and "flash-attn-4" not in packages


_HIDDEN_OR_BROKEN = """
import sys, torch
if sys.argv[1] == "broken":   # a driver that fails on every query
    def fail(*args, **kwargs):
        raise RuntimeError("CUDA driver initialization failed")
    for name in ("is_available", "device_count", "get_device_capability", "get_device_name", "current_device"):
        setattr(torch.cuda, name, fail)
import attnselect
from attnselect import AttentionProblem, Target
assert Target.current().device_type == "cpu"
for name in ("a100", "h200", "b200", "cpu"):
    Target.preset(name)
mla = AttentionProblem(2, 1024, 1024, 16, 16, 192, 128, mask="causal", training=True)
print(attnselect.select(mla, target=Target.preset("h200")).chosen)
print(attnselect.explain(mla).splitlines()[-2])
q, k, v = torch.randn(1, 6, 2, 24), torch.randn(1, 6, 2, 24), torch.randn(1, 6, 2, 16)
print(tuple(attnselect.attention(q, k, v, causal=True).shape))
"""


@pytest.mark.parametrize("mode", ["hidden", "broken"])
def test_import_targets_and_selection_work_without_cuda(mode, tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", ATTNSELECT_CACHE_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", _HIDDEN_OR_BROKEN, mode], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["sdpa_cudnn native", "chosen:  sdpa_flash padded to 192", "(1, 6, 2, 16)"]


def test_a_target_hashes_as_its_fields_whatever_copy_or_pickle_made_it(tmp_path):
    """Its hash is worked out once and kept, and left out of a pickle: one loaded in a process of other string
    hashes finds its equal there."""
    import dataclasses
    import pickle

    h200 = Target.preset("h200", packages={"flash-attn-4": "4.0.0b36"})
    hash(h200)
    other = dataclasses.replace(h200, cudnn_version="9.10.0")
    assert hash(other) != hash(h200) and {h200: 1}.get(other) is None
    assert {dataclasses.replace(h200): 1}.get(pickle.loads(pickle.dumps(h200))) == 1
    pickled_equal_elsewhere(h200, "attnselect.Target.preset('h200', packages={'flash-attn-4': '4.0.0b36'})", tmp_path)
