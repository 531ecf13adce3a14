"""The notebook course: every notebook runs top to bottom in a fresh kernel, none re-defines what grpo_ssr.py
provides (notebooks that copy the script drift from it), and the README's table lists them all."""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpo_ssr  # noqa: E402

NOTEBOOK_DIR = ROOT / "notebooks"
# the course (notebooks/NN_*.ipynb), then the study notebooks beside the studies (notebooks/study/NN_*.ipynb)
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb")) + sorted((NOTEBOOK_DIR / "study").glob("*.ipynb"))


def notebook_id(path: Path) -> str:
    return path.relative_to(NOTEBOOK_DIR).as_posix()


def test_the_course_has_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


# ----------------------------------------------------------------------------------------------------------------------
# Execution
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_notebook_runs_top_to_bottom(path, notebook_runs):
    proc = notebook_runs[path].result()
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stderr[-3000:]}"


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
    return {
        name
        for name, obj in inspect.getmembers(grpo_ssr)
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", None) == grpo_ssr.__name__
    }


def _strip_magics(source: str) -> str:
    """Fallback when IPython is absent: drop cell magics' first line and turn line magics / shell escapes into `pass`
    (keeping the indentation, so the cell still parses)."""
    lines = source.splitlines()
    if lines and lines[0].lstrip().startswith("%%"):
        lines = lines[1:]
    out = []
    for line in lines:
        stripped = line.lstrip()
        indent = line[: len(line) - len(stripped)]
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
        elif (
            isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Lambda) and isinstance(node.target, ast.Name)
        ):
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
        "import grpo_ssr\nx = grpo_ssr.repad",  # using it is fine
        "def repad(x): ...",  # copying it is not
        "%matplotlib inline\nclass ReplayBuffer:\n    pass",  # behind a magic
        "group_advantages = lambda r, g: r",  # a lambda under its name
        "def helper():\n    def grpo_loss(*a):\n        pass",  # nested
        "!ls\nfiles = !ls\ndef my_plot(): pass",  # shell escapes, and a harmless new helper
        "%%bash\necho def repad",  # not Python: ignored
    ]
    assert redefinitions(cells) == {1: {"repad"}, 2: {"ReplayBuffer"}, 3: {"group_advantages"}, 4: {"grpo_loss"}}
    fallback = ast.parse(
        _strip_magics("%%time\n%matplotlib inline\nfiles = !ls\nif True:\n    %time x = 1\ndef repad(): pass")
    )  # the parser used when IPython is absent
    assert [n.name for n in ast.walk(fallback) if isinstance(n, ast.FunctionDef)] == ["repad"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=notebook_id)
def test_notebook_does_not_redefine_grpo_ssr(path):
    nb = json.loads(path.read_text())
    cells = [
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in nb["cells"]
        if c["cell_type"] == "code"
    ]
    found = redefinitions(cells)
    assert not found, f"{path.name} re-defines what grpo_ssr.py provides (import it instead): " + "; ".join(
        f"code cell {i + 1}: {sorted(n)}" for i, n in found.items()
    )


# ----------------------------------------------------------------------------------------------------------------------
# The README lists every notebook
# ----------------------------------------------------------------------------------------------------------------------


def test_readme_lists_every_notebook():
    readme = ROOT / "README.md"
    assert readme.is_file(), "README.md is missing; it should hold a table of the notebooks"
    text = readme.read_text()
    missing = [p.name for p in NOTEBOOKS if p.relative_to(ROOT).as_posix() not in text]
    assert not missing, f"README.md does not link these notebooks (as notebooks/[study/]NAME): {missing}"


# ----------------------------------------------------------------------------------------------------------------------
# Run anywhere: the Colab badge, the first cell, clean outputs
# ----------------------------------------------------------------------------------------------------------------------


def code_sources(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def first_cell() -> str:
    return code_sources(NOTEBOOKS[0])[0]


def repo_slug() -> str:
    """The repository (owner/name) that the first cell fetches from: the one placeholder to change for a fork."""
    line = next(l for l in first_cell().splitlines() if l.startswith("REPO = "))
    return line.split('"')[1]


def test_every_notebook_starts_with_the_same_run_anywhere_cell():
    cell = first_cell()
    assert "from course_setup import setup" in cell and "GRPO_SSR_RAW" in cell
    different = [p.name for p in NOTEBOOKS if code_sources(p)[0] != cell]
    assert not different, f"these notebooks' first code cell differs from {NOTEBOOKS[0].name}'s: {different}"


def test_colab_badges_in_every_notebook_and_in_the_readme():
    slug, readme = repo_slug(), (ROOT / "README.md").read_text()
    for path in NOTEBOOKS:
        url = f"https://colab.research.google.com/github/{slug}/blob/main/{path.relative_to(ROOT).as_posix()}"
        nb = json.loads(path.read_text())
        assert url in "".join(nb["cells"][0]["source"]), f"{path.name}: no Colab badge ({url}) in its first cell"
        assert url in readme, f"README.md: no Colab badge for {path.name}"
    assert f"https://github.com/{slug}" in readme  # the placeholder is stated once in the README's prose


def test_committed_outputs_have_no_widgets():
    for path in NOTEBOOKS:
        text = path.read_text()
        assert "application/vnd.jupyter.widget-view+json" not in text, f"{path.name}: a widget (tqdm bar) in outputs"
        assert "widgets" not in json.loads(text)["metadata"], f"{path.name}: saved widget state in its metadata"


def test_notebook_06_names_the_buffer_settings_it_ran_with():
    """Notebook 06 trains with the default SSR settings: its committed output prints them and its prose names them,
    and both must be today's defaults (the prose once said `replace` after the default had become `fill`)."""
    cfg = grpo_ssr.GRPOConfig()
    nb = json.loads((NOTEBOOK_DIR / "06_real_model.ipynb").read_text())
    printed = "".join("".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"])
    assert f"(ssr_mode {cfg.ssr_mode}, ssr_age_decay {cfg.ssr_age_decay:g})" in printed
    prose = " ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    named = re.findall(r"`ssr_mode` (\w+)", prose)
    assert named and set(named) == {cfg.ssr_mode}, f"the prose names ssr_mode {named}; the default is {cfg.ssr_mode}"


# Every number in the notebooks' prose comes from their own outputs: tests/test_notebook_prose.py.


def test_tqdm_disable_reaches_the_progress_bar(tmp_path, monkeypatch):
    """tqdm.auto picks the notebook bar in Jupyter, and that one ignores TQDM_DISABLE: train() must pass it on."""
    import tqdm.auto

    from conftest import small_config

    seen = []

    class Recorder(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            if kwargs.get("desc") == "GRPO":  # not the bars of transformers' own saving
                seen.append(kwargs.get("disable"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    for value, expected in (("1", True), ("", False)):
        monkeypatch.setenv("TQDM_DISABLE", value)
        grpo_ssr.run(small_config(tmp_path / value, max_steps=1))
        assert seen[-1] is expected


def _remote_copy(tmp_path: Path, broken: bool = False) -> str:
    """A stand-in for the repository's raw URL: the course files copied into a folder, served as file://."""
    import course_setup

    remote = tmp_path / "remote"
    for name in course_setup.COURSE_FILES:
        (remote / name).parent.mkdir(parents=True, exist_ok=True)
        (remote / name).write_bytes((ROOT / name).read_bytes())
    if broken:
        (remote / "grpo_ssr.py").write_text("import a_module_that_does_not_exist\n")
    return remote.as_uri()


def _run_first_cell_in(folder: Path, raw_url: str, then: str):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(first_cell()), nbformat.v4.new_code_cell(then)])
    env = {"GRPO_SSR_RAW": raw_url, "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        NotebookClient(
            nb, timeout=300, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(folder)}}
        ).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return nb.cells


sys.path[:0] = [str(NOTEBOOK_DIR / "course"), str(NOTEBOOK_DIR / "study")]
import os  # noqa: E402


@pytest.mark.slow
def test_first_cell_fetches_the_course_in_a_bare_kernel(tmp_path):
    """A kernel started outside the repository, with the network replaced by a local copy: the cell fetches
    grpo_ssr.py and the course files, and `import grpo_ssr` then works (from the fetched copy)."""
    bare = tmp_path / "bare"
    bare.mkdir()
    import course_setup

    raw = _remote_copy(tmp_path)
    cells = _run_first_cell_in(bare, raw, "import grpo_ssr, checks, run_study\nprint(grpo_ssr.__file__)")
    text = "".join(o.get("text", "") for c in cells for o in c.outputs)
    errors = [o for c in cells for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    # one short line for the ~100 files, not their names; course_setup.py itself came with the cell
    assert f"fetched {len(course_setup.COURSE_FILES) - 1} course files from {raw}\n" in text
    assert "torch" in text and "device" in text
    assert str(bare / "grpo_ssr.py") in text
    study = bare / "notebooks" / "study" / "results" / "replay_study"
    assert (study / "summary.json").is_file() and (bare / "notebooks" / "study" / "run_study.py").is_file()
    assert len(list((study / "raw").glob("*.json.gz"))) == len(
        list((ROOT / "notebooks" / "study" / "results" / "replay_study" / "raw").glob("*.json.gz"))
    )
    assert (bare / "tests" / "benchmarks" / "results" / "recipe_cpu" / "summary.json").is_file()  # notebook 06 reads it


@pytest.mark.slow
def test_first_cell_fails_with_one_line_when_the_import_fails(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    cells = _run_first_cell_in(bare, _remote_copy(tmp_path, broken=True), "print('not reached')")
    error = next(o for o in cells[0].outputs if o.output_type == "error")
    assert error.ename == "SetupError" and len(error.traceback) == 1
    assert "import grpo_ssr failed" in error.traceback[0] and "a_module_that_does_not_exist" in error.traceback[0]


@pytest.mark.slow
@pytest.mark.parametrize("missing", ["notebooks/course/course_setup.py", "notebooks/course/checks.py"])
def test_first_cell_fails_with_one_line_when_the_course_cannot_be_fetched(tmp_path, missing):
    """No network: the raw URL points nowhere (so the cell's own download of course_setup.py fails), or the network
    drops later (course_setup's download of checks.py fails). Either way the cell stops with one line that names the
    file and what to do, and leaves no empty folder behind."""
    if missing.endswith("course_setup.py"):
        raw = (tmp_path / "nowhere").as_uri()
    else:
        raw = _remote_copy(tmp_path)
        (tmp_path / "remote" / missing).unlink()
    bare = tmp_path / "bare"
    bare.mkdir()
    outputs = _run_first_cell_in(bare, raw, "print('not reached')")[0].outputs
    error = next(o for o in outputs if o.output_type == "error")
    assert error.ename == "SetupError" and len(error.traceback) == 1
    shown = "".join(o.get("text", "") for o in outputs) + "\n".join(error.traceback)
    assert "Traceback" not in shown and len(shown.splitlines()) <= 3, shown
    assert f"{missing} from {raw}" in error.traceback[0]
    assert "check the network" in error.traceback[0] and "clone the repository" in error.traceback[0]
    empty = [p for p in bare.rglob("*") if p.is_dir() and not any(p.iterdir())]
    assert not empty, f"empty folders left behind: {empty}"
    if missing.endswith("course_setup.py"):
        assert not any(bare.iterdir())  # nothing fetched, nothing created


def test_course_files_are_what_study_notebook_01_reads():
    """Colab fetches COURSE_FILES: they must hold the replay study's summary, every raw run in the repository and
    run_study.py (whose functions load them), and nothing that no longer exists."""
    import course_setup

    listed = set(course_setup.COURSE_FILES)
    missing = [name for name in listed if not (ROOT / name).is_file()]
    assert not missing, f"COURSE_FILES lists files the repository does not hold: {missing}"
    study = ROOT / "notebooks" / "study" / "results" / "replay_study"
    on_disk = {str(p.relative_to(ROOT)) for p in (study / "raw").glob("*.json.gz")} | {
        "notebooks/study/results/replay_study/summary.json",
        "notebooks/study/run_study.py",
    }
    assert on_disk <= listed, f"not fetched in Colab: {sorted(on_disk - listed)[:5]}"
    summary = json.loads((study / "summary.json").read_text())
    assert len(on_disk) - 2 == len(summary["arms"]) * len(summary["learning_rates"]) * len(summary["settings"]["seeds"])


def test_missing_requirements_names_what_to_install():
    import course_setup

    assert course_setup.missing_requirements() == []  # this environment has everything
    assert "gguf" in course_setup.REQUIREMENTS  # notebook 06's real model is a GGUF checkpoint: Colab must install it
    assert course_setup.missing_requirements({"torch": ("torch", (99, 0)), "no-such-package-xyz": ("x", (1, 0))}) == [
        "torch>=99.0",
        "no-such-package-xyz>=1.0",
    ]


def test_no_notebook_counts_emulated_bf16_as_bf16():
    """torch.cuda.is_bf16_supported() is True on a T4 or V100, which emulate bf16 (pick_device runs float32 there): a
    notebook reports the precision from what autocast does, or asks without emulation."""
    for path in NOTEBOOKS:
        code = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
        assert "is_bf16_supported()" not in code, path.name
