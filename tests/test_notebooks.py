"""The notebook course: every notebook runs top to bottom in a fresh kernel, none re-defines what grpo_ssr.py
provides (notebooks that copy the script drift from it), and the README's table lists them all."""

from __future__ import annotations

import ast
import inspect
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpo_ssr  # noqa: E402

NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_the_course_has_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


# ----------------------------------------------------------------------------------------------------------------------
# Execution
# ----------------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path):
    """Execute a copy in a fresh kernel with cwd notebooks/, as a reader would; the file on disk is left untouched."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{str(e)[-3000:]}", pytrace=False)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, f"{path.name}: error outputs {[e.get('ename') for e in errors]}"


def test_committed_notebooks_are_executed_and_clean():
    """The notebooks are committed with the outputs of a full run: every code cell ran, in order, and none failed."""
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        counts = [c.get("execution_count") for c in code]
        assert None not in counts, f"{path.name}: some code cells were not executed"
        assert counts == sorted(counts), f"{path.name}: cells were executed out of order"
        errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
        assert not errors, f"{path.name}: committed with error outputs"


# ----------------------------------------------------------------------------------------------------------------------
# No copies of grpo_ssr's functions and classes
# ----------------------------------------------------------------------------------------------------------------------

def provided_names() -> set[str]:
    """Every function and class that grpo_ssr.py itself defines (not the ones it imports)."""
    return {name for name, obj in inspect.getmembers(grpo_ssr)
            if (inspect.isfunction(obj) or inspect.isclass(obj))
            and getattr(obj, "__module__", None) == grpo_ssr.__name__}


def _strip_magics(source: str) -> str:
    """Fallback when IPython is absent: drop cell magics' first line and turn line magics / shell escapes into `pass`
    (keeping the indentation, so the cell still parses)."""
    lines = source.splitlines()
    if lines and lines[0].lstrip().startswith("%%"):
        lines = lines[1:]
    out = []
    for line in lines:
        stripped = line.lstrip()
        indent = line[:len(line) - len(stripped)]
        if stripped.startswith(("%", "!")):
            out.append(indent + "pass")
        elif "=" in stripped and stripped.split("=", 1)[1].lstrip().startswith(("%", "!")):
            out.append(indent + stripped.split("=", 1)[0].rstrip() + " = None")
        else:
            out.append(line)
    return "\n".join(out)


def to_python(source: str) -> str | None:
    """A code cell as plain Python, with IPython magics rewritten the way IPython itself does; None for cells that are
    not Python at all (%%bash, %%html, ...)."""
    first = source.lstrip().splitlines()[0] if source.strip() else ""
    if first.startswith("%%") and first.split()[0] not in ("%%time", "%%timeit", "%%capture", "%%prun"):
        return None
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:
        return _strip_magics(source)
    return TransformerManager().transform_cell(source)


def defined_names(source: str) -> set[str]:
    """Names a code cell defines with def / async def / class (at any depth), or binds to a lambda at top level."""
    python = to_python(source)
    if python is None:
        return set()
    tree = ast.parse(python)  # a SyntaxError here is a real problem with the notebook: let it fail the test
    names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Lambda) \
                and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def redefinitions(cells: list[str]) -> dict[int, set[str]]:
    provided = provided_names()
    found = {i: defined_names(src) & provided for i, src in enumerate(cells)}
    return {i: names for i, names in found.items() if names}


def test_detector_catches_redefinitions():
    """The check below must be able to fail: feed it cells that copy grpo_ssr's code."""
    assert {"repad", "ReplayBuffer", "group_advantages", "grpo_loss"} <= provided_names()
    cells = [
        "import grpo_ssr\nx = grpo_ssr.repad",                 # using it is fine
        "def repad(x): ...",                                       # copying it is not
        "%matplotlib inline\nclass ReplayBuffer:\n    pass",       # behind a magic
        "group_advantages = lambda r, g: r",                       # a lambda under its name
        "def helper():\n    def grpo_loss(*a):\n        pass",     # nested
        "!ls\nfiles = !ls\ndef my_plot(): pass",                   # shell escapes, and a harmless new helper
        "%%bash\necho def repad",                                  # not Python: ignored
    ]
    assert redefinitions(cells) == {1: {"repad"}, 2: {"ReplayBuffer"}, 3: {"group_advantages"}, 4: {"grpo_loss"}}
    fallback = ast.parse(_strip_magics("%%time\n%matplotlib inline\nfiles = !ls\nif True:\n    %time x = 1\n"
                                       "def repad(): pass"))  # the parser used when IPython is absent
    assert [n.name for n in ast.walk(fallback) if isinstance(n, ast.FunctionDef)] == ["repad"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_does_not_redefine_grpo_ssr(path):
    nb = json.loads(path.read_text())
    cells = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
             for c in nb["cells"] if c["cell_type"] == "code"]
    found = redefinitions(cells)
    assert not found, (f"{path.name} re-defines what grpo_ssr.py provides (import it instead): "
                       + "; ".join(f"code cell {i + 1}: {sorted(n)}" for i, n in found.items()))


# ----------------------------------------------------------------------------------------------------------------------
# The README lists every notebook
# ----------------------------------------------------------------------------------------------------------------------

def test_readme_lists_every_notebook():
    readme = ROOT / "README.md"
    assert readme.is_file(), "README.md is missing; it should hold a table of the notebooks"
    text = readme.read_text()
    missing = [p.name for p in NOTEBOOKS if f"notebooks/{p.name}" not in text]
    assert not missing, f"README.md does not link these notebooks (as notebooks/NAME): {missing}"


# ----------------------------------------------------------------------------------------------------------------------
# The study script behind notebook 05
# ----------------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_run_study_end_to_end_and_regenerates_from_raw(tmp_path, capsys):
    """The replay study: raw per-seed data for every (arm, learning rate, seed), paired differences to GRPO with
    bootstrap intervals, cost and staleness; --analyse_only rebuilds the same summary from the raw files alone."""
    sys.path.insert(0, str(NOTEBOOK_DIR))
    import run_study

    import torch

    out = tmp_path / "study"
    args = ["--arms", "grpo", "ssr_fill", "--learning_rates", "1e-3", "--seeds", "0", "1", "--max_steps", "4",
            "--points", "2", "4", "--window", "2", "--bootstrap", "200", "--jobs", "1", "--out_dir", str(out),
            "--set", "max_completion_length=64", "ssr_capacity_scalar=2"]
    threads = torch.get_num_threads()
    try:
        assert run_study.main(args) == 0
    finally:
        torch.set_num_threads(threads)  # the script pins one thread; leave the rest of the suite as it was
    raw = sorted(p.name for p in (out / "raw").iterdir())
    assert raw == [f"{a}-lr0.001-seed{s}.json.gz" for a in ("grpo", "ssr_fill") for s in (0, 1)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["config"]["ssr_capacity_scalar"] == 2
    cell = summary["cells"]["0.001"]
    assert cell["ssr_fill"]["vs_grpo_train"]["auc"]["seeds"] == 2
    assert set(cell["ssr_fill"]["vs_grpo_train"]) == {"auc", "step2", "step4"}
    assert cell["grpo"]["staleness"]["frac_zero_adv_trained"] > 0  # GRPO trains zero-advantage samples
    assert cell["ssr_fill"]["staleness"]["frac_zero_adv_trained"] == 0  # SSR does not
    assert cell["grpo"]["cost"]["completions_per_run"] == 4 * 16
    run = run_study.load_raw(out / "raw")[0]
    assert len(run["train"]["step"]) == 4 and "replay_abs_log_ratio" in run_study.STALENESS
    if not run["eval"]:
        assert any("held-out analysis skipped" in n for n in summary["notes"])
    assert run_study.main(args + ["--analyse_only"]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again == summary  # every number comes back from the raw data
