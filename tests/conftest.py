import os

import pytest
import torch

import attnselect


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none present on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def clean_state(monkeypatch, tmp_path_factory, request):
    """Each test starts with no ATTNSELECT_* variable but a decision cache of its own (empty),
    an empty decision memo, no recorded failures and no self-check passed."""
    for name in list(os.environ):
        if name.startswith("ATTNSELECT_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path_factory.mktemp("attnselect-cache")))
    from attnselect import self_check
    from attnselect.choose import failures

    attnselect.clear_cache()
    failures._FAILED.clear()
    self_check._PASSED.clear()
    monkeypatch.setattr(failures, "_RECORDED", None)  # the (empty) cache's recorded failures are read afresh
    yield
    # A right kernel the self-check calls wrong would only warn and switch kernels: every test fails on it instead
    # (tests/test_self_check.py registers wrong kernels on purpose).
    wrong = [e for found in failures._FAILED.values() for e in found.values() if "WrongResultError" in e]
    attnselect.clear_cache()
    failures._FAILED.clear()
    if wrong and "wrong" not in request.node.name and "test_self_check.py" not in request.node.nodeid:
        pytest.fail(f"the self-check called a kernel wrong: {wrong[0]}")
