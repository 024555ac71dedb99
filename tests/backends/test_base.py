"""Backend and the registry (attnselect.backends.base): a package backend is its module and one registration."""

from __future__ import annotations

import torch

import attnselect
from attnselect import backends
from attnselect.spec.problem import AttentionProblem
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


def test_extra_reasons_that_say_they_read_no_size_read_none():
    """A backend whose ``extra_reasons_read_sizes`` is False (a packed loop's new packing does not judge it again) gives
    the same extra reasons at every size; one that overrides extra_reasons without saying reads sizes."""
    import random

    from attnselect.backends.base import Backend

    class Silent(Backend):
        def extra_reasons(self, p, t):
            return []

    class SizeRule:  # a mixin's rule, below the class that says
        def extra_reasons(self, p, t):
            return ["too long"] if p.seqlen_q > 1000 else []

    class Mixed(SizeRule, Backend):
        pass

    class Whole(Backend):  # its own reasons, whatever extra_reasons says
        def not_supported_reasons(self, p, t):
            return ["too long"] if p.seqlen_q > 1000 else []

    class Said(Silent):
        extra_reasons_read_sizes = False

    class Inherits(Said):
        pass

    assert Silent.extra_reasons_read_sizes and Mixed.extra_reasons_read_sizes and Whole.extra_reasons_read_sizes
    assert not (Backend.extra_reasons_read_sizes or Said.extra_reasons_read_sizes or Inherits.extra_reasons_read_sizes)
    rng = random.Random(0)
    targets = [Target.preset(name) for name in ("h200", "a100", "b200", "cpu")]
    free = [b for b in backends.all_backends() if not b.extra_reasons_read_sizes]
    assert {b.name for b in free} >= {"varlen_fa2", "sdpa_efficient", "flash_attn4"}
    for _ in range(200):
        options = dict(
            layout=rng.choice(["thd", "bshd"]), mask=rng.choice(["none", "causal", "causal_bottom_right"]),
            training=rng.random() < 0.5, dtype=rng.choice([torch.bfloat16, torch.float32]),
            dropout_p=rng.choice([0.0, 0.1]),
        )  # fmt: skip
        heads = (16, rng.choice([16, 4, 1]), rng.choice([8, 59, 64, 128, 192, 256]), rng.choice([8, 64, 128, 512]))
        problems = [AttentionProblem(rng.choice([1, 3, 40]), rng.choice([1, 77, 4096]), rng.choice([1, 77, 9000]),
                                     *heads, **options) for _ in range(4)]  # fmt: skip
        for backend in free:
            for target in (t for t in targets if t.device_type in backend.surfaces):  # as not_supported_reasons asks
                reasons = {tuple(backend.extra_reasons(p, target)) for p in problems}
                assert len(reasons) == 1, (backend.name, target.name, reasons)


def test_packed_surface_reasons_read_no_size():
    """Surface.reasons works a packed problem's reasons out once at size 0: for every registered surface they are
    those of the problem at its own sizes."""
    import random

    rng = random.Random(0)
    targets = [Target.preset(name) for name in ("h200", "a100", "b200", "cpu")]
    for _ in range(200):
        problem = AttentionProblem(
            rng.choice([1, 3, 40]), rng.choice([1, 77, 4096]), rng.choice([1, 77, 9000]), 16, rng.choice([16, 4, 1]),
            rng.choice([64, 128, 192, 256]), rng.choice([64, 128]), layout="thd",
            mask=rng.choice(["none", "causal", "causal_bottom_right"]), training=rng.random() < 0.5,
            varlen_seqlens_match=rng.random() < 0.5, varlen_gaps=rng.random() < 0.3,
            dtype=rng.choice([torch.bfloat16, torch.float32]),
        )  # fmt: skip
        for backend in backends.all_backends():
            for target in targets:
                surface = backend.surfaces.get(target.device_type)
                if surface is not None:
                    assert surface.reasons(problem, target) == surface._reasons(problem, target)
