from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from attnselect import AttentionProblem, InvalidInputError
from helpers import pickled_equal_elsewhere

P = AttentionProblem(batch=2, seqlen_q=128, seqlen_kv=128, heads_q=16, heads_kv=4, head_dim_qk=192, head_dim_v=128)


def test_problem_is_immutable_and_hashable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        P.batch = 3
    assert {P: 1}[dataclasses.replace(P)] == 1


def test_padded_variant():
    assert P.pad_target == 192
    padded = P.padded(192)
    assert (padded.head_dim_qk, padded.head_dim_v) == (192, 192) and padded.heads_kv == 4
    odd = dataclasses.replace(P, head_dim_qk=100, head_dim_v=60)
    assert odd.pad_target == 104
    assert dataclasses.replace(P, head_dim_v=192).pad_target is None
    # Equal head dims that are not multiples of 8 pad too (the kernels that need multiples of 8 then serve them).
    assert dataclasses.replace(P, head_dim_qk=59, head_dim_v=59).pad_target == 64
    assert dataclasses.replace(P, head_dim_qk=15, head_dim_v=15).pad_target == 16
    assert dataclasses.replace(P, head_dim_qk=8, head_dim_v=8).pad_target is None
    with pytest.raises(InvalidInputError, match="head_dim: got 128"):
        P.padded(128)


def test_from_tensors_reads_the_call():
    q = torch.randn(3, 2, 10, 24, requires_grad=True)
    k = torch.randn(3, 1, 12, 24)
    v = torch.randn(3, 1, 12, 8)
    p = AttentionProblem.from_tensors(q, k, v, layout="bhsd", causal="bottom_right", dropout_p=0.1, return_lse=True)
    assert (p.batch, p.seqlen_q, p.seqlen_kv, p.heads_q, p.heads_kv, p.head_dim_qk, p.head_dim_v) == (
        3,
        10,
        12,
        2,
        1,
        24,
        8,
    )
    assert p.mask == "causal_bottom_right" and p.training and p.return_lse and p.dtype == torch.float32
    with torch.no_grad():
        assert not AttentionProblem.from_tensors(q, k, v, layout="bhsd").training


def test_a_packed_call_s_problem_holds_q_s_rows_and_keeps_them_at_every_packing():
    """q's rows (tokens) are fixed for a packed loop's calls of one shape; the problem at size 0, their shared key,
    has none, as it has no sizes."""
    q = torch.randn(700, 2, 16)
    cu = torch.tensor([0, 400, 700], dtype=torch.int32)
    p = AttentionProblem.from_tensors(q, q, q, layout="thd", cu_seqlens_q=cu, max_seqlen_q=400, max_seqlen_kv=400)
    assert (p.batch, p.seqlen_q, p.tokens) == (2, 400, 700)
    assert "2 seqs in 700 tokens, max sq=400" in p.describe()
    assert p._at_sizes(3, 300, 300).tokens == 700 and p.sizeless.tokens == 0
    assert p._at_sizes(3, 300, 300).sizeless is p.sizeless
    assert AttentionProblem.from_dict(p.to_dict()) == p and p.to_dict()["tokens"] == 700
    dense = AttentionProblem.from_tensors(torch.randn(1, 8, 2, 16), *[torch.randn(1, 8, 2, 16)] * 2)
    # where not known, left out: stored decisions and reports keyed by problems before the field still match
    assert dense.tokens == 0 and "tokens" not in dense.to_dict()
    assert AttentionProblem.from_dict(dense.to_dict()) == dense
    assert "tokens" not in p.sizeless.to_dict()


def test_window_from_arguments():
    q = torch.randn(1, 10, 2, 8)
    p = AttentionProblem.from_tensors(q, q, q, window=(3, -1), causal=True)
    assert p.mask == "sliding_window" and p.window == (3, 0)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("heads_q", 6, "heads_q: got 6 with heads_kv=4"),
        ("layout", "bhs", "layout: got 'bhs'"),
        ("mask", "causal_top", "mask: got 'causal_top'"),
        ("dropout_p", 1.5, "dropout_p: got 1.5"),
        ("window", (1, 2), "window: got (1, 2), expected None unless"),
        ("dtype", torch.int8, "dtype: got torch.int8"),
        ("head_dim_v", 0, "head_dim_v: got 0"),
        ("varlen_gaps", "yes", "varlen_gaps: got 'yes', expected True or False"),
        ("tokens", -1, "tokens: got -1, expected an integer >= 0"),
        ("tokens", 4096, "tokens: got 4096, expected 0 unless layout is 'thd'"),
        ("seqlen_q", 10**160, "expected at most 2**31 - 1 (the kernels index in int32)"),
        ("batch", 2**31, "batch: got 2147483648, expected at most 2**31 - 1"),
        ("head_dim_qk", 2**31, "head_dim_qk: got 2147483648, expected at most 2**31 - 1"),
    ],
)
def test_bad_fields(field, value, message):
    with pytest.raises(InvalidInputError) as err:
        dataclasses.replace(P, **{field: value})
    assert message in str(err.value)


def test_sizes_past_int32_are_refused_at_other_sizes_too():
    """A packed problem made at new sizes (a loop's new packing, checked alone) and a window are bounded alike."""
    packed = dataclasses.replace(P, layout="thd")
    with pytest.raises(InvalidInputError, match=r"^seqlen_q: got 2147483648, expected at most 2\*\*31 - 1"):
        packed._with(seqlen_q=2**31)
    with pytest.raises(InvalidInputError, match=r"^window: got \(1099511627776, 0\), expected .* to 2\*\*31 - 1"):
        dataclasses.replace(P, mask="sliding_window", window=(2**40, 0))


def test_a_window_of_bools_is_refused():
    with pytest.raises(InvalidInputError, match=r"window: got \(True, False\)"):
        dataclasses.replace(P, mask="sliding_window", window=(True, False))


@pytest.mark.parametrize(
    "d,message",
    [
        ([1, 2], "problem: got list, expected a dict"),
        ({**P.to_dict(), "dtype": []}, "dtype: got [], expected one of"),
        ({**P.to_dict(), "speed": 3}, "problem: got unknown field(s) ['speed']"),
        ({**P.to_dict(), "dtype": "int8"}, "dtype: got 'int8', expected one of"),
        ({"batch": 1}, "problem: got no ['head_dim_qk'"),
        ({**P.to_dict(), "window": "wide"}, "window: got 'wide'"),
    ],
)
def test_from_dict_refuses_junk_by_name(d, message):
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        AttentionProblem.from_dict(d)
    assert AttentionProblem.from_dict(P.to_dict()) == P


def test_describe_and_dict():
    assert "d_qk=192 d_v=128" in P.describe() and "Hq=16 Hkv=4" in P.describe()
    assert P.to_dict()["dtype"] == "bfloat16"


def test_a_top_left_window_where_the_anchors_coincide_is_the_bottom_right_one():
    """Sq == Skv (thd: every sequence): one mask, one name, so the kernels that take a window serve it."""
    square = AttentionProblem(1, 64, 64, 4, 4, 64, 64, mask="sliding_window_top_left", window=(8, 0))
    assert square.mask == "sliding_window"
    cross = AttentionProblem(1, 64, 128, 4, 4, 64, 64, mask="sliding_window_top_left", window=(8, 0))
    assert cross.mask == "sliding_window_top_left"
    packed = dict(layout="thd", mask="sliding_window_top_left", window=(8, 0))
    assert AttentionProblem(2, 64, 64, 4, 4, 64, 64, **packed).mask == "sliding_window"  # lengths match
    assert AttentionProblem(2, 64, 64, 4, 4, 64, 64, varlen_seqlens_match=False, **packed).mask == packed["mask"]


def test_a_problem_at_size_zero_is_made_once_and_kept_by_size_only_copies():
    p = AttentionProblem(4, 400, 400, 16, 16, 128, 128, layout="thd", mask="causal", tokens=1600)
    assert p.sizeless == p._with(batch=0, seqlen_q=0, seqlen_kv=0, tokens=0)
    resized = p._with(batch=7, seqlen_q=90, seqlen_kv=90)
    assert resized.sizeless is p.sizeless  # a packed loop's new packing does not make it again
    assert resized == AttentionProblem(7, 90, 90, 16, 16, 128, 128, layout="thd", mask="causal", tokens=1600)
    other_dims = p._with(head_dim_v=64)
    assert other_dims.sizeless == other_dims._with(batch=0, seqlen_q=0, seqlen_kv=0, tokens=0) != p.sizeless


def test_a_packed_problem_padded_shares_one_padded_problem_at_size_zero():
    """A packed loop pads each packing's problem for its padded candidates: the padded problem's size-zero copy is
    made once per head dim and equals the one made afresh, whatever was worked out before."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        p = AttentionProblem(
            rng.choice([1, 5]), 300, 300, 16, rng.choice([16, 4]), rng.choice([64, 192]), rng.choice([64, 128]),
            layout=rng.choice(["thd", "bshd"]), mask=rng.choice(["none", "causal"]), training=rng.random() < 0.5,
        )  # fmt: skip
        if rng.random() < 0.7:
            p.sizeless  # noqa: B018 # made, as select_packed makes it
        if rng.random() < 0.5:
            p = p._with(batch=rng.choice([1, 7]), seqlen_q=77, seqlen_kv=77)
        head_dim = max(p.head_dim_qk, p.head_dim_v) + rng.choice([0, 8])
        padded = p.padded(head_dim)
        assert padded == dataclasses.replace(p, head_dim_qk=head_dim, head_dim_v=head_dim)
        assert padded.sizeless == padded._with(batch=0, seqlen_q=0, seqlen_kv=0)
        assert padded.sizeless.signature == dataclasses.replace(padded, batch=0, seqlen_q=0, seqlen_kv=0).signature
        assert padded.signature == dataclasses.replace(padded).signature
        if p.layout == "thd" and "sizeless" in p.__dict__:
            assert p._with(batch=3, seqlen_q=5, seqlen_kv=5).padded(head_dim).sizeless is padded.sizeless


def test_a_packed_size_only_copy_has_the_signature_of_the_same_problem_made_afresh():
    import random

    rng = random.Random(0)
    for _ in range(200):
        p = AttentionProblem(
            rng.choice([1, 5]), 300, 300, 16, rng.choice([16, 4, 1]), rng.choice([64, 192]), rng.choice([64, 128]),
            layout="thd", mask=rng.choice(["none", "causal"]), training=rng.random() < 0.5,
            varlen_rows_without_keys=rng.random() < 0.3, varlen_gaps=rng.random() < 0.3, return_lse=rng.random() < 0.5,
        )  # fmt: skip
        p.sizeless.signature  # noqa: B018 # made once, as select_packed makes it
        sizes = dict(batch=rng.choice([1, 7, 40]), seqlen_q=rng.choice([1, 77, 9000]), seqlen_kv=rng.choice([1, 900]))
        assert p._with(**sizes).signature == dataclasses.replace(p, **sizes).signature
        at = p._at_sizes(*sizes.values())  # attention()'s copy of a new packing's problem: the same, unchecked
        assert at == p._with(**sizes) and at.signature == dataclasses.replace(p, **sizes).signature
        assert at.sizeless is p.sizeless


def test_a_problem_hashes_as_its_fields_whatever_copy_or_pickle_made_it():
    import pickle
    import random

    rng = random.Random(1)
    for _ in range(100):
        p = AttentionProblem(
            rng.choice([1, 5]), 300, 300, 16, rng.choice([16, 4]), rng.choice([64, 192]), rng.choice([64, 128]),
            layout=rng.choice(["thd", "bshd"]), mask=rng.choice(["none", "causal"]), training=rng.random() < 0.5,
        )  # fmt: skip
        hash(p), hash(p.sizeless)  # worked out once, then kept
        sizes = dict(batch=rng.choice([2, 7]), seqlen_q=rng.choice([1, 77]), seqlen_kv=rng.choice([1, 900]))
        for copy in (p._with(**sizes), p.padded(256), pickle.loads(pickle.dumps(p))):
            fresh = dataclasses.replace(copy)
            assert hash(copy) == hash(fresh) and {fresh: 1}.get(copy) == 1
        if p.layout == "thd":
            assert hash(p._at_sizes(*sizes.values())) == hash(dataclasses.replace(p, **sizes))


def test_a_pickled_problem_finds_its_equal_in_a_process_with_other_string_hashes(tmp_path):
    p = AttentionProblem(2, 64, 64, 4, 4, 192, 128, layout="thd", mask="causal")
    hash(p)
    fresh = "attnselect.AttentionProblem(2, 64, 64, 4, 4, 192, 128, layout='thd', mask='causal')"
    pickled_equal_elsewhere(p, fresh, tmp_path)
