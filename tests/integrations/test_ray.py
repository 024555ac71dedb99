"""attnselect.integrations.ray: the driver's settings reach Ray workers through runtime_env, on a real local cluster."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray", reason="the test extra installs Ray; the GPU machine has none")

from attnselect.integrations.ray import runtime_env  # noqa: E402  (after the skip: Ray is optional)


def test_runtime_env_merges_without_dropping_keys(monkeypatch):
    monkeypatch.delenv("ATTNSELECT_CACHE_DIR")  # the test fixture's own cache folder: not part of this test
    monkeypatch.setenv("ATTNSELECT_PAD", "never")
    monkeypatch.setenv("ATTNSELECT_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("UNRELATED", "x")
    base = {"pip": ["einops"], "env_vars": {"ATTNSELECT_PAD": "always", "OTHER": "1"}}
    merged = runtime_env(base)
    assert merged["pip"] == ["einops"]
    assert merged["env_vars"] == {"ATTNSELECT_PAD": "always", "OTHER": "1", "ATTNSELECT_DEBUG": "1", "NVTE_DEBUG": "1"}
    assert base["env_vars"] == {"ATTNSELECT_PAD": "always", "OTHER": "1"}  # not modified
    assert runtime_env()["env_vars"]["ATTNSELECT_PAD"] == "never"


@pytest.mark.parametrize("env_vars", [["A=1"], {"A": 1}, {1: "a"}, "A=1"])
def test_malformed_env_vars_are_refused_by_name(env_vars):
    from attnselect.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"base\['env_vars'\]: got .*, expected a dict of str to str"):
        runtime_env({"env_vars": env_vars})


@pytest.fixture(scope="module")
def cluster():
    saved = os.environ.pop("RAY_ADDRESS", None)
    clean = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("ATTNSELECT_")}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
    os.environ.update(clean)
    if saved is not None:
        os.environ["RAY_ADDRESS"] = saved


@ray.remote
def _select_in_worker():
    import io
    import logging

    import torch

    import attnselect

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("attnselect").addHandler(handler)
    try:
        problem = attnselect.AttentionProblem(1, 16, 16, 2, 2, 24, 16, torch.float32)
        decision = attnselect.select(problem, target=attnselect.Target.preset("cpu"))
    finally:
        logging.getLogger("attnselect").removeHandler(handler)
    variables = {name: value for name, value in os.environ.items() if name.startswith("ATTNSELECT_")}
    return variables, str(decision.chosen), stream.getvalue()


def test_worker_sees_the_driver_settings_only_through_runtime_env(cluster, monkeypatch):
    # Exported after ray.init: the raylet (and so a plain worker) never saw these.
    monkeypatch.setenv("ATTNSELECT_PAD", "never")
    monkeypatch.setenv("ATTNSELECT_DEBUG", "1")
    monkeypatch.setenv("ATTNSELECT_DEBUG_LEVEL", "2")
    plain_vars, plain_choice, plain_log = ray.get(_select_in_worker.remote())
    assert plain_vars == {} and plain_choice == "sdpa_flash padded to 24" and plain_log == ""
    variables, choice, log = ray.get(_select_in_worker.options(runtime_env=runtime_env()).remote())
    assert variables == {
        "ATTNSELECT_PAD": "never",
        "ATTNSELECT_DEBUG": "1",
        "ATTNSELECT_DEBUG_LEVEL": "2",
        "ATTNSELECT_CACHE_DIR": os.environ["ATTNSELECT_CACHE_DIR"],
    }  # the test's own cache
    assert choice == "sdpa_math native"
    assert "running sdpa_math, native, because" in log  # level 1: the decision
    assert "sdpa_flash padded to 24: not supported: padding is switched off" in log  # level 2: every candidate
