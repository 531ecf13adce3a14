"""The health report names a failure only when a run's own metrics show it: each message through the real loop,
and silence on a healthy run."""

import pytest

import grpo_ssr as g


def run(cfg_factory, reward_funcs=None, **overrides):
    """A short tiny-model run at the default batch and completion length; returns its trainer's health report."""
    defaults = dict(
        max_steps=12,
        eval_steps=0,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=64,
        overwrite_output_dir=True,
    )
    trainer = g.GRPOTrainer(cfg_factory(**{**defaults, **overrides}), reward_funcs=reward_funcs)
    trainer.train()
    return trainer.health()


def constant(completions, **kwargs):
    return [1.0] * len(completions)


def names(report: list[str]) -> list[str]:
    keys = {
        "never ended": "truncated",
        "no reward spread": "no_spread",
        "did not move": "flat",
        "at every evaluation": "heldout_flat",
        "exactly 0": "zero_grad",
        "stale": "stale",
        "made no update": "skip",
    }
    return sorted({name for line in report for key, name in keys.items() if key in line})


@pytest.mark.slow
def test_completions_that_never_end_are_named(cfg_factory):
    """With 4 new tokens the tiny model almost never samples its EOS: frac_truncated is near 1 (0.98 here)."""
    report = run(cfg_factory, max_completion_length=4)
    assert "truncated" in names(report) and "--max_completion_length 4 without an EOS" in report[0]
    # 64 tokens: the untrained model ends some (frac_truncated 0.60 over the last 3 steps, the threshold 0.9)
    assert "truncated" not in names(run(cfg_factory, max_steps=6))


@pytest.mark.slow
def test_groups_without_spread_and_a_zero_gradient_are_named(cfg_factory):
    """A constant reward: every group has zero spread, every advantage is 0, and so is every gradient."""
    report = run(cfg_factory, reward_funcs=constant, max_steps=6)  # (frac_truncated 0.75: not named)
    assert names(report) == ["no_spread", "zero_grad"]
    assert any(
        "100% of groups had no reward spread, so their advantages were 0; 100% of the trained samples taught "
        "nothing" in line
        for line in report
    )
    assert any("exactly 0 on 6 of 6 trained steps" in line for line in report)


@pytest.mark.slow
def test_a_learning_rate_too_small_to_move_anything_is_named(cfg_factory):
    """lr 1e-9 (the issue's run, for 24 steps rather than its 60): the training reward stays where it was, and the
    held-out reward is the same number at every evaluation. The reward's change from the first quarter to the last is
    0.1 standard errors here (0.6 over 60 steps; named within 1)."""
    report = run(cfg_factory, learning_rate=1e-9, max_steps=24, eval_steps=12)
    assert names(report) == ["flat", "heldout_flat"] and "--learning_rate (this run: 1e-09)" in "".join(report)


@pytest.mark.slow
def test_stale_replays_are_named(cfg_factory):
    """lr 0.5 wrecks the policy within a few steps, and SSR keeps drawing samples the policy before it made: in 10
    steps the replayed tokens' mean |log ratio| is about 90 (the threshold 1)."""
    report = run(cfg_factory, learning_rate=0.5, max_steps=10, replay_buffer_class="SSRReplayBuffer")
    assert "stale" in names(report), report


@pytest.mark.slow
def test_steps_without_an_update_are_named(cfg_factory):
    """SSR and a constant reward: nothing is ever stored, so every step is skipped after its retries."""
    report = run(
        cfg_factory, reward_funcs=constant, max_steps=3, max_generation_retries=0, replay_buffer_class="SSRReplayBuffer"
    )
    assert "skip" in names(report) and any("3 step(s) made no update: nothing to train on" in l for l in report)


@pytest.mark.slow
def test_non_finite_steps_are_named(cfg_factory, monkeypatch):
    """A loss that is not finite (planted in the real loop's loss) makes no update, and the report says so."""
    real = g.grpo_loss
    monkeypatch.setattr(
        g, "grpo_loss", lambda *a, **kw: (lambda loss, stats: (loss * float("nan"), stats))(*real(*a, **kw))
    )
    report = run(cfg_factory, max_steps=3)
    assert any("3 step(s) made no update: a non-finite loss or gradient" in line for line in report), report


def test_held_out_answers_that_change_without_changing_the_score_are_not_called_unchanged():
    """The trial's run: the greedy completions went from 64 tokens to 1 (EOS first) and both scored -20."""
    evals = [
        {
            "step": s,
            "eval_reward": r,
            "eval_completion_length": 30.0,
            "eval_greedy_reward": -20.0,
            "eval_greedy_completion_length": n,
        }
        for s, r, n in ((0, -31.6, 64.0), (50, -12.1, 1.0), (100, -12.0, 1.0))
    ]
    report = g.health_report([], evals, g.GRPOConfig())
    assert report == [
        "health: the held-out greedy reward was -20 at every evaluation (steps 0 to 100), while its "
        "answers changed (mean length 64 -> 1 tokens): the change did not reach the reward."
    ]
    same = [dict(e, eval_greedy_completion_length=64.0) for e in evals]
    assert "nothing shows the policy changed what it answers" in g.health_report([], same, g.GRPOConfig())[0]


@pytest.mark.slow
def test_groups_without_spread_that_replay_filled_are_not_called_taught_nothing(cfg_factory):
    """SSR fill puts a replayed sample in each zero-advantage slot: those slots did train (in 6 steps, 83% of groups
    lacked spread and no trained sample had advantage 0)."""
    report = run(cfg_factory, reward_funcs="reward_len_binary", replay_buffer_class="SSRReplayBuffer", max_steps=6)
    line = next(l for l in report if "no reward spread" in l)
    assert "replay or resampling filled most of their slots" in line and "taught nothing" not in line, line


def test_the_thresholds_decide(monkeypatch):
    """The report reads the metrics lines alone: a line just past a threshold is named, one just short is not."""
    line = {
        "step": 1,
        "reward": 0.0,
        "reward_std": 1.0,
        "frac_truncated": 0.95,
        "frac_reward_zero_std": 0.4,
        "grad_norm": 1.0,
    }
    cfg = g.GRPOConfig()
    assert names(g.health_report([line] * 4, [], cfg)) == ["truncated"]
    monkeypatch.setattr(g, "TRUNCATED", 0.96)
    assert g.health_report([line] * 4, [], cfg) == []


@pytest.mark.slow
def test_the_default_run_is_healthy_and_says_so_by_saying_nothing(default_run):
    """python grpo_ssr.py as a newcomer runs it: no health line, and the first line is a summary for a person."""
    out = default_run[0]
    assert out.returncode == 0, out.stderr[-2000:]
    assert "health:" not in out.stdout + out.stderr
    assert out.stdout.splitlines()[0].startswith(
        "model tiny on cpu (float32); task builtin, reward reward_len; plain GRPO; 250 step(s) of 16 completions"
    )
