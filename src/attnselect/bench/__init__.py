"""``attnselect bench``: every candidate and every policy on real model shapes, side by side in one run.

:mod:`~attnselect.bench.runner` chooses the problems, times them and keeps the results (resumable, sharded);
:mod:`~attnselect.bench.report` turns them into a markdown table, a chart and per-policy summaries. The library
itself never imports this package.
"""

from attnselect.bench.report import POLICIES, chart, report_markdown, summary
from attnselect.bench.runner import (
    SETTLE,
    TORCH_DEFAULT,
    bench_problem,
    merge,
    rechoose,
    render,
    run,
    suite,
    timing_rounds,
    useful_tflops,
)

__all__ = [
    "POLICIES", "SETTLE", "TORCH_DEFAULT", "bench_problem", "chart", "merge", "rechoose", "render",
    "report_markdown", "run", "suite", "summary", "timing_rounds", "useful_tflops",
]  # fmt: skip
