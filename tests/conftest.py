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
def clean_state(monkeypatch):
    """Each test starts with no ATTNSELECT_* variable and an empty decision memo."""
    for name in list(os.environ):
        if name.startswith("ATTNSELECT_"):
            monkeypatch.delenv(name)
    attnselect.clear_cache()
    yield
    attnselect.clear_cache()
