"""The README tells the truth about the file: its reading map of Part I is the one the file's banners give, and
Part I keeps to its budget."""

import ast
import re

import pytest

from conftest import ROOT


def reading_map(source: str) -> str:
    """The README's table of Part I, computed from grpo_ssr.py: each numbered section's lines and what it defines."""
    lines = source.splitlines()
    part2 = next(i for i, line in enumerate(lines, 1) if line.startswith("# Part II"))
    titles = [
        (i, line[2:]) for i, line in enumerate(lines, 1) if re.match(r"# (\d\. |The settings)", line) and i < part2
    ]
    tree = ast.parse(source)
    rows = [
        "| lines | section | defines |",
        "|---|---|---|",
        f"| 1-{titles[0][0] - 1} | the docstring, imports and the Part I banner | |",
    ]
    for k, (start, title) in enumerate(titles):
        end = (titles[k + 1][0] if k + 1 < len(titles) else part2 - 1) - 1
        names = [
            n.name if hasattr(n, "name") else n.targets[0].id
            for n in tree.body
            if start < n.lineno <= end and (hasattr(n, "name") or isinstance(n, ast.Assign))
        ]
        names = [n for n in names if not n.startswith("_")]
        heading = title.split(":")[0].split(";")[0].rstrip(".")
        rows.append(f"| {start}-{end} | {heading} | {', '.join(f'`{n}`' for n in names)} |")
    rows.append(f"| {part2 - 1}-{len(lines)} | Part II: running it for real | skip on a first read |")
    return "\n".join(rows)


def test_readme_reading_map_matches_the_file():
    source = (ROOT / "grpo_ssr.py").read_text()
    readme = (ROOT / "README.md").read_text()
    expected = reading_map(source)
    assert expected in readme, "README's reading map is stale; it should read:\n" + expected
    part2 = next(i for i, line in enumerate(source.splitlines(), 1) if line.startswith("# Part II"))
    assert f"lines 1-{part2 - 2}" in readme


@pytest.mark.slow
def test_quick_start_commands_run_one_after_another_in_one_folder(quick_start_runs):
    """As a newcomer pastes them: each must start, not collide with the run before it. One small step each (the flags
    are appended, so they win): each command still parses, loads its model, trains and writes its folder; the full
    runs are the default run's test and the benchmarks'."""
    runs = quick_start_runs.result()
    assert len(runs) == 4 and runs[0][0] == "python grpo_ssr.py"
    for command, proc in runs:
        assert proc.returncode == 0, f"{command}: {proc.stderr[-1000:]}"
