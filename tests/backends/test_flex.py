"""The flex backend (attnselect.backends.flex): document masks, packed calls, the recompile limit, refusals."""

from __future__ import annotations

import pytest
import torch

import attnselect
from attnselect.spec.target import Target
from helpers import rel_err


def test_flex_document_masks_are_reused_per_cu_seqlens_and_dropped_with_it():
    import gc

    from attnselect.backends import flex
    from helpers import thd_inputs

    (q, k, v), cu, _ = thd_inputs([3, 0, 5])
    q, k, v = (t.detach() for t in (q, k, v))
    first = attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, backend="flex")
    causal = ("causal", None, 8, 8)
    masks = flex._DOCUMENT_MASKS.remembered
    cached = masks(cu)[causal]
    again = attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, backend="flex")
    assert masks(cu)[causal] is cached and torch.equal(first, again)
    other = attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, backend="flex")  # second mask, same owner
    assert masks(cu)[causal] is cached and len(masks(cu)) == 2
    assert not torch.equal(first, other)
    cu.add_(0)  # changed in place: a new version misses
    attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, backend="flex")
    assert masks(cu)[causal] is not cached
    key = id(cu)
    del cu
    gc.collect()
    assert key not in flex._DOCUMENT_MASKS._entries


def test_flex_packed_under_inference_mode_and_with_empty_packs():
    from helpers import thd_inputs

    (q, k, v), cu, _ = thd_inputs([3, 2])
    with torch.inference_mode():
        qi, ki, vi, cui = (t.detach().clone() for t in (q, k, v, cu))
        out, lse = attnselect.attention(
            qi, ki, vi, layout="thd", cu_seqlens_q=cui, causal=True, backend="flex", return_lse=True
        )
        ref, ref_lse = attnselect.attention(
            qi, ki, vi, layout="thd", cu_seqlens_q=cui, causal=True, backend="reference", return_lse=True
        )
    assert rel_err(out, ref) < 1e-12 and rel_err(lse, ref_lse) < 1e-6
    cu_kv = torch.zeros(3, dtype=torch.int32)
    no_keys = attnselect.attention(
        q.detach(),
        k.detach()[:0],
        v.detach()[:0],
        layout="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu_kv,
        backend="flex",
        return_lse=True,
    )
    assert torch.all(no_keys[0] == 0) and no_keys[1].shape == (4, 5) and torch.isneginf(no_keys[1]).all()


def test_compiled_flex_raises_past_its_recompile_limit_instead_of_running_eagerly(monkeypatch):
    from attnselect.backends import flex

    limit = torch._dynamo.config.recompile_limit
    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 2)
    double = flex._failing_past_recompile_limit(torch.compile(lambda x: x * 2, backend="eager", dynamic=False))
    assert torch.equal(double(torch.ones(1)), torch.full((1,), 2.0)) and double(torch.ones(2)).shape == (2,)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        double(torch.ones(3))  # a third shape: eagerly, flex would materialise every score
    assert torch._dynamo.config.recompile_limit == limit  # the user's setting is left as it was


def test_compiled_flex_keeps_a_float_that_changes_a_constant():
    """A softcap or scale seen with a second value is compiled again as a constant, not traced as a symbolic float
    (torch's default), which breaks flex's training graph (attnselect.backends.flex._recompile_settings)."""
    from attnselect.backends import flex

    graphs = []

    def backend(gm, example_inputs):
        graphs.append([n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward

    capped = lambda x, softcap: softcap * torch.tanh(x / softcap)  # noqa: E731
    compiled = flex._failing_past_recompile_limit(torch.compile(capped, backend=backend, dynamic=None))
    x = torch.randn(4)
    for softcap in (15.0, 50.0, 30.0):
        assert torch.allclose(compiled(x, softcap), capped(x, softcap))
    assert len(graphs) == 3, "one graph per softcap"
    assert all(isinstance(value, torch.Tensor) and value.shape == (4,) for g in graphs for value in g), graphs


@pytest.mark.gpu
def test_packed_flex_training_with_a_second_softcap_matches_float64():
    """FA3's packed softcap-15 training case, then FA2's softcap-50 one, in one process (the peer sweep on the H200
    raised on the second: results/h200_peer_sweep_replay_shard1of6.jsonl)."""
    from helpers import thd_inputs

    for lengths, d, dtype, softcap, causal in (
        ([200, 56], 64, torch.bfloat16, 15.0, True),
        ([512, 509, 510, 508], 128, torch.float16, 50.0, False),
    ):
        (q, k, v), cu, _ = thd_inputs(lengths, hq=4, hkv=4, dqk=d, dv=d, dtype=dtype, device="cuda")
        exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
        grad_out = torch.randn(q.shape[0], 4, d, device="cuda", dtype=torch.float64)
        runs = []
        for tensors, backend in (((q, k, v), "flex"), (exact, "reference")):
            out, _ = attnselect.attention(
                *tensors, layout="thd", cu_seqlens_q=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths),
                softcap=softcap, causal=causal, return_lse=True, backend=backend,
            )  # fmt: skip
            runs.append((out, torch.autograd.grad(out, tensors, grad_out.to(out.dtype))))
        (out, grads), (ref, ref_grads) = runs
        assert rel_err(out, ref) < 2e-2, softcap
        for g, rg in zip(grads, ref_grads):
            assert torch.isfinite(g).all() and rel_err(g, rg) < 2e-2, softcap


def test_flex_recompile_limit_uses_the_setting_names_of_the_installed_torch(monkeypatch):
    import types

    from attnselect.backends import flex

    old_torch = types.SimpleNamespace(cache_size_limit=8, fail_on_cache_limit_hit=False)  # before torch 2.7
    monkeypatch.setattr(torch._dynamo, "config", old_torch)
    assert flex._recompile_settings() == {"cache_size_limit": flex.RECOMPILE_LIMIT, "fail_on_cache_limit_hit": True}
    monkeypatch.setattr(torch._dynamo, "config", types.SimpleNamespace())  # neither: torch's own behaviour
    compiled = object()
    assert flex._recompile_settings() is None and flex._failing_past_recompile_limit(compiled) is compiled


def test_flex_refuses_grouped_heads_with_few_queries_on_cuda():
    """Every flex row of the H200 correctness grid with grouped K/V heads and under 128 queries failed to compile."""
    from attnselect.backends import get
    from attnselect.spec.problem import AttentionProblem

    flex, h200 = get("flex"), Target.preset("h200")
    few = AttentionProblem(1, 77, 77, 4, 1, 64, 64)
    assert flex.extra_reasons(few, h200) == [
        "no inductor template for grouped K/V heads with fewer than 128 queries (got 77; "
        "results/h200_correctness_grid.md)"
    ]
    assert flex.extra_reasons(AttentionProblem(1, 128, 128, 4, 1, 64, 64), h200) == []
    assert flex.extra_reasons(AttentionProblem(1, 77, 77, 4, 4, 64, 64), h200) == []
    assert flex.extra_reasons(few, Target.preset("cpu")) == []
