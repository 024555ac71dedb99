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


@pytest.fixture(scope="session", autouse=True)
def build_dir(tmp_path_factory) -> str:
    """The whole session runs on the compiled check of repeated calls where this machine can build it (its build is
    waited for here, not raced by the tests; every test, and every process a test starts, loads it from this
    directory at once); tests/test_call_memo.py runs on each check."""
    from attnselect import call_memo, compiled_lookup

    directory = str(tmp_path_factory.mktemp("attnselect-build"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ATTNSELECT_BUILD_DIR", directory)
        patch.delenv("ATTNSELECT_COMPILE", raising=False)
        compiled_lookup.start(call_memo)
        compiled_lookup.ready(timeout=600)
    return directory


@pytest.fixture(autouse=True)
def clean_state(monkeypatch, tmp_path_factory, build_dir):
    """Each test starts with no ATTNSELECT_* variable but a decision cache of its own (empty) and the session's build,
    an empty decision memo, no recorded failures and no self-check passed."""
    for name in list(os.environ):
        if name.startswith("ATTNSELECT_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path_factory.mktemp("attnselect-cache")))
    monkeypatch.setenv("ATTNSELECT_BUILD_DIR", build_dir)
    from attnselect import failures, self_check

    attnselect.clear_cache()
    failures._FAILED.clear()
    self_check._PASSED.clear()
    monkeypatch.setattr(failures, "_RECORDED", None)  # the (empty) cache's recorded failures are read afresh
    yield
    attnselect.clear_cache()
    failures._FAILED.clear()
