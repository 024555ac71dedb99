"""The bench runner (attnselect.bench.runner): shards timed, resumed and merged; each policy's choice recorded."""

from __future__ import annotations

import json

import pytest

from attnselect import Target


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
