"""The README's front door stays true: its CPU example runs, and its test command is the one CI runs."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_cpu_example_runs_as_written(capsys):
    example = re.findall(r"```python\n(.*?)```", README, re.S)[0]
    assert "cuda" not in example
    exec(compile(example, "README.md", "exec"), {})
    assert "running " in capsys.readouterr().out


def test_the_quickstart_test_command_is_the_one_ci_runs_and_the_page_stays_short():
    command = "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q"
    assert command in README and command in (ROOT / ".ci" / "run").read_text()
    assert len(README.splitlines()) <= 200
