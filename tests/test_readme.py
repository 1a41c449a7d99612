"""The README is true: its example runs, and CI runs its two commands verbatim."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_ci_runs_the_readme_commands_verbatim():
    commands = re.findall(r"^    (pip install .*)$", README, re.M)
    assert commands == ["pip install . && jaxdet report", 'pip install ".[test]" && pytest'], commands
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    for command in commands:
        assert command in ci_lines, f"CI does not run the README command {command!r}"
