"""Backend and the registry (attnselect.backends.base): a package backend is its module and one registration."""

from __future__ import annotations

import torch

import attnselect
from attnselect.spec.target import Target


def test_a_package_backend_is_its_module_and_one_registration():
    """A backend that needs a pip package declares it (Backend.package); registering it is all it takes for the
    target to know the package's version and for its verdicts to say when it is missing."""
    from attnselect.backends.reference import Reference
    from attnselect.spec.target import Package

    class Packaged(Reference):
        name = "packaged_reference"
        package = Package("attnselect-test-distribution", "json")  # imports, with no metadata: "unknown"

    class Missing(Reference):
        name = "missing_reference"
        package = Package("attnselect-missing-distribution", "attnselect_no_such_module")

    problem = attnselect.AttentionProblem(1, 8, 8, 1, 1, 16, 16, torch.float32)
    try:
        attnselect.backends.register(Packaged())
        attnselect.backends.register(Missing())
        target = Target.current("cpu")
        assert target.version("attnselect-test-distribution") == "unknown"
        assert "attnselect-test-distribution unknown" in target.describe()
        assert Packaged().not_supported_reasons(problem, target) == []
        assert Missing().not_supported_reasons(problem, target) == [
            "package attnselect-missing-distribution is not installed"
        ]
    finally:
        attnselect.backends.unregister("packaged_reference")
        attnselect.backends.unregister("missing_reference")
    assert Target.current("cpu").version("attnselect-test-distribution") is None
