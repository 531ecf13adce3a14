"""tests/benchmarks/gpu_check.py: its dry run passes every check, it refuses to pass without CUDA, and its verdicts
fail on the histories they exist to catch (a NaN loss, a skipped step, a resume that drifts, a lean path that is off).
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "benchmarks"))
import gpu_check  # noqa: E402

import grpo_ssr  # noqa: E402

SCRIPT = ROOT / "tests" / "benchmarks" / "gpu_check.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


def run_script(*args, timeout=300):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT
    )


def stderr_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def assert_every_check_passed(proc, runs_steps: dict) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[0])
    assert result["checks"] == dict.fromkeys(gpu_check.CHECKS, "pass"), result["checks"]
    assert {name: run["steps"] for name, run in result["runs"].items()} == runs_steps
    assert all(run["nonfinite_steps"] == 0 and run["skipped_steps"] == 0 for run in result["runs"].values())
    assert result["nonfinite_steps"] == 0 and math.isfinite(result["loss"])
    assert result["gen_tokens_per_s"] > 0 and result["step_s"] > 0 and result["gen_calls_measured"] > 0
    assert not any(line.startswith("error:") for line in proc.stderr.splitlines())
    assert f"| {len(gpu_check.CHECKS)}/{len(gpu_check.CHECKS)} pass |" in proc.stdout  # the Markdown row
    return result


# --- the script, end to end -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_dry_run_on_a_cpu_passes_every_check():
    proc = run_script("--device", "cpu", "--small")
    result = assert_every_check_passed(proc, {"ssr": 4, "uniform": 2, "tiny": 6, "resumed": 3})
    assert result["precision"] == "float32" and result["device"] == "cpu" and result["small"] is True
    assert result["resume_tolerance"] == {"reward": [0.0, 0.0], "loss": [0.0, 0.0]}  # a CPU resumes bit for bit
    assert result["lean_logps"]["grads_rel_diff"] <= 1e-4 and result["lean_logps"]["logps_max_abs_diff"] <= 1e-4
    assert result["runs"]["ssr"]["replay_buffer_class"] == "SSRReplayBuffer"
    assert result["runs"]["uniform"]["replay_buffer_class"] == "ReplayBuffer"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run")
def test_without_cuda_the_default_run_fails_on_one_line():
    proc = run_script(timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = stderr_lines(proc.stderr)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: gpu_check: torch ") and "sees no CUDA device" in lines[0]
    assert "--device cpu --small" in lines[0]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_full_check_on_the_gpu_passes():
    proc = run_script(timeout=600)
    result = assert_every_check_passed(proc, {"ssr": 6, "uniform": 3, "tiny": 6, "resumed": 3})
    assert result["device"] == "cuda" and result["gpu"] and result["peak_cuda_allocated_gib"] > 0
    assert result["vocab"] == 151_936 and result["layers"] == 24 and result["max_completion_length"] == 256


# --- main(): the exit status and the one line, with the checks stubbed ------------------------------------------------


def stub_checks(monkeypatch, outcomes: dict) -> None:
    """Each Session.check_<name> returns outcomes[name] (a list of problems), or raises it if it is an exception."""
    for name in gpu_check.CHECKS:
        outcome = outcomes.get(name, [])

        def check(self, outcome=outcome):
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        monkeypatch.setattr(gpu_check.Session, f"check_{name}", check)


def test_main_exits_0_only_when_every_check_passes(monkeypatch, capsys):
    stub_checks(monkeypatch, {})
    assert gpu_check.main(["--device", "cpu", "--small"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out.splitlines()[0])["checks"] == dict.fromkeys(gpu_check.CHECKS, "pass")
    assert out.err == ""


def test_main_names_each_failed_check_on_one_line(monkeypatch, capsys):
    stub_checks(monkeypatch, {"eos": ["no completion ended"], "resume": RuntimeError("boom\nsecond line")})
    assert gpu_check.main(["--device", "cpu", "--small"]) == 1
    out = capsys.readouterr()
    checks = json.loads(out.out.splitlines()[0])["checks"]
    assert checks["eos"] == "fail: no completion ended" and checks["resume"] == "fail: RuntimeError: boom"
    assert [name for name, why in checks.items() if why == "pass"] == [
        "benchmark",
        "steps",
        "eval",
        "buffers",
        "lean_logps",
    ]
    assert stderr_lines(out.err) == [
        "error: gpu_check: 2 of 7 checks failed: eos (no completion ended); resume (RuntimeError: boom)"
    ]


# --- the verdicts, on hand-built histories ----------------------------------------------------------------------------


def row(step, **changes):
    """A training line of a healthy step."""
    base = dict(step=step, loss=0.1, grad_norm=0.5, skipped=0, nonfinite_steps=0, skipped_steps=0, reward=-30.0)
    return {**base, **changes}


def test_a_healthy_history_passes():
    history = [row(1), row(2), row(3)]
    assert gpu_check.step_failures(history) == []
    assert gpu_check.verdict(gpu_check.step_failures(history)) == "pass"


@pytest.mark.parametrize(
    "bad, named",
    [
        (dict(loss=float("nan")), "step 2: loss nan"),
        (dict(loss=None), "step 2: loss None"),  # metrics.jsonl writes NaN as null
        (dict(grad_norm=float("inf")), "step 2: grad_norm inf"),
        (dict(skipped=1), "step 2: skipped"),
        (dict(nonfinite_steps=1), "nonfinite_steps 1"),
        (dict(skipped_steps=2), "skipped_steps 2"),
    ],
)
def test_a_non_finite_or_skipped_step_fails(bad, named):
    problems = gpu_check.step_failures([row(1), row(2, **bad), row(3)])
    assert named in problems
    assert gpu_check.verdict(problems).startswith("fail: ")


def test_a_history_without_steps_or_counters_fails():
    assert gpu_check.step_failures([]) == ["no training step"]
    incomplete = row(1)
    del incomplete["loss"], incomplete["nonfinite_steps"]
    assert gpu_check.step_failures([incomplete]) == ["step 1: no loss, nonfinite_steps"]


def test_verdict_is_one_line_with_the_first_problems():
    assert gpu_check.verdict(["a\nb", "c", "d", "e"]) == "fail: a b; c; d (+1 more)"


def test_eos_needs_a_completion_that_ended():
    truncated = [row(s, frac_truncated=1.0, completion_length=64.0) for s in (1, 2)]
    assert gpu_check.eos_failures(truncated, 64)[0].startswith("no completion ended before 64 tokens")
    assert gpu_check.eos_failures([], 64) == ["no training step"]
    ended = truncated + [row(3, frac_truncated=0.875, completion_length=60.5)]
    assert gpu_check.eos_failures(ended, 64) == []


def test_eval_needs_each_held_out_line_with_a_finite_reward():
    rows = [{"step": 0, "eval_reward": -31.0}, row(1), {"step": 3, "eval_reward": -28.0}]
    assert gpu_check.eval_failures(rows, [0, 3]) == []
    assert gpu_check.eval_failures(rows, [0, 3, 6]) == ["held-out lines at steps [0, 3], expected [0, 3, 6]"]
    rows[2]["eval_reward"] = None
    assert gpu_check.eval_failures(rows, [0, 3]) == ["step 3: eval_reward None"]


def test_resume_is_exact_on_a_cpu_and_catches_a_lost_optimizer_on_cuda():
    reference = [row(s, loss=0.1 * s, reward=-30.0 - s) for s in range(1, 7)]
    same = [dict(r) for r in reference[3:]]
    cpu, cuda = gpu_check.RESUME_TOLERANCE["cpu"], gpu_check.RESUME_TOLERANCE["cuda"]
    assert gpu_check.resume_failures(reference, same, 3, cpu) == []
    noisy = [dict(r, loss=r["loss"] * (1 + 1e-5)) for r in same]  # float noise: not exact, within CUDA's tolerance
    assert gpu_check.resume_failures(reference, noisy, 3, cpu) != []
    assert gpu_check.resume_failures(reference, noisy, 3, cuda) == []
    # What a resume that lost the optimizer state did on a CPU: step 5's reward 1.25 lower, its loss 0.047 lower
    drifted = [dict(r) for r in same]
    drifted[1].update(reward=drifted[1]["reward"] - 1.25, loss=drifted[1]["loss"] - 0.047)
    assert gpu_check.resume_failures(reference, drifted, 3, cuda) == [
        "step 5: reward -36.25 resumed, -35.0 uninterrupted",
        "step 5: loss 0.453 resumed, 0.5 uninterrupted",
    ]
    assert gpu_check.resume_failures(reference, same[:2], 3, cpu) == ["resumed steps [4, 5], expected [4, 5, 6]"]
    assert gpu_check.resume_failures(reference, [], 3, cpu) == ["resumed steps [], expected [4, 5, 6]"]


# --- the lean log-prob check, on the dry run's model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    model, _ = gpu_check.build(gpu_check.SMALL, torch.device("cpu"))
    return model


def test_lean_check_passes_on_the_real_lean_path(small_model):
    measured = {}
    assert gpu_check.lean_check(small_model, torch.device("cpu"), "float32", True, 0, measured) == []
    assert measured["logps_max_abs_diff"] <= 1e-4 and measured["grads_rel_diff"] <= 1e-4


@pytest.mark.parametrize("precision", ["float32", "bf16 autocast"])
def test_lean_check_fails_on_a_lean_path_that_ignores_the_temperature(small_model, monkeypatch, precision):
    real = grpo_ssr.lean_logps

    def wrong(model, ids, mask, keep, temperature, chunk_size):
        return real(model, ids, mask, keep, 1.0, chunk_size=chunk_size)

    monkeypatch.setattr(grpo_ssr, "lean_logps", wrong)
    measured = {}
    problems = gpu_check.lean_check(small_model, torch.device("cpu"), precision, True, 0, measured)
    assert [p.split(" (> ")[0].split(" by ")[0] for p in problems] == ["log-probs differ", "gradients differ"]
    assert measured["grads_rel_diff"] > 0.2


def test_lean_check_fails_when_lean_logps_falls_back_to_the_full_path(small_model, monkeypatch):
    def fallback(model, ids, mask, keep, temperature, chunk_size):
        return grpo_ssr.per_token_logps(model, ids, mask, keep, temperature)

    monkeypatch.setattr(grpo_ssr, "lean_logps", fallback)
    problems = gpu_check.lean_check(small_model, torch.device("cpu"), "float32", True, 0, {})
    assert problems == ["lean_logps ran the output head module: it fell back to the full path, nothing compared"]
