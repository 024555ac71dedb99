"""The TransformerEngine emulation used by `attnselect bench` follows TE's rules and PR #3339's pad decision."""

from __future__ import annotations

import json

import pytest
import torch

from attnselect import AttentionProblem, Candidate, Target
from attnselect.bench.te import te_choice
from attnselect.choose.candidates import judge

MLA = AttentionProblem(
    batch=2,
    seqlen_q=1024,
    seqlen_kv=1024,
    heads_q=16,
    heads_kv=16,
    head_dim_qk=192,
    head_dim_v=128,
    mask="causal",
    training=True,
)


@pytest.mark.parametrize(
    "preset,expected",
    [
        ("h200", Candidate("sdpa_cudnn")),  # fused serves natively; flash dropped on sm90+
        ("b200", Candidate("sdpa_cudnn")),  # fused 192/128 training with cuDNN >= 9.11
        ("a100", Candidate("sdpa_flash", 192)),  # native falls to unfused, padded gets FlashAttention: pad
    ],
)
def test_te_emulation_on_mla_training(preset, expected):
    target = Target.preset(preset)
    supported = {v.candidate for v in judge(MLA, target) if v.supported}
    assert te_choice(MLA, target, supported) == expected


def test_te_emulation_pads_for_fa2_and_falls_back_to_unfused():
    a100 = Target.preset("a100")
    equal = AttentionProblem(2, 1024, 1024, 16, 16, 128, 128, torch.bfloat16, mask="causal")
    supported = {v.candidate for v in judge(equal, a100) if v.supported}
    assert te_choice(equal, a100, supported) == Candidate("sdpa_flash")  # Flash > Fused below sm90
    absorbed = AttentionProblem(1, 1024, 1024, 16, 1, 576, 512, torch.bfloat16)
    supported = {v.candidate for v in judge(absorbed, Target.preset("h200")) if v.supported}
    assert te_choice(absorbed, Target.preset("h200"), supported) == Candidate("sdpa_math")  # unfused


def test_stored_rule_choices_are_re_derived_on_the_stored_timings(tmp_path):
    from attnselect.bench import runner as bench

    report = bench.run(str(tmp_path / "b"), smoke=True)
    entry = report["results"][0]
    current = entry["policies"]["rules"]["candidate"]
    other = next(name for name in entry["candidates"] if name != current)
    entry["policies"]["rules"] = {"candidate": other, **entry["candidates"][other]}  # as chosen by older rules
    assert bench.rechoose(report, Target.current()) == 1
    assert entry["policies"]["rules"]["candidate"] == current
    assert entry["policies"]["rules"]["was"] == other
    assert entry["policies"]["rules"]["median_ms"] == entry["candidates"][current]["median_ms"]
    assert f"rules: was {other}" in bench.report_markdown(report)
    assert bench.rechoose(report, Target.current()) == 0
    third = next(name for name in entry["candidates"] if name not in (current, other))
    entry["policies"]["rules"] = {"candidate": third, "was": other}  # rules changed twice since the run
    bench.rechoose(report, Target.current())
    assert entry["policies"]["rules"]["was"] == other  # the timed choice is kept
    entry["policies"]["rules"] = {"candidate": third, "was": current}  # back to what was timed: no mark
    bench.rechoose(report, Target.current())
    assert "was" not in entry["policies"]["rules"]
    assert (entry["candidates"]["sdpa_math native"]["backend"], entry["candidates"]["sdpa_math native"]["pad_to"]) == (
        "sdpa_math",
        None,
    )


@pytest.fixture
def five_problems(monkeypatch):
    """The first five problems of the suite, each "timed" instantly."""
    from attnselect.bench import runner as bench

    problems = dict(list(bench.suite(smoke=False).items())[:5])
    monkeypatch.setattr(bench, "suite", lambda smoke: problems)
    monkeypatch.setattr(
        bench,
        "bench_problem",
        lambda problem, target: {
            "problem": problem.to_dict(),
            "describe": problem.describe(),
            "candidates": {},
            "policies": {},
            "best_ms": None,
        },
    )
    monkeypatch.setattr(bench, "render", lambda out, report=None: report)
    return [problem.to_dict() for problem, _ in problems.values()]


def test_shards_stride_through_the_suite_and_merge_in_its_order(tmp_path, five_problems):
    from attnselect.bench import runner as bench

    parts = [bench.run(str(tmp_path / f"part{k}"), shard=(k, 2)) for k in (0, 1)]
    assert [e["problem"] for e in parts[0]["results"]] == five_problems[0::2]
    assert [e["problem"] for e in parts[1]["results"]] == five_problems[1::2]
    assert parts[0]["meta"]["shard"] == "0/2"
    parts[1]["meta"]["date"] = "2099-01-01"  # a shard finished after midnight
    with open(tmp_path / "part1.json", "w") as f:
        json.dump(parts[1], f)
    paths = [str(tmp_path / "part1.json"), str(tmp_path / "part0.json"), str(tmp_path / "part0.json")]
    merged = bench.merge(str(tmp_path / "new" / "all"), paths)  # a part given twice adds nothing
    assert [e["problem"] for e in merged["results"]] == five_problems
    assert (tmp_path / "new" / "all.json").exists()  # a missing folder is made
    assert "shard" not in merged["meta"] and merged["meta"]["date"].endswith(" to 2099-01-01")


def test_only_times_the_problems_whose_description_or_models_match(tmp_path, five_problems):
    from attnselect.bench import runner as bench

    report = bench.run(str(tmp_path / "some"), only=("thd 16 seqs", "no such problem"))
    assert [e["problem"]["layout"] for e in report["results"]] == ["thd", "thd"]  # inference and training
    assert [
        e["problem"] for e in bench.run(str(tmp_path / "by_model"), only=("deepseek-v3",))["results"]
    ] == five_problems  # the first five problems are all DeepSeek-V3's


def test_merge_refuses_parts_of_other_devices_or_other_timings(tmp_path, five_problems):
    from attnselect.bench import runner as bench
    from attnselect.errors import InvalidInputError

    part = bench.run(str(tmp_path / "part0"), shard=(0, 2))
    other = {**part, "meta": {**part["meta"], "device": "another GPU"}}
    with open(tmp_path / "other.json", "w") as f:
        json.dump(other, f)
    with pytest.raises(InvalidInputError, match="parts: expected reports of one device"):
        bench.merge(str(tmp_path / "all"), [str(tmp_path / "part0.json"), str(tmp_path / "other.json")])
    retimed = {**part, "results": [{**part["results"][0], "best_ms": 1.0}]}
    with open(tmp_path / "retimed.json", "w") as f:
        json.dump(retimed, f)
    with pytest.raises(InvalidInputError, match="a second, different timing of"):
        bench.merge(str(tmp_path / "all"), [str(tmp_path / "part0.json"), str(tmp_path / "retimed.json")])


def test_a_part_resumes_only_under_its_own_shard(tmp_path, five_problems):
    from attnselect.bench import runner as bench
    from attnselect.errors import InvalidInputError

    bench.run(str(tmp_path / "part"), shard=(0, 2))
    with pytest.raises(InvalidInputError, match="holds shard 0/2, not 0/3"):
        bench.run(str(tmp_path / "part"), shard=(0, 3))


def test_a_policy_that_finds_nothing_is_recorded_not_raised(monkeypatch):
    from attnselect.bench import runner as bench

    problem = next(iter(bench.suite(smoke=True).values()))[0]

    def nothing(*args, **kwargs):
        raise RuntimeError()  # no message at all

    monkeypatch.setattr(bench, "select", nothing)
    entry = bench.bench_problem(problem, Target.current())
    assert entry["policies"]["measure"] == {"candidate": None, "error": "RuntimeError"}
    assert "median_ms" in entry["policies"]["torch-default"]


def test_a_named_backend_gets_its_own_column_where_it_was_timed(tmp_path):
    from attnselect.bench import runner as bench

    report = bench.run(str(tmp_path / "b"), smoke=True)

    def table(report):
        lines = bench.report_markdown(report).splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("| models"))
        return lines[start], lines[start + 2]

    assert "flash_attn4" not in table(report)[0]  # not installed, not timed: no column
    entry = report["results"][0]
    fastest = entry["best_ms"]
    entry["candidates"]["flash_attn4 native"] = {"median_ms": 2 * fastest, "tflops": 1.0}
    entry["candidates"]["flash_attn4 padded to 192"] = {"median_ms": 4 * fastest, "tflops": 0.5}
    header, row = table(report)
    assert header.split(" | ")[-2] == "flash_attn4" and row.split(" | ")[-2] == "native: 1 (50%)"


def test_te_emulation_never_pads_equal_head_dims():
    a100 = Target.preset("a100")
    odd = AttentionProblem(2, 1024, 1024, 16, 16, 100, 100, torch.bfloat16, mask="causal")
    supported = {v.candidate for v in judge(odd, a100) if v.supported}
    assert odd.pad_target == 104 and te_choice(odd, a100, supported) == Candidate("sdpa_flash")
