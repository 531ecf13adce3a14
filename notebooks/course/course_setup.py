"""The course's set-up: what the first cell of every notebook runs, so that a notebook works wherever it is opened.

notebooks/ holds the course itself (the numbered notebooks), notebooks/study/ the replay studies (run_study.py beside
its results, and the two study notebooks that read them), and this folder, notebooks/course/, the machinery behind the
exercises: this file, checks.py (the exercises' checks) and solutions/ (their solutions, which tests/test_exercises.py
runs).

- In the repository (the notebook's folder, its parent or its grandparent holds grpo_ssr.py: a course notebook sits in
  notebooks/, a study notebook in notebooks/study/) nothing is fetched or installed.
- Anywhere else (Colab, a bare Jupyter kernel) the course files are downloaded from the repository into the current
  folder, laid out as in the repository, and the packages that are missing or too old are installed with pip.

Then the versions that matter are printed, and if a download or `import grpo_ssr` fails the cell stops with one line
that says why. The repository's address is written once in that cell (and once in the README); the environment
variable GRPO_SSR_RAW replaces it (the tests point it at a local copy, with a file:// URL).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import subprocess
import sys
import urllib.request
from pathlib import Path

# The replay study that study notebook 01 reads: its summary and every run's raw metrics (about 0.75 MB), named as
# notebooks/study/run_study.py names them (a test checks that this list and the folder agree).
STUDY = "notebooks/study/results/replay_study"
STUDY_FILES = (
    f"{STUDY}/summary.json",
    *(
        f"{STUDY}/raw/{arm}-lr{lr}-seed{seed}.json.gz"
        for arm in ("grpo", "filter", "ssr_replace", "ssr_fill", "ssr_fill_decay", "ssr_replace_stale")
        for lr in ("0.001", "0.0003")
        for seed in range(8)
    ),
)
# The replication that study notebook 02 reads: every run's raw metrics (about 60 kB), the four priority arms on seeds
# 8-15 and the optional arms' one seed, named as run_study.py names them.
REPLICATION = "notebooks/study/results/replication/raw"
REPLICATION_FILES = (
    *(
        f"{REPLICATION}/{arm}-lr2e-05-seed{seed}.json.gz"
        for arm in ("grpo", "grpo_skip_empty", "dapo", "ssr_fill_decay")
        for seed in range(8, 16)
    ),
    *(f"{REPLICATION}/{arm}-lr2e-05-seed8.json.gz" for arm in ("filter", "ssr_replace", "ssr_fill")),
)
# The budget study that study notebook 03 reads: every run's raw metrics, four arms on seeds 16-31.
BUDGET = "notebooks/study/results/budget/raw"
BUDGET_FILES = tuple(
    f"{BUDGET}/{arm}-lr2e-05-seed{seed}.json.gz"
    for arm in ("grpo", "dapo", "grpo_matched", "ssr_fresh")
    for seed in range(16, 32)
)
# The exercises' solutions: notebook 10 runs the solution of each exercise not answered yet (`import solutions`).
SOLUTION_FILES = tuple(
    f"notebooks/course/solutions/{name}.py" for name in ("__init__", *(f"nb{n:02d}" for n in range(1, 11)), "study01")
)
COURSE_FILES = (
    "grpo_ssr.py",
    "notebooks/course/course_setup.py",
    "notebooks/course/checks.py",
    *SOLUTION_FILES,
    "notebooks/study/run_study.py",
    "tests/benchmarks/results/recipe_cpu/summary.json",
    *STUDY_FILES,
    *REPLICATION_FILES,
    *BUDGET_FILES,
)
# where the notebooks import from: grpo_ssr, checks and course_setup, run_study
IMPORT_PATHS = (".", "notebooks/course", "notebooks/study")
# pip name -> (import name, lowest major.minor); mirrors requirements.txt
REQUIREMENTS = {
    "torch": ("torch", (2, 4)),
    "transformers": ("transformers", (5, 0)),
    "numpy": ("numpy", (1, 26)),
    "tqdm": ("tqdm", (4, 66)),
    "safetensors": ("safetensors", (0, 4)),
    "matplotlib": ("matplotlib", (3, 8)),
    "gguf": ("gguf", (0, 10)),
}  # notebook 06's real model; the preset fetches its wheel with pip itself


class SetupError(Exception):
    """Shown by IPython as its one-line message, without a traceback."""

    def _render_traceback_(self) -> list[str]:
        return [f"SetupError: {self}"]


def find_root(here: Path) -> Path | None:
    """The repository folder: the notebook's own folder, its parent (a course notebook's notebooks/) or its
    grandparent (a study notebook's notebooks/study/), whichever holds grpo_ssr.py first."""
    return next((p for p in (here, here.parent, here.parent.parent) if (p / "grpo_ssr.py").is_file()), None)


def fetch(base: str, dest: Path) -> list[str]:
    """Download each course file that `dest` does not hold yet; return the ones downloaded. A file (and its folder) is
    written only once it has been read whole, so a failed download leaves no empty folder or partial file."""
    got = []
    for name in COURSE_FILES:
        target = dest / name
        if target.exists():
            continue
        try:
            with urllib.request.urlopen(f"{base.rstrip('/')}/{name}", timeout=60) as response:
                data = response.read()
        except (OSError, ValueError) as e:  # URLError and HTTPError are OSErrors; a malformed URL is a ValueError
            raise SetupError(
                f"could not download {name} from {base} ({getattr(e, 'reason', e)}): check the network, "
                f"or clone the repository and open the notebooks there"
            ) from None
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        got.append(name)
    return got


def _major_minor(version: str) -> tuple[int, int]:
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in version.split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def missing_requirements(requirements: dict = REQUIREMENTS) -> list[str]:
    """pip specifiers for the packages that are absent or older than required."""
    out = []
    for pip_name, (_, lowest) in requirements.items():
        try:
            ok = _major_minor(importlib.metadata.version(pip_name)) >= lowest
        except importlib.metadata.PackageNotFoundError:
            ok = False
        if not ok:
            out.append(f"{pip_name}>={lowest[0]}.{lowest[1]}")
    return out


def setup(base: str, here: Path | None = None) -> Path:
    """Make `import grpo_ssr` work (fetching from `base` and installing only outside the repository); return the
    repository's root folder (the current folder outside it)."""
    here = Path.cwd() if here is None else here
    os.environ.setdefault("TQDM_DISABLE", "1")  # no progress-bar widgets in the notebooks' outputs
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the course needs nothing from the Hub
    root = find_root(here)
    if root is None:  # Colab or a bare kernel
        root = here
        got = fetch(base, root)
        if got:
            print(f"fetched {len(got)} course files from {base}")  # grpo_ssr.py, the checks, the replay study
        missing = missing_requirements()
        if missing:
            print("installing", " ".join(missing))
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=False)
            importlib.invalidate_caches()
    for path in reversed(IMPORT_PATHS):
        if str(root / path) not in sys.path:
            sys.path.insert(0, str(root / path))
    try:
        import grpo_ssr  # noqa: F401
    except Exception as e:
        raise SetupError(
            f"import grpo_ssr failed ({type(e).__name__}: {e}); "
            f"install the packages of requirements.txt and rerun this cell"
        ) from None
    import torch
    import transformers

    device, _ = grpo_ssr.pick_device()
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"device {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )
    return root
