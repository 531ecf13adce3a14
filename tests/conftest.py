import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach the Hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import grpo_ssr  # noqa: E402


# Command-line flags for a two-step run of the tiny model: 8 completions a step, groups of 4, 8 new tokens.
SMALL = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
         "--max_completion_length", "8", "--device", "cpu"]


def small_config(tmp_path, **overrides) -> grpo_ssr.GRPOConfig:
    """A few fast steps of the tiny model: 8 completions a micro-batch, groups of 4, 16 new tokens."""
    base = dict(output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=8, num_generations=4,
                max_completion_length=16, device="cpu", seed=0)
    base.update(overrides)
    return grpo_ssr.GRPOConfig(**base)


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


def cli(args, cwd, timeout=180):
    """Run grpo_ssr.py as a separate process, as a user would."""
    return subprocess.run([sys.executable, str(ROOT / "grpo_ssr.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """`python grpo_ssr.py` as a newcomer runs it, once for the suite: the process and its output folder."""
    cwd = tmp_path_factory.mktemp("default")
    return cli(["--output_dir", str(cwd / "run")], cwd=cwd, timeout=900), cwd / "run"


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
