"""tests/benchmarks/gpu_check.py: its dry run passes every check a CPU can run, it refuses to pass without CUDA, and
its checks fail when what they check is broken: through the real runs (an optimizer step that does nothing, a model
left in bf16, a wrong precision, corrupt log-probs, sampling where greedy was asked, a slow generation loop) and on
hand-built histories (a NaN loss, a zero gradient, a skipped step, a resume that drifts, a branch not taken)."""

import json
import math
import sys
from contextlib import nullcontext

import pytest
import torch

from conftest import ROOT, run_gpu_check

sys.path.insert(0, str(ROOT / "tests" / "benchmarks"))
import gpu_check  # noqa: E402

import grpo_ssr  # noqa: E402

CPU = torch.device("cpu")


def stderr_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def named_lines(stdout: str) -> dict:
    """The check lines: {name: what follows "name: "}."""
    lines = stdout.splitlines()[: len(gpu_check.CHECKS)]
    return {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in lines}


def json_line(stdout: str) -> dict:
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("{")))


# --- the script, end to end -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_dry_run_on_a_cpu_passes_every_check_a_cpu_can_run(gpu_dry_run):
    proc = gpu_dry_run.result()  # `gpu_check.py --device cpu --small`, run beside the other tests (conftest)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json_line(proc.stdout)
    assert result["checks"] == {**dict.fromkeys(gpu_check.CHECKS, "pass"), "memory": "needs CUDA"}, result["checks"]
    lines = named_lines(proc.stdout)
    assert list(lines) == list(gpu_check.CHECKS)  # one named line each, in order
    assert lines["memory"].startswith("needs CUDA") and lines["parity_sampled"].startswith("pass {")
    assert {name: run["steps"] for name, run in result["runs"].items()} == {
        "ssr": 4,
        "resume_ref": 4,
        "resumed": 2,
        "bf16": 3,
        "branches": 6,
        "dynamic": 3,
    }
    measured = result["measured"]
    assert result["precision"] == "float32" and measured["precision"]["expected"] == "float32"
    assert all(dtypes == ["torch.float32"] for dtypes in measured["precision"]["ran"].values())
    assert sorted(measured["weights_move"]) == ["bf16", "branches", "dynamic", "resume_ref", "ssr"]
    assert all(moved >= gpu_check.MIN_MOVED for moved in measured["weights_move"].values())
    assert measured["bf16_model"]["exp_avg_dtypes"] == ["torch.float32"]
    assert measured["parity_sampled"]["max_abs_diff"] <= 1e-3 and measured["parity_greedy"]["max_gap"] <= 1e-3
    assert measured["throughput"]["ratio"] >= 0.5 and measured["throughput"]["generate_tokens_per_s"] > 0
    assert 0 < measured["memory"]["activations"] < measured["memory"]["bound"]  # the bound is computed on a CPU too
    assert measured["resume"]["tolerance"]["loss"] == [0.0, 0.0]  # a CPU resumes bit for bit
    assert math.isfinite(result["loss"]) and result["gen_tokens_per_s"] > 0 and result["step_s"] > 0
    assert not any(line.startswith("error:") for line in proc.stderr.splitlines())
    assert f"| {len(gpu_check.CHECKS) - 1}/{len(gpu_check.CHECKS)} pass |" in proc.stdout  # the Markdown row


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run")
@pytest.mark.background(2, lambda folder, env: None if torch.cuda.is_available() else run_gpu_check(timeout=120))
def test_without_cuda_the_default_run_fails_on_one_line(background):
    proc = background  # the plain command, beside the other tests
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
    proc = run_gpu_check(timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json_line(proc.stdout)
    assert result["checks"] == dict.fromkeys(gpu_check.CHECKS, "pass"), result["checks"]
    assert result["vocab"] == 151_936 and result["layers"] == 24 and result["max_completion_length"] == 256
    assert result["measured"]["memory"]["peak_gib"] > 0


# --- main(): the exit status and the lines, with the checks stubbed ---------------------------------------------------


def stub_checks(monkeypatch, outcomes: dict) -> None:
    """Each Session.check_<name> returns outcomes[name] (problems or NEEDS_CUDA), or raises it if it is an exception."""
    for name in gpu_check.CHECKS:
        outcome = outcomes.get(name, [])

        def check(self, outcome=outcome):
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        monkeypatch.setattr(gpu_check.Session, f"check_{name}", check)


def test_main_exits_0_when_no_check_failed(monkeypatch, capsys):
    stub_checks(monkeypatch, {"memory": gpu_check.NEEDS_CUDA})
    assert gpu_check.main(["--device", "cpu", "--small"]) == 0
    out = capsys.readouterr()
    assert named_lines(out.out) == {**dict.fromkeys(gpu_check.CHECKS, "pass"), "memory": "needs CUDA"}
    assert out.err == ""


def test_main_names_each_failed_check_on_its_line_and_on_one_error_line(monkeypatch, capsys):
    stub_checks(monkeypatch, {"eos": ["no completion ended"], "resume": RuntimeError("boom\nsecond line")})
    assert gpu_check.main(["--device", "cpu", "--small"]) == 1
    out = capsys.readouterr()
    lines = named_lines(out.out)
    assert lines["eos"] == "fail: no completion ended" and lines["resume"] == "fail: RuntimeError: boom"
    assert [name for name, why in lines.items() if why != "pass"] == ["eos", "resume"]
    assert json_line(out.out)["checks"] == lines
    assert stderr_lines(out.err) == [
        f"error: gpu_check: 2 of {len(gpu_check.CHECKS)} checks failed: eos (no completion ended); "
        "resume (RuntimeError: boom)"
    ]


# --- each check fails when what it checks is broken, through the real runs --------------------------------------------


@pytest.fixture
def session(tmp_path):
    args = gpu_check.parse(["--device", "cpu", "--small"])
    args.max_completion_length = 32
    return gpu_check.Session(args, CPU, gpu_check.SMALL, tmp_path, {"steps": 3})


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    return gpu_check.build(gpu_check.SMALL, CPU)


def test_an_optimizer_step_that_does_nothing_fails_weights_move_and_bf16_model(session, monkeypatch):
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, closure=None: None)
    session.attempt("bf16_model")
    session.attempt("weights_move")
    assert session.checks["bf16_model"].endswith("; 0.0% of the 2-D weights' elements moved in 3 steps at lr 1e-6")
    assert session.checks["weights_move"] == "fail: bf16: 0.0% of the 2-D weights' elements moved"
    session.attempt("steps")  # the gradient was there: only the weights say that nothing was learnt
    assert session.checks["steps"].startswith("fail: ssr: did not finish")
    assert "bf16" not in session.checks["steps"]


def test_a_model_left_in_bf16_fails_bf16_model(session, monkeypatch):
    monkeypatch.setattr(torch.nn.Module, "float", lambda self: self)  # grpo_ssr's conversion to float32 undone
    session.attempt("bf16_model")
    assert session.checks["bf16_model"].startswith("fail: the trained model's parameters are ['torch.bfloat16']")
    assert session.measured["bf16_model"]["exp_avg_dtypes"] == ["torch.bfloat16"]
    assert session.measured["bf16_model"]["moved"] < 0.05  # the updates rounded away but near 0


def test_a_precision_that_is_not_the_devices_fails_precision(session, monkeypatch):
    real = grpo_ssr.pick_device

    def bf16_everywhere(name="auto", bf16=None, num_threads=None):
        device, _ = real(name, bf16, num_threads)
        return device, lambda: torch.autocast(device.type, dtype=torch.bfloat16)

    monkeypatch.setattr(grpo_ssr, "pick_device", bf16_everywhere)
    session.attempt("bf16_model")  # a run, in bf16 autocast where a CPU calls for float32
    session.attempt("precision")
    assert session.checks["precision"] == (
        "fail: bf16: grpo_config.json says 'bf16 autocast', expected 'float32'; "
        "bf16: its Linear layers computed in ['torch.bfloat16'], expected ['torch.float32']"
    )


def test_a_run_that_claims_float32_but_computes_bf16_fails_precision():
    runs = {"ssr": {"record": {"precision": "float32"}, "dtypes": ["torch.bfloat16", "torch.float32"]}}
    assert gpu_check.precision_failures(runs, "float32") == [
        "ssr: its Linear layers computed in ['torch.bfloat16', 'torch.float32'], expected ['torch.float32']"
    ]
    assert gpu_check.precision_failures({"ssr": {**runs["ssr"], "dtypes": ["torch.float32"]}}, "float32") == []


def test_expected_precision_on_a_cpu_is_float32():
    assert gpu_check.expected_precision(CPU) == "float32"


@pytest.mark.parametrize("precision, autocast", [("float32", nullcontext), ("bf16 autocast", None)])
def test_parity_passes_on_the_real_paths_and_fails_on_corrupt_log_probs(small_model, monkeypatch, precision, autocast):
    model, tokenizer = small_model
    autocast = autocast or (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    measured = {}
    assert gpu_check.sampled_parity(model, tokenizer, autocast, precision, 16, 64, measured) == []
    assert measured["tokens"] > 0
    real = grpo_ssr.lean_logps

    def without_temperature(model, ids, mask, keep, temperature, chunk_size):  # the loss's log-probs at T = 1
        return real(model, ids, mask, keep, 1.0, chunk_size=chunk_size)

    monkeypatch.setattr(grpo_ssr, "lean_logps", without_temperature)
    problems = gpu_check.sampled_parity(model, tokenizer, autocast, precision, 16, 64, measured)
    assert len(problems) == 1 and problems[0].startswith("decode-loop log-probs differ from lean_logps'"), problems
    assert measured["mean_abs_diff"] > gpu_check.PARITY_TOLERANCE[precision][1]


def test_greedy_parity_fails_when_greedy_samples(small_model, monkeypatch):
    model, tokenizer = small_model
    measured = {}
    assert gpu_check.greedy_parity(model, tokenizer, nullcontext, "float32", 16, measured) == []
    assert measured["argmax_match_frac"] == 1.0
    real = grpo_ssr.generate_completions
    monkeypatch.setattr(grpo_ssr, "generate_completions", lambda *a, greedy=False, **k: real(*a, **k))
    problems = gpu_check.greedy_parity(model, tokenizer, nullcontext, "float32", 16, measured)
    assert len(problems) == 1 and "nats below the full forward's most likely" in problems[0]
    assert measured["argmax_match_frac"] < 0.5


def test_throughput_fails_when_our_loop_is_grossly_slower(small_model, monkeypatch):
    model, tokenizer = small_model
    real = grpo_ssr.generate_completions

    def slow(*args, **kwargs):  # an order of magnitude slower than ours, however busy the machine: a fixed sleep
        for _ in range(9):  # of 0.5 s was not, beside other processes that slowed model.generate as much (ratio 0.5+)
            real(*args, **kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo_ssr, "generate_completions", slow)
    measured = {}
    problems = gpu_check.throughput(model, tokenizer, nullcontext, 8, CPU, measured)
    assert problems and problems[0].startswith("generate_completions at 0.")
    assert measured["ratio"] < 0.5 and measured["generate_tokens_per_s"] > 0


def test_the_memory_bound_grows_with_the_activations_it_measures(small_model):
    model, _ = small_model
    small = gpu_check.memory_bound(model, nullcontext, False, 1000, 16, 100, 64)
    large = gpu_check.memory_bound(model, nullcontext, False, 2000, 16, 100, 64)
    assert small["saved_bytes_per_token"] > 0
    assert large["activations"] == pytest.approx(2 * small["activations"])
    params = sum(p.numel() for p in model.parameters())
    assert small["state"] == 24 * params and small["bound"] > sum(small[k] for k in ("state", "activations", "head"))


def test_memory_fails_below_the_weights_and_above_the_bound():
    gib = 2**30
    assert gpu_check.memory_failures(10 * gib, 2 * gib, 33 * gib) == []
    assert gpu_check.memory_failures(0, 2 * gib, 33 * gib) == [
        "peak 0.0 GiB, outside [2.0, 33.0] GiB (the weights' bytes, the bound)"
    ]
    assert gpu_check.memory_failures(None, 2 * gib, 33 * gib)[0].startswith("peak None GiB")
    assert gpu_check.memory_failures(40 * gib, 2 * gib, 33 * gib)[0].startswith("peak 40.0 GiB")


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
        (dict(grad_norm=0.0), "step 2: grad_norm 0.0: no gradient"),
        (dict(skipped=1), "step 2: skipped"),
        (dict(nonfinite_steps=1), "nonfinite_steps 1"),
        (dict(skipped_steps=2), "skipped_steps 2"),
    ],
)
def test_a_non_finite_zero_or_skipped_step_fails(bad, named):
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


def test_a_branch_not_taken_fails():
    features = dict(beta=0.04, ssr_mode="replace", num_iterations=2)
    taken = [row(1, kl=0.01, generated=1, replay_frac=0.0), row(2, kl=0.02, generated=0, replay_frac=0.5)]
    assert gpu_check.branch_failures(taken, features, features) == []
    not_taken = [dict(r, generated=1, replay_frac=0.0) for r in taken]
    for r in not_taken:
        del r["kl"]
    assert gpu_check.branch_failures(not_taken, {**features, "beta": 0.0}, features) == [
        "grpo_config.json has beta 0.0, not 0.04",
        "beta > 0 but no step logged a finite kl",
        "num_iterations > 1 but every step generated",
        "SSR replace but no step trained a replayed sample (replay_frac 0)",
    ]
    dynamic = dict(dynamic_sampling=True)
    assert gpu_check.branch_failures([row(1)], dynamic, dynamic) == [
        "dynamic_sampling but no step logged frac_batch_filled"
    ]


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


def test_lean_check_passes_on_the_real_lean_path(small_model):
    measured = {}
    assert gpu_check.lean_check(small_model[0], CPU, "float32", True, 0, measured) == []
    assert measured["logps_max_abs_diff"] <= 1e-4 and measured["grads_rel_diff"] <= 1e-4


@pytest.mark.parametrize("precision", ["float32", "bf16 autocast"])
def test_lean_check_fails_on_a_lean_path_that_ignores_the_temperature(small_model, monkeypatch, precision):
    real = grpo_ssr.lean_logps

    def wrong(model, ids, mask, keep, temperature, chunk_size):
        return real(model, ids, mask, keep, 1.0, chunk_size=chunk_size)

    monkeypatch.setattr(grpo_ssr, "lean_logps", wrong)
    measured = {}
    problems = gpu_check.lean_check(small_model[0], CPU, precision, True, 0, measured)
    assert [p.split(" (> ")[0].split(" by ")[0] for p in problems] == ["log-probs differ", "gradients differ"]
    assert measured["grads_rel_diff"] > 0.2


def test_lean_check_fails_when_lean_logps_falls_back_to_the_full_path(small_model, monkeypatch):
    def fallback(model, ids, mask, keep, temperature, chunk_size):
        return grpo_ssr.per_token_logps(model, ids, mask, keep, temperature)

    monkeypatch.setattr(grpo_ssr, "lean_logps", fallback)
    problems = gpu_check.lean_check(small_model[0], CPU, "float32", True, 0, {})
    assert problems == ["lean_logps ran the output head module: it fell back to the full path, nothing compared"]


def test_a_resume_that_loses_the_optimizer_state_fails_resume(session, monkeypatch):
    real = grpo_ssr.GRPOTrainer.load_checkpoint

    def forgetful(self, path):
        real(self, path)
        self.optimizer.state.clear()  # AdamW starts its moments afresh

    monkeypatch.setattr(grpo_ssr.GRPOTrainer, "load_checkpoint", forgetful)
    session.attempt("resume")
    assert session.checks["resume"].startswith("fail: step 4: grad_norm ")  # step 3's update used fresh moments
    ref, resumed = session.runs["resume_ref"]["history"][-1], session.runs["resumed"]["history"][-1]
    rel, abs_ = gpu_check.RESUME_TOLERANCE["cuda"]["grad_norm"]
    assert abs(ref["grad_norm"] - resumed["grad_norm"]) > abs_ + rel * ref["grad_norm"]  # CUDA's tolerance fails it too
