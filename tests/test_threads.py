"""Threads, in one place: one torch thread by default for the tiny model, --num_threads, and the count recorded in the
run's record; and, on the command line, a warning in one line."""

import subprocess
import sys

import pytest
import torch

import grpo_ssr as g
from conftest import ROOT, SMALL, cli


def test_threads_default_to_one_for_the_tiny_model_and_are_recorded(cfg_factory, tmp_path, keep_threads):
    torch.set_num_threads(2)
    trainer = g.GRPOTrainer(cfg_factory())
    assert torch.get_num_threads() == 1 and trainer.record_of_run["num_threads"] == 1
    trainer = g.GRPOTrainer(cfg_factory(num_threads=2, output_dir=str(tmp_path / "two")))
    assert torch.get_num_threads() == 2 and trainer.record_of_run["num_threads"] == 2
    model, tok = g.load_model("tiny")  # a model passed from Python keeps torch's setting
    torch.set_num_threads(2)
    trainer = g.GRPOTrainer(cfg_factory(output_dir=str(tmp_path / "obj")), model=model, processing_class=tok)
    assert torch.get_num_threads() == 2 and trainer.record_of_run["num_threads"] == 2
    assert g.parse_cli(["--num_threads", "3"])[0].num_threads == 3
    with pytest.raises(g.ConfigError, match="--num_threads 0"):
        g.GRPOTrainer(cfg_factory(num_threads=0))


def patchy_run(folder, env):
    """Two steps with a reward function that returns None for one completion, on the command line."""
    (folder / "patchy_rewards.py").write_text(
        "def patchy(completions, **kw):\n    return [None] + [1.0] * (len(completions) - 1)\n"
    )
    flags = [*SMALL, "--eval_steps", "0", "--reward_funcs", "patchy_rewards.patchy", "--output_dir", str(folder / "o")]
    return cli(flags, folder, timeout=300, env={**env, "TQDM_DISABLE": "1"})


@pytest.mark.background(4, patchy_run)
def test_on_the_command_line_a_warning_is_one_line(background):
    """A run from the command line prints a warning as one `warning:` line, not Python's two (file:line, then the
    source line that raised it): here, a reward function's None, named once."""
    proc = background
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "patchy" in line]
    assert warned == [
        "warning: reward function 'patchy' returned None for some completions: no score from it there "
        "(a completion no function scores gets advantage 0). Shown once per function."
    ], proc.stderr
    assert "UserWarning" not in proc.stderr and "grpo_ssr.py:" not in proc.stderr


def import_with(theirs):
    """A job: import grpo_ssr in a fresh process, with the user's OMP_WAIT_POLICY `theirs` (None: unset)."""

    def job(folder, env):
        env = {k: v for k, v in env.items() if k != "OMP_WAIT_POLICY"}
        env.update({} if theirs is None else {"OMP_WAIT_POLICY": theirs})
        code = "import grpo_ssr, os, sys; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
        return subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120
        )

    return job


@pytest.mark.parametrize(
    "theirs", [pytest.param(t, marks=pytest.mark.background(2, import_with(t))) for t in (None, "ACTIVE")]
)
def test_openmp_threads_sleep_while_they_wait_unless_the_user_says_otherwise(theirs, background):
    """Spinning OpenMP threads fight another busy process for the cores (tests/benchmarks/bench_threads.py measures
    it): importing grpo_ssr, before torch, makes them sleep; a user's own OMP_WAIT_POLICY wins."""
    assert background.stdout.split() == [theirs or "PASSIVE", "True"], background.stderr
