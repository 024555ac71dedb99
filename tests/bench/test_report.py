"""The bench report (attnselect.bench.report): the markdown table of every policy's choice per problem."""

from __future__ import annotations


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
